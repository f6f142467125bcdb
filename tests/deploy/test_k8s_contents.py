"""What the rendered manifests say is consistent with kvlb and with the engines' launch configs."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import (
    OVERLAYS,
    ROOT,
    all_of,
    arg_after,
    container,
    find,
    port_of,
    rendered,
    selects,
    template_labels,
)

from balancer import config
from balancer.cli.main import build_parser
from balancer.discovery.k8s_objects import build_replica, endpoint_from_pod, pod_annotations

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"


def config_data(resources: list[dict[str, Any]], name: str, key: str) -> str:
    text: str = find(resources, "ConfigMap", name)["data"][key]
    return text


def container_env(resources: list[dict[str, Any]], item: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (Secret values, ``$(VAR)`` expansion)."""
    secrets = {s["metadata"]["name"]: s["data"] for s in all_of(resources, "Secret")}
    env: dict[str, str] = {}
    for entry in item.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"]
            )
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            data = secrets.get(ref["name"], {})
            if ref["key"] in data:
                env[entry["name"]] = base64.b64decode(data[ref["key"]]).decode()
            else:
                assert ref.get("optional"), f"{entry['name']}: {ref} is neither generated nor optional"
    return env


STOP_AFTER_GRACE_HUNG_REDIS_S = 6.2
"""What ``kvlb serve``'s stop took past its drain with Redis hung (SIGSTOPped): 6.04 s (``--workers
1``) and 6.12 s (``--workers 2``) measured on 2026-12-01 (the lease hand-over and the fleet's clients
wait out their timeouts); 0.03 s with Redis down, 0.03-0.04 s with Redis up."""


def cpu_cores(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity (``1``, ``"2"``, ``"500m"``) in cores."""
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_balancer_deployment_is_ha_probed_and_drained(overlay: str) -> None:
    resources = rendered(overlay)
    deployment = find(resources, "Deployment", "kvlb")
    kvlb = container(deployment, "kvlb")
    assert deployment["spec"]["replicas"] >= 2
    hpa = find(resources, "HorizontalPodAutoscaler", "kvlb")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvlb"}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert kvlb["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert kvlb["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pre_stop_s = int(kvlb["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace_s = float(arg_after(kvlb["args"], "--shutdown-grace-s"))
    stop_s = pre_stop_s + grace_s + STOP_AFTER_GRACE_HUNG_REDIS_S
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > stop_s
    # without --workers kvlb runs one worker per core it may use: in a pod with no CPU limit, every
    # core of the node, each with its own index, far past the memory limit sized for one
    # the kubelet's KVLB_PORT=tcp://..., KVLB_SERVICE_HOST... of the Services kvlb and kvlb-redis
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    workers = int(arg_after(kvlb["args"], "--workers"))
    assert 1 <= workers <= max(1, cpu_cores(kvlb["resources"]["requests"]["cpu"]))
    for resource in all_of(resources, "Deployment") + all_of(resources, "StatefulSet"):
        for item in resource["spec"]["template"]["spec"]["containers"]:
            assert {"cpu", "memory"} <= set(item["resources"]["requests"]), item["name"]
    pdb = find(resources, "PodDisruptionBudget", "kvlb")
    assert selects(pdb["spec"]["selector"]["matchLabels"], template_labels(deployment))
    service = find(resources, "Service", "kvlb")
    assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
    monitor = find(resources, "ServiceMonitor", "kvlb")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert (
        monitor["spec"]["endpoints"][0]["port"] == "http"
        and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay: str) -> None:
    resources = rendered(overlay)
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    external = {("Secret", "kvlb-secrets")} if overlay == "prod" else set()  # created out of band
    pods = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    for resource in pods:
        spec = resource["spec"]["template"]["spec"]
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
        for item in spec.get("initContainers", []) + spec["containers"]:
            for entry in item.get("env", []):
                ref = (entry.get("valueFrom") or {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ("Secret", ref["name"]) in names | external, ref
        account = spec.get("serviceAccountName")
        if account:
            assert ("ServiceAccount", account) in names
    for service in all_of(resources, "Service"):
        assert any(selects(service["spec"]["selector"], template_labels(p)) for p in pods), service[
            "metadata"
        ]
    for workload in all_of(resources, "StatefulSet"):
        assert ("Service", workload["spec"]["serviceName"]) in names


def test_rbac_grants_only_what_discovery_needs() -> None:
    resources = rendered("dev")
    role = find(resources, "Role", "kvlb-discovery")
    grants = {
        (tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]
    }
    assert grants == {
        (("discovery.k8s.io",), ("endpointslices",), ("list", "watch")),
        (("",), ("pods",), ("get",)),
    }
    assert not all_of(resources, "ClusterRole") and not all_of(resources, "ClusterRoleBinding")
    binding = find(resources, "RoleBinding", "kvlb-discovery")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvlb", "namespace": "kvlb-dev"}]


def test_balancer_command_and_config_load_as_kvlb_would(tmp_path: Path) -> None:
    resources = rendered("dev")
    kvlb = container(find(resources, "Deployment", "kvlb"), "kvlb")
    assert "command" not in kvlb  # it would replace the image's entrypoint: `tini -- kvlb serve`
    args = build_parser().parse_args(["serve", *kvlb["args"]])
    assert args.config == "/etc/kvlb/config.yaml"
    path = tmp_path / "config.yaml"
    path.write_text(config_data(resources, "kvlb-config", "config.yaml"))
    env = container_env(resources, kvlb)
    settings = config.load(path, env={k: v for k, v in env.items() if k.startswith("KVLB_")})
    assert settings.redis.url == "redis://:6465762d72656469732d70617373776f7264@kvlb-redis:6379/0"
    assert settings.auth.api_keys == ("dev-api-key",) and settings.auth.admin_token == "dev-admin-token"
    assert settings.discovery.kind == "kubernetes" and settings.listen.host == "0.0.0.0"
    assert settings.log_level == "DEBUG"
    assert [p.model for p in settings.pools] == [MODEL]
    for service in all_of(resources, "Service"):
        if service["metadata"]["name"].endswith("-engines"):  # their EndpointSlices inherit these labels
            key, value = settings.discovery.label_selector.split("=")
            assert service["metadata"]["labels"][key] == value


def as_pod(workload: dict[str, Any], ip: str) -> dict[str, Any]:
    """The first pod a StatefulSet creates, as the API server would show it once running."""
    template = workload["spec"]["template"]
    return {
        "metadata": {**template["metadata"], "name": f"{workload['metadata']['name']}-0", "uid": "u-0"},
        "spec": template["spec"],
        "status": {"phase": "Running", "podIP": ip},
    }


def test_sglang_flags_match_the_annotations_discovery_reads() -> None:
    resources = rendered("dev")
    statefulset = find(resources, "StatefulSet", "sglang")
    sglang = container(statefulset, "sglang")
    args = sglang["args"]
    events = json.loads(arg_after(args, "--kv-events-config"))
    launch_default = json.loads((ROOT / "replicas/sglang/kv-events-config.json").read_text())
    assert events == launch_default and events["publisher"] == "zmq"
    assert "--enable-metrics" in args and "--enable-cache-report" in args
    assert (
        sglang["resources"]["requests"]["nvidia.com/gpu"] == sglang["resources"]["limits"]["nvidia.com/gpu"]
    )
    pod = as_pod(statefulset, "10.1.2.3")
    endpoint = endpoint_from_pod(pod)
    assert endpoint is not None
    replica = build_replica(endpoint, pod_annotations(pod), prefix="kvlb.io/", default_model=None)
    event_port = int(events["endpoint"].rsplit(":", 1)[1])
    replay_port = int(events["replay_endpoint"].rsplit(":", 1)[1])
    assert replica.pool_model == MODEL == arg_after(args, "--model-path").replace("$(MODEL)", MODEL)
    assert replica.config.url == f"http://10.1.2.3:{arg_after(args, '--port')}"
    assert replica.config.events == f"tcp://10.1.2.3:{event_port}" and event_port == port_of(
        sglang, "kv-events"
    )
    assert replica.config.replay == f"tcp://10.1.2.3:{replay_port}" and replay_port == port_of(
        sglang, "kv-replay"
    )
    assert replica.config.block_size == int(arg_after(args, "--page-size"))
    assert replica.config.dp_size == int(arg_after(args, "--dp-size"))


def test_trtllm_example_enables_events_reuse_and_stats() -> None:
    resources = rendered("dev")
    statefulset = find(resources, "StatefulSet", "trtllm")
    trtllm = container(statefulset, "trtllm")
    assert trtllm["command"] == ["trtllm-serve"]
    options = yaml.safe_load(config_data(resources, "trtllm-config", "extra-llm-api-config.yaml"))
    assert options == yaml.safe_load((ROOT / "replicas/trtllm/extra-llm-api-config.yaml").read_text())
    assert options["kv_cache_config"]["event_buffer_max_size"] > 0
    assert options["kv_cache_config"]["enable_block_reuse"] is True
    assert options["enable_iter_perf_stats"] is True
    assert arg_after(trtllm["args"], "--config").startswith("/etc/trtllm/")
    pod = as_pod(statefulset, "10.1.2.4")
    endpoint = endpoint_from_pod(pod)
    assert endpoint is not None
    replica = build_replica(endpoint, pod_annotations(pod), prefix="kvlb.io/", default_model=None)
    assert replica.config.engine == "trtllm" and replica.config.events is None
    assert replica.config.block_size == options["kv_cache_config"]["tokens_per_block"]
    assert replica.config.url == f"http://10.1.2.4:{arg_after(trtllm['args'], '--port')}"


def test_redis_runs_without_persistence_behind_a_password() -> None:
    resources = rendered("dev")
    statefulset = find(resources, "StatefulSet", "kvlb-redis")
    redis = container(statefulset, "redis")
    args = redis["args"]
    assert arg_after(args, "--save") == "" and arg_after(args, "--appendonly") == "no"
    assert arg_after(args, "--requirepass") == "$(REDIS_PASSWORD)"
    assert arg_after(args, "--maxmemory-policy") == "noeviction"
    assert "volumeClaimTemplates" not in statefulset["spec"]
    password = container_env(resources, redis)["REDIS_PASSWORD"]
    kvlb = container(find(resources, "Deployment", "kvlb"), "kvlb")
    assert f":{password}@" in container_env(resources, kvlb)["KVLB_REDIS__URL"]


class _Files(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local stand-in for the Hub: serves ``<repo>/resolve/main/<file>`` from a folder."""
    root = tmp_path / "hub"
    files = root / "org" / "model" / "resolve" / "main"
    files.mkdir(parents=True)
    (files / "tokenizer.json").write_text('{"model": {}}')
    (files / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Files, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", tmp_path / "out"
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_tokenizer_init_container_downloads_once(hub: tuple[str, Path]) -> None:
    endpoint, target = hub
    script = ROOT / "deploy/k8s/base/fetch-tokenizer.py"
    env = {"HF_MODEL": "org/model", "HF_ENDPOINT": endpoint, "TOKENIZER_DIR": str(target)}
    first = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert json.loads((target / "tokenizer.json").read_text()) == {"model": {}}
    assert (target / "tokenizer_config.json").exists() and first.stdout.count("bytes") == 2
    again = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert again.returncode == 0 and again.stdout == ""  # already there: nothing downloaded
    missing = subprocess.run(
        [sys.executable, str(script)], env={}, capture_output=True, text=True, timeout=30
    )
    assert missing.returncode == 2 and "HF_MODEL" in missing.stderr
