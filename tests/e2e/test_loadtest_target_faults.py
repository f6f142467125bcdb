"""``kvlb loadtest --target`` and ``kvlb capacity --target`` as a CI job runs them, against endpoints
that misbehave: a real aiohttp server on 127.0.0.1 behind a path prefix and credentials, whose answer
to each request is chosen by its ``x-request-id`` (500, 429 with Retry-After, 404, a stream cut
mid-way, no ``data: [DONE]``, a body that is not JSON, a first byte past the timeout, more cached
tokens than prompt tokens, no usage, an error event), and the real CLI in a subprocess.

Each test checks what the job reads: the exit code, ``report.json`` (the failures by kind, the hit
rate within [0, 1]), ``report.md``, the plots, nothing on stdout, no secret in any output; a bad
argument is one line and exit 2; SIGINT mid-run writes the partial report and exits 130.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from balancer.cli.main import main
from loadtests.stats import RequestRecord
from loadtests.target import EXIT_CUT_SHORT
from loadtests.target_access import redact_argv, redact_url
from loadtests.target_report import error_kind

PREFIX = "/team-a/v1"
USER, PASSWORD = "ci", "pw-s3cret"
HEADER_SECRET = "hdr-s3cret"
API_KEY = "key-s3cret"

MODES = (
    "ok", "e500", "e429", "e404", "cut", "nodone", "nonjson", "slow", "cachedbig", "nousage",
    "error_event", "ok",
)  # fmt: skip
"""The answer to request ``tenants-<i>`` is ``MODES[i]``."""

EXPECTED_KINDS = {
    "http_500": 1, "http_429": 1, "http_404": 1, "ClientPayloadError": 1, "no_done": 1,
    "JSONDecodeError": 1, "timeout": 1, "error_event": 1,
}  # fmt: skip

WORKLOAD = [
    "--workload", "tenants", "--param", "tenants=2", "--param", "users_per_tenant=1",
    "--param", "context_tokens=40", "--param", "question_tokens=8", "--param", "max_tokens=3",
]  # fmt: skip


@dataclass
class Target:
    url: str
    authorizations: list[str] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    hang: str = "none"
    """``all``: every chat request waits 30 s before its first byte (cut at cleanup); ``odd``: those of
    odd index; ``after10``: every one after the first ten; ``none``: as :data:`MODES` says."""
    chats: int = 0


def _chunk(content: str | None = None, usage: dict[str, object] | None = None) -> bytes:
    event: dict[str, object] = {
        "object": "chat.completion.chunk",
        "choices": [] if content is None else [{"index": 0, "delta": {"content": content}}],
    }
    if usage is not None:
        event["usage"] = usage
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@asynccontextmanager
async def misbehaving_target(
    *, auth: str, hang: str = "none", list_models: bool = True
) -> AsyncIterator[Target]:
    """The server on 127.0.0.1; every route under :data:`PREFIX` and answered only with ``auth`` as
    ``Authorization`` (401 otherwise); ``GET /models`` answers 404 unless ``list_models``."""
    target = Target(url="", hang=hang)

    def authorized(request: web.Request) -> bool:
        target.authorizations.append(request.headers.get("Authorization", ""))
        return request.headers.get("Authorization") == auth

    async def models(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.Response(status=401)
        if not list_models:
            return web.Response(status=404, text="404: Not Found")
        return web.json_response({"object": "list", "data": [{"id": "m-1"}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        if not authorized(request):
            return web.Response(status=401)
        if len(target.authorizations) >= (14 if target.hang == "after10" else 4):
            target.arrived.set()
        target.chats += 1
        index = int(request.headers.get("x-request-id", "x-0").rsplit("-", 1)[1])
        mode = "ok" if target.hang in ("odd", "after10") else MODES[index % len(MODES)]
        hang = target.hang == "all" or (target.hang == "odd" and index % 2)
        if hang or (target.hang == "after10" and target.chats > 10) or mode == "slow":
            await asyncio.sleep(30)
        if mode in ("e500", "e429", "e404"):
            status = int(mode[1:])
            headers = {"Retry-After": "1"} if status == 429 else {}
            return web.Response(status=status, text=f"<html>{status}\n</html>", headers=headers)
        if mode == "nonjson":
            return web.Response(text="<html>not json</html>", content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvlb-replica": "r-0"})
        await response.prepare(request)
        if mode == "error_event":
            await response.write(b'data: {"error": {"message": "overloaded"}}\n\n')
            await response.write_eof()
            return response
        cached = 500 if mode == "cachedbig" else 40
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        for i in range(3):
            await response.write(_chunk("tok"))
            if mode == "cut" and i == 1:
                assert request.transport is not None
                request.transport.close()
                return response
        if mode != "nousage":
            await response.write(_chunk(usage=usage))
        if mode != "nodone":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get(PREFIX + "/models", models)
    app.router.add_post(PREFIX + "/chat/completions", chat)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        target.url = f"127.0.0.1:{runner.addresses[0][1]}{PREFIX}"
        yield target
    finally:
        await runner.cleanup()


async def _kvlb(
    *argv: str,
    env: dict[str, str] | None = None,
    interrupt_when: asyncio.Event | None = None,
    signum: signal.Signals = signal.SIGINT,
    sigint_ignored: bool = False,
) -> tuple[int, str, str]:
    """``python -m balancer ARGV``: exit code, stdout, stderr. With ``interrupt_when``, ``signum``
    (SIGINT) once it is set. With ``sigint_ignored`` the command starts with SIGINT ignored, as a
    shell's ``&`` without job control starts it (``sh``'s ``trap '' INT``, kept across its ``exec``);
    else with what this process inherited."""
    command = [sys.executable, "-m", "balancer", *argv]
    if sigint_ignored:
        command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command]
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        if interrupt_when is not None:
            async with asyncio.timeout(20):
                await interrupt_when.wait()
            process.send_signal(signum)
        async with asyncio.timeout(60):
            stdout, stderr = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


def _outputs(out: Path, *streams: str) -> str:
    return "\n".join(
        [*(p.read_text(errors="replace") for p in out.iterdir() if p.suffix != ".png"), *streams]
    )


async def test_failures_by_kind_implausible_cache_prefix_and_no_secret_in_outputs(tmp_path: Path) -> None:
    basic = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    async with misbehaving_target(auth=basic) as target:
        out = tmp_path / "report"
        code, stdout, stderr = await _kvlb(
            "loadtest", "--target", f"http://{USER}:{PASSWORD}@{target.url}", *WORKLOAD,
            "--requests", str(len(MODES)), "--rate", "40", "--timeout-s", "1", "--max-duration-s", "20",
            "--header", f"x-team: {HEADER_SECRET}", "--slo", "error_rate=0.9", "--out", str(out),
        )  # fmt: skip
    assert code == 0, stderr[-3000:]  # 8 of 12 failed: within the SLO of 0.9
    assert stdout == ""  # the progress bar and the table go to stderr
    assert "Traceback" not in stderr
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert report["meta"]["model"] == "m-1"  # GET <prefix>/models, with the URL's credentials
    assert (summary["requests"], summary["ok"], summary["errors"], summary["timeouts"]) == (12, 4, 8, 1)
    assert report["errors_by_kind"] == EXPECTED_KINDS
    # only the two plausible answers count: 40 of 100 each; the 500 cached of 100 is left out
    assert report["cached_tokens_implausible"] == 1
    assert summary["hit_rate"] == pytest.approx(0.4)
    assert summary["replica_share"] == {"r-0": 1.0}
    markdown = (out / "report.md").read_text()
    assert "| error kind | requests |" in markdown and "| http_429 | 1 |" in markdown
    assert "left out of the hit rate" in markdown
    for line in markdown.splitlines():  # each failure on one line of the list, HTML shown as text
        assert not line.startswith("- `") or (line.count("`") == 2 and "<" not in line)
    assert "HTTP 500: &lt;html>500 &lt;/html>" in markdown
    assert (out / "ttft_cdf.png").stat().st_size > 0 and (out / "replica_share.png").exists()
    assert len((out / "requests.jsonl").read_text().splitlines()) == 12
    outputs = _outputs(out, stdout, stderr)
    assert PASSWORD not in outputs and HEADER_SECRET not in outputs
    assert f"{USER}:***@" in report["meta"]["target"] and "x-team:***" in report["meta"]["command"]
    assert set(target.authorizations) == {basic}


async def test_sigint_mid_run_writes_the_partial_report_and_exits_130(tmp_path: Path) -> None:
    async with misbehaving_target(auth=f"Bearer {API_KEY}", hang="all") as target:
        out = tmp_path / "report"
        code, stdout, stderr = await _kvlb(
            "loadtest", "--target", f"http://{target.url}", *WORKLOAD, "--requests", "40", "--rate", "20",
            "--timeout-s", "30", "--api-key-env", "LOADTEST_KEY", "--slo", "ttft_p90_s=5s",
            "--no-plots", "--out", str(out),
            env={"LOADTEST_KEY": API_KEY},
            interrupt_when=target.arrived,
        )  # fmt: skip
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "stopped by SIGINT" in stderr
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert report["status"] == "interrupted" and report["meta"]["stop_reason"] == "interrupted"
    assert "stopped by SIGINT" in report["note"] and "partial results" in report["note"]
    # every request sent was in flight (the target holds them): cancelled, not errors
    assert 3 <= summary["cancelled"] == summary["requests"] < 40
    assert summary["errors"] == 0 and report["errors_by_kind"] == {}
    assert len((out / "requests.jsonl").read_text().splitlines()) == summary["requests"]
    assert "**Interrupted**" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))  # --no-plots
    assert set(target.authorizations) == {f"Bearer {API_KEY}"}
    assert API_KEY not in _outputs(out, stdout, stderr)


async def test_a_run_cut_by_max_duration_is_no_pass(tmp_path: Path) -> None:
    """Half the requests hang past --max-duration-s: they are cancelled, so before the fix the other
    half met every SLO and the job exited 0 without the slowest requests in any figure."""
    async with misbehaving_target(auth="Bearer k", hang="odd") as target:
        out = tmp_path / "report"
        code, stdout, stderr = await _kvlb(
            "loadtest", "--target", f"http://{target.url}", *WORKLOAD, "--requests", "10", "--rate", "50",
            "--timeout-s", "30", "--max-duration-s", "1.5", "--header", "Authorization: Bearer k",
            "--slo", "ttft_p90_s=5s", "--slo", "error_rate=0", "--no-plots", "--out", str(out),
        )  # fmt: skip
    assert code == EXIT_CUT_SHORT, stderr[-3000:]
    assert stdout == ""
    report = json.loads((out / "report.json").read_text())
    assert report["slo_met"] is True and report["meta"]["stop_reason"] == "max_duration"
    assert (report["summary"]["ok"], report["summary"]["cancelled"]) == (5, 5)
    assert report["status"] == "invalid" and "--max-duration-s 1.5 cut the run" in report["note"]
    assert "INVALID: --max-duration-s" in stderr and "**Invalid" in (out / "report.md").read_text()


async def test_a_target_without_models_gets_an_invalid_report_saying_pass_model(tmp_path: Path) -> None:
    """``GET /v1/models`` answers 404: no request is sent, exit 1, and the report (invalid, the reason
    in its note) is written. Before the fix: exit 1 and one line, no report for the job to keep."""
    async with misbehaving_target(auth="Bearer k", list_models=False) as target:
        out = tmp_path / "report"
        code, stdout, stderr = await _kvlb(
            "loadtest", "--target", f"http://{target.url}", *WORKLOAD, "--requests", "5",
            "--header", "Authorization: Bearer k", "--slo", "ttft_p90_s=5s", "--out", str(out),
        )  # fmt: skip
    assert code == 1, stderr[-3000:]
    assert stdout == "" and "Traceback" not in stderr
    assert "HTTP 404; pass --model" in stderr.strip().splitlines()[-1]
    assert target.chats == 0 and len(target.authorizations) == 1  # the models request only
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "invalid" and report["slo_met"] is False
    assert report["note"].startswith("no request sent: GET http://127.0.0.1:")
    assert report["note"].endswith("/team-a/v1/models: HTTP 404; pass --model")
    assert report["meta"]["model"] is None and report["meta"]["stop_reason"] == "no_model"
    assert report["summary"]["requests"] == 0 and report["meta"]["requests"] == 5
    assert (out / "requests.jsonl").read_text() == ""
    assert "**Invalid at the offered rate**: no request sent" in (out / "report.md").read_text()


async def test_capacity_target_without_models_writes_its_report_and_names_the_flag(tmp_path: Path) -> None:
    """``kvlb capacity --target`` where ``GET /v1/models`` answers 404 and no ``--model``: exit 1, one
    line naming ``--model``, no request sent, and ``capacity.json`` written with no point and the
    reason. Before (2026-12-01, h-capfollow): exit 1 and the line, but no report at all."""
    async with misbehaving_target(auth="Bearer k", list_models=False) as target:
        out = tmp_path / "capacity"
        code, _, stderr = await _kvlb(
            "capacity", "--target", f"http://{target.url}", *WORKLOAD, "--requests", "20",
            "--header", "Authorization: Bearer k", "--out", str(out),
        )  # fmt: skip
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kvlb capacity: GET http://127.0.0.1:") and last.endswith("HTTP 404; pass --model")
    assert target.chats == 0
    report = json.loads((out / "capacity.json").read_text())
    assert report["meta"]["error"] == last.removeprefix("kvlb capacity: ")
    assert report["meta"]["model"] is None and report["meta"]["interrupted"] is None
    [row] = report["routers"]
    assert row["points"] == [] and row["capacity_rate"] is None and row["invalid"] == report["meta"]["error"]
    assert (out / "capacity.md").exists()


async def test_capacity_target_where_no_request_succeeds_writes_the_point(tmp_path: Path) -> None:
    """Nothing listens at the URL (``--model`` given, so no models request): the first point's five
    requests all fail, exit 1, and ``capacity.json`` holds that point and the reason. Before
    (2026-12-01, h-capfollow): exit 1 and one line, no report."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = tmp_path / "capacity"
    code, _, stderr = await _kvlb(
        "capacity", "--target", f"http://127.0.0.1:{port}", "--model", "m", *WORKLOAD, "--requests", "5",
        "--target-requests", "5", "--target-timeout-s", "5", "--out", str(out),
    )  # fmt: skip
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("kvlb capacity: no request succeeded at ")
    report = json.loads((out / "capacity.json").read_text())
    assert report["meta"]["error"] == last.removeprefix("kvlb capacity: ") and report["meta"]["model"] == "m"
    [row] = report["routers"]
    [point] = row["points"]
    assert (point["requests"], point["errors"], point["meets_slo"]) == (5, 5, False)
    assert row["capacity_rate"] is None and row["first_failing_rate"] == point["rate"]


@pytest.mark.parametrize(
    ("signum", "sigint_ignored"),
    [(signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)],
    ids=["SIGINT", "SIGTERM", "SIGINT-ignored-at-start"],
)
async def test_capacity_target_on_a_signal_writes_the_points_measured(
    signum: signal.Signals, sigint_ignored: bool, tmp_path: Path
) -> None:
    """The first point (10 requests) passes, the second hangs: SIGINT or SIGTERM then. Before the
    fix: exit 1 with a traceback and no capacity.json on SIGINT; on SIGTERM (until 2026-12-01) the
    default action, no capacity.json and exit -15. Started with SIGINT ignored (a background job
    of a shell without job control, ``nohup`` in a script), until 2026-12-01 (h-sigcap) it ignored
    the SIGINT and was still running 60 s later."""
    async with misbehaving_target(auth="Bearer k", hang="after10") as target:
        out = tmp_path / "capacity"
        code, _, stderr = await _kvlb(
            "capacity", "--target", f"http://{target.url}", *WORKLOAD, "--requests", "20",
            "--target-requests", "10", "--slo-ttft-p90", "5", "--target-timeout-s", "30",
            "--api-key-env", "LOADTEST_KEY", "--out", str(out),
            env={"LOADTEST_KEY": "k"}, interrupt_when=target.arrived, signum=signum,
            sigint_ignored=sigint_ignored,
        )  # fmt: skip
    assert code == 128 + signum.value, stderr[-3000:]
    assert "Traceback" not in stderr
    report = json.loads((out / "capacity.json").read_text())
    assert report["meta"]["interrupted"] == f"stopped by {signum.name} after 1 points"
    [row] = report["routers"]
    assert len(row["points"]) == 1 and row["capacity_rate"] == row["points"][0]["rate"]
    assert row["first_failing_rate"] is None


BAD_ARGUMENTS: Sequence[tuple[str, ...]] = (
    ("loadtest", "--target", "127.0.0.1:9/v1"),  # no scheme
    ("loadtest", "--target", "http://127.0.0.1:9/v1/chat/completions"),  # an endpoint, not the base
    ("loadtest", "--target", "http://127.0.0.1:9", "--slo", "ttft_p90_s=fast"),
    ("loadtest", "--target", "http://127.0.0.1:9", "--header", f"no-colon-{HEADER_SECRET}"),
    ("loadtest", "--target", "http://127.0.0.1:9", "--timeout-s", "0"),
    ("loadtest", "--target", "http://127.0.0.1:9", "--workload", "mooncake", "--trace", "/nonexistent"),
    ("loadtest", "--target", "http://127.0.0.1:9", "--api-key-env", "KVLB_TEST_UNSET_VARIABLE"),
    ("loadtest", "--target", "http://u:p@127.0.0.1:9", "--header", "Authorization: Bearer x"),
    ("loadtest", "--target", "http://127.0.0.1:9", "--netns"),  # its loopback is not the target's
    ("capacity", "--target", "127.0.0.1:9", "--workload", "tenants"),
    ("capacity", "--target", "http://127.0.0.1:9", "--header", "bad", "--workload", "tenants"),
)


@pytest.mark.parametrize("argv", BAD_ARGUMENTS, ids=lambda argv: " ".join(argv[2:4]))
def test_bad_arguments_are_one_line_and_exit_2(
    argv: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's own ``main`` in this process (each check ends before a request could go out). Port 9
    on loopback is closed: before the fix these tried it and exited 1, or raised (a traceback)."""
    code = main([*argv, "--out", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert code == 2, captured.err[-2000:]
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert HEADER_SECRET not in captured.err
    assert not (tmp_path / "o").exists()


def test_redaction_and_error_kinds() -> None:
    """The pure helpers behind the checks above."""
    assert redact_url("http://u:p@h:1/v1") == "http://u:***@h:1/v1"
    assert redact_url("https://h:1/prefix/v1") == "https://h:1/prefix/v1"
    argv = ["--target", "http://u:p@h:1", "--header", "a: b", "--header=c:d", "--slo", "x=1"]
    assert redact_argv(argv) == [
        "--target",
        "http://u:***@h:1",
        "--header",
        "a:***",
        "--header=c:***",
        "--slo",
        "x=1",
    ]
    kinds = [
        RequestRecord("a", "http_error", 0.0, status=503, error="HTTP 503"),
        RequestRecord("b", "error", 0.0, error="stream ended without data: [DONE]"),
        RequestRecord("c", "error", 0.0, error="ClientPayloadError: cut"),
        RequestRecord("d", "timeout", 0.0),
        RequestRecord("e", "error", 0.0, error="server error: {}"),
    ]
    assert [error_kind(r) for r in kinds] == [
        "http_503",
        "no_done",
        "ClientPayloadError",
        "timeout",
        "error_event",
    ]
