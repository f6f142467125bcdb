"""The first mistakes a new user makes with ``kvlb``, through the real command in a subprocess.

Each one must end with a clear message on stderr, naming what is wrong, a non-zero exit status and no
traceback: a port in use (one worker or the supervisor of two; for gRPC without the gRPC core's own
log line), a port beyond 65,535, a policy or weight that does not exist, a worker that cannot start
(before: the supervisor restarted it for 120 s and then printed a ``TimeoutError`` traceback; then
each worker printed its error), an unknown log level, an unknown option (said
by the subcommand that got it, with its usage) and a reader that closed the output early.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_harness import MODEL, Child, start_serve, stop

COMMAND_TIMEOUT_S = 60.0
"""A command of these tests ends well within this (most within 2 s, a worker's start within 10 s)."""


def clean_env() -> dict[str, str]:
    """The test's environment without any ``KVLB_*`` setting of the machine."""
    return {name: value for name, value in os.environ.items() if not name.startswith("KVLB_")}


def kvlb(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "balancer", *argv],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=clean_env(),
        check=False,
    )


def said(stderr: str) -> list[str]:
    """The lines ``kvlb serve`` wrote itself (not its log lines, which carry a timestamp)."""
    return [line for line in stderr.splitlines() if line.startswith("kvlb serve:")]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 some other program is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_port_in_use_is_one_line_and_exit_2(held_port: int, workers: int) -> None:
    done = kvlb("serve", "--workers", str(workers), "--set", f"listen.port={held_port}")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert said(done.stderr) == [
        f"kvlb serve: listen.port: cannot bind 127.0.0.1:{held_port}: Address already in use"
    ]


def test_a_port_beyond_65535_is_refused_not_wrapped_around() -> None:
    # before: one worker served on 99999 - 65536 = 34463, the supervisor printed an OverflowError traceback
    for workers in ("1", "2"):
        done = kvlb("serve", "--workers", workers, "--set", "listen.port=99999")
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == ["kvlb serve: listen.port must be in [0, 65535], got 99999"]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "policy.name=nope",
            "kvlb serve: unknown policy 'nope'; known: cost, least_load, power_of_two, random, round_robin, "
            "session, sglang_threshold",
        ),
        ("policy.weights.overlap_credit=-1", "kvlb serve: policy.overlap_credit must be in [0, 4], got -1.0"),
    ],
)
def test_a_bad_policy_is_one_line_before_any_worker_starts(setting: str, message: str) -> None:
    started = time.monotonic()
    done = kvlb("serve", "--workers", "2", "--set", "listen.port=0", "--set", setting)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [message]  # once, not once per worker and restart
    assert time.monotonic() - started < 10.0  # no worker loaded a tokenizer first


@pytest.mark.parametrize("workers", [1, 2])
def test_a_grpc_port_in_use_is_one_line_without_the_grpc_core_s_own(held_port: int, workers: int) -> None:
    # before: the gRPC core logged "E... add_port.cc:83] Failed to add port ..." first, and with two
    # workers each of them did, each followed by kvlb's line
    done = kvlb(
        "serve", "--workers", str(workers), "--set", "listen.port=0", "--set", f"listen.grpc_port={held_port}"
    )
    assert done.returncode == 2, done.stderr
    assert "add_port" not in done.stderr, done.stderr
    assert said(done.stderr) == [
        f"kvlb serve: listen.grpc_port: cannot bind 127.0.0.1:{held_port}: Address already in use"
    ]


def test_a_worker_that_cannot_start_fails_the_start_once_instead_of_restarting(tmp_path: Path) -> None:
    # TLS material is loaded by each worker: only a worker finds it missing
    missing = tmp_path / "missing"
    started = time.monotonic()
    done = kvlb(
        "serve",
        "--workers",
        "2",
        "--set",
        "listen.port=0",
        "--set",
        f"listen.tls_cert_file={missing}.pem",
        "--set",
        f"listen.tls_key_file={missing}.key",
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = said(done.stderr)
    assert len(lines) == 2, done.stderr  # the error once (before: once per worker), then the supervisor's
    assert lines[0].startswith("kvlb serve: listen.tls_cert_file / listen.tls_key_file: cannot load"), lines
    assert lines[1].endswith(
        "while the workers started (its settings error is above); the other workers were stopped"
    ), done.stderr
    assert "restarting" not in done.stderr
    assert time.monotonic() - started < 30.0  # before: 120 s of restarts, then a TimeoutError traceback


def test_an_unknown_log_level_is_one_line() -> None:
    done = kvlb("serve", "--workers", "1", "--set", "listen.port=0", "--log-level", "loud")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "kvlb serve: --log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"
    ]
    setting = kvlb("serve", "--workers", "1", "--set", "listen.port=0", "--set", "log_level=loud")
    assert setting.returncode == 2, setting.stderr
    assert setting.stderr.splitlines() == [
        "kvlb serve: log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'"
    ]


def test_an_unknown_option_is_reported_by_the_subcommand_that_got_it() -> None:
    done = kvlb("serve", "--bogus")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: kvlb serve ")
    assert done.stderr.splitlines()[-1] == "kvlb serve: error: unrecognized arguments: --bogus"
    nested = kvlb("admin", "policy", "set", "decode_weight=0.2", "--bogus")
    assert nested.returncode == 2
    assert nested.stderr.splitlines()[-1] == "kvlb admin policy set: error: unrecognized arguments: --bogus"


def test_the_help_states_the_defaults_the_commands_use() -> None:
    from loadtests.demo.run import DemoShape

    demo = kvlb("demo", "--help")
    assert demo.returncode == 0
    assert f"requests per run (default {DemoShape().requests})" in " ".join(demo.stdout.split())
    loadtest = kvlb("loadtest", "--help")
    assert loadtest.returncode == 0
    assert "%%" not in loadtest.stdout and "more than 1% failed requests" in " ".join(loadtest.stdout.split())


async def test_output_to_a_reader_that_left_is_no_traceback(tmp_path: Path) -> None:
    config = tmp_path / "kvlb.yaml"
    config.write_text(
        f"pools: [{{model: {MODEL}, replicas: "
        '[{id: a, url: "http://127.0.0.1:9", engine: sglang, block_size: 16}]}]\n'
    )
    server: Child = await start_serve(tmp_path, config, "--workers", "1", "--set", "listen.port=0")
    try:
        read_end, write_end = os.pipe()
        os.close(read_end)  # `kvlb admin policy get | head -0`: nobody reads
        try:
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "balancer", "admin", "--url", server.info["url"], "policy", "get"],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=COMMAND_TIMEOUT_S,
                env=clean_env(),
                check=False,
            )
        finally:
            os.close(write_end)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    finally:
        assert await stop(server) in (0, -signal.SIGTERM)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("simulate", "--smoke", "--param", "bogus=1"),
            "kvlb simulate: workload 'tenants': TenantsWorkload.__init__() got an unexpected keyword "
            "argument 'bogus'",
        ),
        (
            ("tune", "--smoke", "--param", "bogus=1"),
            "kvlb tune: workload 'tenants': TenantsWorkload.__init__() got an unexpected keyword "
            "argument 'bogus'",
        ),
        (
            ("bench", "overhead", "--smoke", "--kinds", "nope"),
            "kvlb bench overhead: kinds must be among chat_shared, chat, chat_cold, tokens, tokens_shared, "
            "grpc_tokens, got nope",
        ),
        (
            ("loadtest", "--workload", "nope"),
            "kvlb loadtest: unknown workload 'nope'; known: agent, chat, mooncake, rag, tenants, unique",
        ),
        (
            ("loadtest", "--workload", "mooncake", "--trace", "no-such-trace.jsonl"),
            "kvlb loadtest: --trace no-such-trace.jsonl: No such file or directory",
        ),
        (
            ("bench", "overhead", "--smoke", "--workers", "x"),
            "kvlb bench overhead: invalid literal for int() with base 10: 'x'",
        ),
    ],
)
def test_a_tools_bad_value_is_one_line(argv: tuple[str, ...], message: str) -> None:
    # before: a traceback out of the running simulation (the workload is built at its first request)
    # and out of the benchmark's shape; kvlb loadtest started its fleet of 8 replicas first, exit 1
    done = kvlb(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [message]


@pytest.mark.parametrize("option", ["--base-port", "--event-port-base"])
def test_an_emulator_port_in_use_is_one_line(held_port: int, option: str) -> None:
    # before: an OSError (HTTP) or ZMQError (events) traceback, exit 1
    done = kvlb("emulate", "--replicas", "1", "--tokenizer", "none", option, str(held_port))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("kvlb emulate:")]
    assert line.startswith("kvlb emulate: cannot start the replicas: ")
    assert "already in use" in line.lower() and str(held_port) in line


def test_an_admin_url_without_a_scheme_is_one_line() -> None:
    done = kvlb("admin", "--url", "127.0.0.1:8000", "replicas")  # before: a ValueError traceback
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "kvlb admin: need an http(s):// --url and --timeout-s > 0, got '127.0.0.1:8000' and 10"
    ]


async def test_serving_no_pool_says_so(tmp_path: Path) -> None:
    # `kvlb serve` with no --config listens and knows no model: before, only 'kvlb serving 0 pool(s)'
    config = tmp_path / "empty.yaml"
    config.write_text("pools: []\n")
    server: Child = await start_serve(tmp_path, config, "--workers", "1", "--set", "listen.port=0")
    assert await stop(server) in (0, -signal.SIGTERM)  # the warning comes before the announcement
    assert "no pools configured: every /v1 request will be refused" in server.stderr.read_text()
