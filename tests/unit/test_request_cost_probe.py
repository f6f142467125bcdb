"""The instruction probe's parts (``loadtests/bench/request_cost.py``): the scaled settings, the
callgrind dump's totals (whole or per thread), and the clients that send at ``--concurrency``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from balancer.config.loader import SettingsSource, parse_settings
from loadtests.bench.overhead.servers import kvlb_config
from loadtests.bench.request_cost import clients, dumped_events, dumped_thread_events, scaled_config


def test_scaled_config_multiplies_kvlbs_timer_periods_and_loads() -> None:
    config = scaled_config(kvlb_config(["http://127.0.0.1:9"], 2), 100.0)
    settings = parse_settings(SettingsSource("kvlb.yaml", yaml.safe_dump(config).encode()), [], {})
    assert settings.limits.speculative_ttl_s == 200.0
    assert settings.health_interval_s == 500.0
    assert settings.timeouts.connect_s == 200.0
    assert settings.upstream.idle_ttl_s == 1500.0
    assert scaled_config(kvlb_config(["http://127.0.0.1:9"], 1), 1000.0)["upstream"]["idle_ttl_s"] == 3600.0


def test_dumped_events_reads_every_events_total(tmp_path: Path) -> None:
    (tmp_path / "cg.7.1").write_bytes(
        b"version: 1\ncreator: callgrind-3.19.0\nevents: Ir Dr D1mr\nfn=(1) main\n3 10 2 1\n"
        b"summary: 1200 300 7\ntotals: 1200 300 7\n"
    )
    assert dumped_events(tmp_path, 7) == {"Ir": 1200, "Dr": 300, "D1mr": 7}
    (tmp_path / "cg.8.1").write_bytes(b"events: Ir\n")
    with pytest.raises(RuntimeError, match="no totals"):
        dumped_events(tmp_path, 8)


def test_dumped_events_sums_the_threads_dumps_when_separate(tmp_path: Path) -> None:
    for thread, (ir, dr) in {1: (1000, 40), 2: (25, 5), 12: (3, 0)}.items():
        (tmp_path / f"cg.9.1-{thread:02d}").write_bytes(
            f"events: Ir Dr\nsummary: {ir} {dr}\ntotals: {ir} {dr}\n".encode()
        )
    (tmp_path / "cg.9-01").write_bytes(b"events: Ir Dr\ntotals: 77 7\n")  # the start-up part: not a dump
    assert dumped_thread_events(tmp_path, 9) == {
        1: {"Ir": 1000, "Dr": 40},
        2: {"Ir": 25, "Dr": 5},
        12: {"Ir": 3, "Dr": 0},
    }
    assert dumped_events(tmp_path, 9) == {"Ir": 1028, "Dr": 45}
    assert dumped_thread_events(tmp_path, 10) == {}
    with pytest.raises(RuntimeError, match="no totals"):
        dumped_events(tmp_path, 10)


async def test_clients_send_every_body_once_with_at_most_concurrency_in_flight() -> None:
    seen: list[bytes] = []
    in_flight, most = 0, 0

    async def answer(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        seen.append(await request.read())
        await asyncio.sleep(0.01)
        in_flight -= 1
        return web.Response(body=b"data: [DONE]\n\n")

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    bodies = [b"a", b"b", b"c"]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            await clients(session, url, bodies, range(2, 12), 4)
            assert most == 4
            assert sorted(seen) == sorted(bodies[i % 3] for i in range(2, 12))
            seen.clear()
            most = 0
            await clients(session, url, bodies, range(0, 5), 1)
            assert most == 1 and seen == [b"a", b"b", b"c", b"a", b"b"]
    finally:
        await runner.cleanup()
