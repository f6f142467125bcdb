"""Emulator calibration: ``kvlb emulate``'s SGLang-format replica vs a real vLLM CPU engine (opt-in).

Both get the same sequential chat workload with the same tokenizer, block size 32 and the same small
KV cache (vLLM ``--num-gpu-blocks-override``, less its reserved null block), so evictions happen. A
test-side SUB decodes each one's events into blocks named by their token prefix (engine hashes
differ by design), and the test compares, request by request: ``cached_tokens``, what is stored,
what is evicted, and the shape of the events (full blocks only, parent chaining, hashes per event).
Differences are recorded in the report; the assertions hold what routing depends on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from real_engines import MODEL_DIR, MODEL_NAME, VllmReplica
from real_events import EventTap, HeldBlocks, Message
from real_workload import ChatRequest, shared_prefix_workload

from balancer.tokenizer.tokenizer import HfTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

BLOCK = 32
NUM_BLOCKS = 40
"""vLLM's pool; block 0 is its null block, so 39 hold KV."""
USABLE_TOKENS = (NUM_BLOCKS - 1) * BLOCK
GROUPS, ROUNDS, PREFIX_WORDS = 6, 3, 160
DECODE_TOKENS = 70
PRESSURE_WORDS = (120, 260, 90)


@dataclass
class Side:
    """One engine under comparison: its URL and its event tap."""

    name: str
    url: str
    tap: EventTap


@dataclass
class Step:
    cached: int
    stored: list[str]
    removed: list[str]
    stored_events: int
    removed_events: int
    hashes_per_removed: list[int]
    held: set[str]


@pytest.fixture
async def sides(tmp_path: Any, report: dict[str, Any]) -> AsyncIterator[dict[str, Side]]:
    real = VllmReplica("vllm-cal", core=0, block_size=BLOCK, log_dir=tmp_path, num_blocks=NUM_BLOCKS)
    real.max_model_len = 1024
    profile = get_profile("cpu-small-llama").with_overrides(
        page_size=BLOCK, kv_capacity_tokens=USABLE_TOKENS, max_context_tokens=1024
    )
    zctx = zmq.asyncio.Context()
    tokenizer = await asyncio.to_thread(HfTokenizer.load, MODEL_DIR)
    emulators: dict[str, Replica] = {}
    taps: list[EventTap] = []
    try:
        real.start()
        ready_s = await asyncio.to_thread(real.wait_ready)
        out = {"real": Side("real", real.url, EventTap(real.events, "real"))}
        taps.append(out["real"].tap)
        for eviction in ("node", "block"):
            # Built only now and started at once: a free port is picked at construction.
            config = ReplicaConfig(
                name=f"sim-{eviction}",
                engine="sglang",
                profile=profile,
                page_size=BLOCK,
                time_scale=20.0,
                eviction=eviction,
            )
            emulator = Replica(config, tokenizer, zctx)
            await emulator.start()
            name = f"emulator-{eviction}"
            emulators[name] = emulator
            out[name] = Side(name, emulator.url, EventTap(emulator.describe()["events"][0], name))
            taps.append(out[name].tap)
        await asyncio.sleep(1.0)
        report["calibration_startup"] = {"engine_ready_s": round(ready_s, 1), "num_gpu_blocks": NUM_BLOCKS}
        yield out
    finally:
        for tap in taps:
            tap.close()
        for emulator in emulators.values():
            await emulator.stop()
        zctx.destroy(linger=0)
        await asyncio.to_thread(real.stop)


async def _chat(session: aiohttp.ClientSession, side: Side, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(side.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, Any] = await response.json()
        return answer


async def _step(
    session: aiohttp.ClientSession, side: Side, body: dict[str, Any], seen: int
) -> tuple[Step, int]:
    answer = await _chat(session, side, body)
    count = await asyncio.to_thread(side.tap.settle, 0.4)
    messages = side.tap.messages()
    before = HeldBlocks().apply(messages[:seen])
    after = HeldBlocks().apply(messages)
    new: list[Message] = messages[seen:]
    events = [e for m in new for e in m.events]
    removed_events = [e for e in events if e["type"] == "BlockRemoved"]
    step = Step(
        cached=answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        stored=after.stored_order[len(before.stored_order) :],
        removed=after.removed_order[len(before.removed_order) :],
        stored_events=sum(e["type"] == "BlockStored" for e in events),
        removed_events=len(removed_events),
        hashes_per_removed=[len(e["block_hashes"]) for e in removed_events],
        held=after.held_ids(),
    )
    return step, count


def _shape(messages: list[Message]) -> dict[str, Any]:
    """Event-shape facts of a whole stream."""
    stored = [e for m in messages for e in m.events if e["type"] == "BlockStored"]
    full_only = all(len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"] for e in stored)
    held = HeldBlocks().apply(messages)
    first = messages[0].events[0]["type"] if messages and messages[0].events else None
    return {
        "batches": len(messages),
        "first_seq": messages[0].seq if messages else None,
        "first_event": first,
        "stored_events": len(stored),
        "full_blocks_only": full_only,
        "unresolved_parents": held.unresolved,
        "hash_kind": "u64" if all(h >= 0 for e in stored for h in e["block_hashes"]) else "signed i64",
        "stored_fields": sorted(set().union(*(e.keys() for e in stored))) if stored else [],
    }


async def test_emulator_matches_real_vllm_cache_behaviour(
    sides: dict[str, Side], report: dict[str, Any]
) -> None:
    requests = shared_prefix_workload(7, GROUPS, ROUNDS, PREFIX_WORDS)
    steps: dict[str, list[Step]] = {name: [] for name in sides}
    seen = {name: sides[name].tap.count() for name in sides}
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for request in requests:
            body = request.body(MODEL_NAME, 1)
            for name, side in sides.items():
                step, seen[name] = await _step(session, side, body, seen[name])
                steps[name].append(step)
        # Pressure: unique prompts that need more free blocks than are left, then every group again.
        pressure: list[ChatRequest] = []
        for words in PRESSURE_WORDS:
            text = " ".join(r.messages[1]["content"] for r in requests)[: words * 7]
            pressure.append(ChatRequest(-1, -1, ({"role": "user", "content": f"[{words}] {text}"},)))
            pressure += shared_prefix_workload(7, GROUPS, ROUNDS + 1 + len(pressure), PREFIX_WORDS)[-GROUPS:]
        for request in pressure:
            body = request.body(MODEL_NAME, 1)
            for name, side in sides.items():
                step, seen[name] = await _step(session, side, body, seen[name])
                steps[name].append(step)
        requests = requests + pressure
        decode_body = {**requests[0].body(MODEL_NAME, DECODE_TOKENS), "ignore_eos": True}
        decode = {}
        for name, side in sides.items():
            decode[name], seen[name] = await _step(session, side, decode_body, seen[name])
    n = len(requests)
    real = steps["real"]
    shapes = {name: _shape(side.tap.messages()) for name, side in sides.items()}
    report["calibration"] = {
        "requests": n,
        "run_s": round(time.monotonic() - started, 1),
        "usable_tokens": USABLE_TOKENS,
        "cached_real": [s.cached for s in real],
        "evicted_real": [len(s.removed) for s in real],
        "decode_request": {
            name: {"stored_events": d.stored_events, "stored_blocks": len(d.stored), "cached": d.cached}
            for name, d in decode.items()
        },
        "shape": shapes,
    }
    for name in (k for k in sides if k != "real"):
        report["calibration"][name] = _compare(real, steps[name])
    for name, shape in shapes.items():
        assert shape["full_blocks_only"], name
        assert shape["unresolved_parents"] == 0, name
    node, block = steps["emulator-node"], steps["emulator-block"]
    first_eviction = report["calibration"]["emulator-node"]["first_eviction_at_request"]
    # Before the first eviction both emulators hold exactly the blocks vLLM holds, with the same hits.
    assert first_eviction > GROUPS, "the workload must fill the cache before it evicts"
    for emu in (node, block):
        for i in range(first_eviction):
            assert (real[i].cached, real[i].stored) == (emu[i].cached, emu[i].stored), i
    # Under eviction, the hits routing relies on: the vLLM-like emulator must agree within a block.
    mismatched = [
        (i, real[i].cached, block[i].cached)
        for i in range(n)
        if abs(real[i].cached - block[i].cached) > BLOCK
    ]
    assert not mismatched, mismatched


def _compare(real: list[Step], emu: list[Step]) -> dict[str, Any]:
    """How one emulator's per-request behaviour compares with the real engine's."""
    n = len(real)
    pairs = list(zip(real, emu, strict=True))
    return {
        "first_eviction_at_request": next((i for i in range(n) if real[i].removed or emu[i].removed), n),
        "cached_tokens_equal": f"{sum(real[i].cached == emu[i].cached for i in range(n))}/{n}",
        "cached_within_one_block": f"{sum(abs(r.cached - e.cached) <= BLOCK for r, e in pairs)}/{n}",
        "cached": [s.cached for s in emu],
        "held_sets_equal": f"{sum(real[i].held == emu[i].held for i in range(n))}/{n}",
        "stored_blocks_equal": f"{sum(real[i].stored == emu[i].stored for i in range(n))}/{n}",
        "evicted_blocks": {
            "real": sum(len(s.removed) for s in real),
            "emulator": sum(len(s.removed) for s in emu),
        },
        "evicted_per_request": [len(s.removed) for s in emu],
        "eviction_order_equal": f"{sum(real[i].removed == emu[i].removed for i in range(n))}/{n}",
        "hashes_per_removed_event": {
            "real": sorted({h for s in real for h in s.hashes_per_removed}),
            "emulator": sorted({h for s in emu for h in s.hashes_per_removed}),
        },
    }
