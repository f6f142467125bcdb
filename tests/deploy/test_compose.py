"""deploy/compose validates as a Compose file, and its services agree with each other and with kvlb."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import DEPLOY, ROOT

from balancer import config
from balancer.cli.main import build_parser
from loadtests.emulate import COMMAND as EMULATE
from replicas.sim.profiles import PROFILES

COMPOSE = DEPLOY / "compose" / "docker-compose.yaml"


def compose() -> dict[str, Any]:
    """The file as Docker reads it: YAML anchors and ``<<`` merge keys resolved."""
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def docker_entrypoint() -> list[str]:
    line = next(x for x in (ROOT / "Dockerfile").read_text().splitlines() if x.startswith("ENTRYPOINT"))
    entrypoint: list[str] = json.loads(line.removeprefix("ENTRYPOINT"))
    return entrypoint


IMAGE_INIT = ["tini", "--"]
"""The image's PID 1, before every kvlb command (the Dockerfile's ``ENTRYPOINT``)."""


def argv(service: dict[str, Any]) -> list[str]:
    """The service's kvlb command line (entrypoint, else the image's, then the command) after the
    image's init, which every service of the image keeps."""
    command = list(service.get("entrypoint") or docker_entrypoint()) + list(service.get("command") or [])
    assert command[: len(IMAGE_INIT)] == IMAGE_INIT, command
    return command[len(IMAGE_INIT) :]


def test_compose_file_validates() -> None:
    compose_spec = pytest.importorskip("compose_spec", reason="pip install compose-spec")
    parsed = compose_spec.PyCompose.from_json(json.dumps(compose()))
    assert set(parsed.service_names()) == {
        "net",
        "redis",
        "kvlb-a",
        "kvlb-b",
        "sim-0",
        "sim-1",
        "sim-2",
        "sim-3",
    }
    typo = compose()
    typo["services"]["redis"]["helthcheck"] = typo["services"]["redis"].pop("healthcheck")
    with pytest.raises(ValueError, match="helthcheck"):
        compose_spec.PyCompose.from_json(json.dumps(typo))


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="the docker compose plugin is not installed",
)
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def sim_replicas() -> dict[str, dict[str, Any]]:
    """What each sim service serves, from its own flags through ``kvlb emulate``'s real port layout."""
    served = {}
    for name, service in compose()["services"].items():
        if not name.startswith("sim-"):
            continue
        command = argv(service)
        assert command[:2] == ["kvlb", "emulate"]
        args = build_parser().parse_args(command[1:])
        (replica,) = EMULATE.spec_from_args(args).configs()
        served[name] = {
            "engine": replica.engine,
            "model": PROFILES[args.profile].model,
            "http": replica.http_port,
            "events": replica.event_port if replica.engine == "sglang" else None,
            "replay": replica.replay_port if replica.engine == "sglang" else None,
            "block_size": replica.block_size,
        }
    return served


def test_balancers_route_to_exactly_the_emulated_replicas(tmp_path: Path) -> None:
    services = compose()["services"]
    served = sim_replicas()
    assert len(served) == 4
    ports = {int(p.split(":")[0]) for p in services["net"]["ports"]}
    for name in ("kvlb-a", "kvlb-b"):
        service = services[name]
        args = build_parser().parse_args(argv(service)[1:])
        assert args.handler.__name__ == "run_serve"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
        source = (COMPOSE.parent / mounts[args.config]).resolve()
        env = {k: str(v) for k, v in service["environment"].items()}
        settings = config.load(source, args.set, env=env)
        assert settings.listen.host == "0.0.0.0" and settings.listen.port in ports
        assert settings.redis.url == "redis://127.0.0.1:6379/0"
        (pool,) = settings.pools
        replicas = {r.id: r for r in pool.replicas}
        assert set(replicas) == set(served)
        for replica_id, sim in served.items():
            replica = replicas[replica_id]
            assert pool.model == sim["model"]
            assert replica.engine == sim["engine"] and replica.block_size == sim["block_size"]
            assert replica.url == f"http://127.0.0.1:{sim['http']}"
            events = None if sim["events"] is None else f"tcp://127.0.0.1:{sim['events']}"
            replay = None if sim["replay"] is None else f"tcp://127.0.0.1:{sim['replay']}"
            assert (replica.events, replica.replay) == (events, replay)
    assert ports == {8000, 8001}


def test_every_service_shares_the_loopback_of_net() -> None:
    services = compose()["services"]
    for name, service in services.items():
        if name != "net":
            assert service["network_mode"] == "service:net", name
            assert "ports" not in service, f"{name}: publish ports on net, not here"
    used = [p for s in sim_replicas().values() for p in (s["http"], s["events"], s["replay"]) if p]
    assert len(used) == len(set(used)) and not {6379, 8000, 8001} & set(used)
