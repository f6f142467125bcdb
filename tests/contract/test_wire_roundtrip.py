"""Emulator encoders (``replicas.wire``) → decoders, checked against the events the inputs imply.

Each scenario encodes engine events with the emulator and states, from its own inputs (never from the
encoded bytes), the engine-neutral events (:mod:`balancer.events`) a decoder must yield. Two decoders
are held to that: a small reference decoder written here from the wire spec
(docs/reference/engine-events.md), so the encoders are checked today, and the balancer's own decoders
(skipped until ``balancer.engines.sglang`` / ``.trtllm`` exist).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import msgpack
import pytest
from wire_hashes import sglang_page_hashes, vllm_block_hashes

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.types import EngineHash
from replicas.wire import trtllm
from replicas.wire.sglang import KvEventEncoder, frames

U64 = (1 << 64) - 1
EPOCH_MARKER = b"\x00sgl-kv-epoch="


def le(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def u64(value: int) -> EngineHash:
    return EngineHash(value & U64)


def stored(
    rank: int, parent: int | None, hashes: Sequence[int], tokens: Sequence[int], size: int, **extra: Any
) -> Stored:
    return Stored(
        rank, None if parent is None else u64(parent), tuple(map(u64, hashes)), le(tokens), size, **extra
    )


def toks(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + index * 104729) % 129_280 for index in range(count)]


@dataclass
class Scenario:
    """One transport message and what it must decode to."""

    message: list[bytes]
    events: list[KvEvent]
    seq: int | None = None
    dp_rank: int | None = None
    timestamp: float | None = None
    epoch: str | None = None
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- ZMQ scenarios


def sglang_map_scenario() -> Scenario:
    """SGLang 0.5.23 shape: coalesced store with a short last page, a chained page, salt, evict, flush."""
    enc = KvEventEncoder(flavor="sglang", encoding="map")
    prompt, more, salted = toks(1, 40), toks(2, 16), toks(3, 16)
    (h0, _), (h1, d1), (h2, _) = sglang_page_hashes(prompt, 16)
    ((m0, _),) = sglang_page_hashes(more, 16, prior_digest=d1)
    ((s0, _),) = sglang_page_hashes(salted, 16, cache_salt="tenant-a")  # 0.5.23's salt-seeded chain
    events = [
        enc.block_stored([h0, h1, h2], None, prompt, 16),
        enc.block_stored([m0], h1, more, 16),
        enc.block_stored([s0], None, salted, 16, cache_salt="tenant-a"),
        enc.block_removed([m0, h1]),
        enc.all_blocks_cleared(),
    ]
    message = frames("kv-events", 7, enc.batch(1795336336.25, events, 0), epoch="e1")
    expected: list[KvEvent] = [
        stored(0, None, [h0, h1], prompt[:32], 16),
        stored(0, h1, [m0], more, 16),
        stored(0, None, [s0], salted, 16, cache_salt="tenant-a"),
        Removed(0, (u64(m0), u64(h1))),
        Cleared(0),
    ]
    return Scenario(message, expected, seq=7, dp_rank=0, timestamp=1795336336.25, epoch="e1")


def sglang_array_scenario() -> Scenario:
    """Positional msgspec era (7 fields, 8 when salted), DP rank 2."""
    enc = KvEventEncoder(flavor="sglang", encoding="array")
    prompt, salted = toks(4, 32), toks(5, 16)
    (h0, _), (h1, _) = sglang_page_hashes(prompt, 16)
    ((s0, _),) = sglang_page_hashes(salted, 16, extra_key="t")
    events = [
        enc.block_stored([h0], None, prompt[:16], 16),
        enc.block_stored([h1], h0, prompt[16:], 16),
        enc.block_stored([s0], None, salted, 16, cache_salt="t"),
        enc.block_removed([h1]),
    ]
    message = frames("", 0, enc.batch(12.5, events, 2))
    expected: list[KvEvent] = [
        stored(2, None, [h0], prompt[:16], 16),
        stored(2, h0, [h1], prompt[16:], 16),
        stored(2, None, [s0], salted, 16, cache_salt="t"),
        Removed(2, (u64(h1),)),
    ]
    return Scenario(message, expected, seq=0, dp_rank=2, timestamp=12.5)


def sglang_bigram_scenario() -> Scenario:
    """EAGLE bigram pages: 33 tokens make 32 pairs, two pages of 16 pairs spanning 17 tokens each."""
    enc = KvEventEncoder(flavor="sglang", encoding="map")
    prompt = toks(6, 33)
    (b0, _), (b1, _) = sglang_page_hashes(prompt, 16, bigram=True)
    events = [enc.block_stored([b0, b1], None, list(pairwise(prompt)), 16), enc.block_removed([b1])]
    message = frames("kv", 1, enc.batch(3.0, events, 0))
    expected: list[KvEvent] = [
        stored(0, None, [b0, b1], prompt, 16, lookahead_tokens=1),
        Removed(0, (u64(b1),)),
    ]
    return Scenario(message, expected, seq=1, dp_rank=0, timestamp=3.0)


def vllm_scenario(encoding: str, rank: int) -> Scenario:
    """vLLM 0.32.0 shape (maps) or the positional era (12 fields): chained single- and multi-block stores."""
    enc = KvEventEncoder(flavor="vllm", encoding=encoding)  # type: ignore[arg-type]
    prompt = toks(7, 16 * 4 + 5)
    hashes = [value for value, _ in vllm_block_hashes(prompt, 16)]
    events = [
        enc.block_stored(hashes[:1], None, prompt[:16], 16),
        enc.block_stored(hashes[1:3], hashes[0], prompt[16:48], 16),
        enc.block_stored(hashes[3:], hashes[2], prompt[48:64], 16, lora_name="adapter"),
        enc.block_removed([hashes[3], hashes[2]]),
        enc.all_blocks_cleared(),
    ]
    message = frames("kv-events", 3, enc.batch(1795336400.0, events, rank))
    expected: list[KvEvent] = [
        stored(rank, None, hashes[:1], prompt[:16], 16),
        stored(rank, hashes[0], hashes[1:3], prompt[16:48], 16),
        stored(rank, hashes[2], hashes[3:], prompt[48:64], 16, lora_name="adapter"),
        Removed(rank, (u64(hashes[3]), u64(hashes[2]))),
        Cleared(rank),
    ]
    return Scenario(message, expected, seq=3, dp_rank=rank, timestamp=1795336400.0)


ZMQ_SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "sglang-map": sglang_map_scenario,
    "sglang-array": sglang_array_scenario,
    "sglang-bigram": sglang_bigram_scenario,
    "vllm-map": lambda: vllm_scenario("map", 0),
    "vllm-array": lambda: vllm_scenario("array", 1),
}


# ------------------------------------------------------------------------------- TRT-LLM scenarios


def trtllm_scenario(rank: int | None) -> Scenario:
    """A drain: created, a stored chain ending in a partial block, evictions (one partial), an update."""
    tpb = 32
    prompt = toks(8, 2 * tpb + 9)
    (h0, t0), (h1, t1), (hp, tp) = trtllm.trtllm_block_hashes(prompt, tpb)
    ((hx, tx),) = trtllm.trtllm_block_hashes(toks(9, tpb), tpb)  # a separate root
    window = 4096
    events = [
        trtllm.created(0, [1000, 0], window, rank),
        trtllm.stored(1, None, [(h0, t0), (h1, t1), (hp, tp)], window, dp_rank=rank),
        trtllm.removed(2, [hp], window, rank),
        trtllm.updated(3, h0, window, priority=(35, 50), dp_rank=rank),
        trtllm.removed(4, [h1], window, rank),
        trtllm.stored(5, None, [(hx, tx)], window, dp_rank=rank),
    ]
    dp = rank or 0
    expected: list[KvEvent] = [
        stored(dp, None, [h0, h1], prompt[: 2 * tpb], tpb),
        Removed(dp, (u64(h1),)),
        stored(dp, None, [hx], tx, tpb),
    ]
    return Scenario([trtllm.encode_drain(events)], expected)


TRTLLM_SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "trtllm": lambda: trtllm_scenario(None),
    "trtllm-adp": lambda: trtllm_scenario(1),
}


# ------------------------------------------------------------------- reference decoders (from spec)

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
VLLM_STORED_TAIL = (
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)


def ref_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        return raw["type"], raw
    tag, values = raw[0], raw[1:]
    if tag == "BlockRemoved":
        return tag, dict(zip(("block_hashes", "medium", "group_idx"), values, strict=False))
    if tag != "BlockStored":
        return tag, {}
    fields = dict(zip(STORED_FIELDS, values, strict=False))
    if len(values) == 7 and isinstance(values[6], dict):  # SGLang salted: trailing metadata map
        fields["metadata"] = values[6]
    elif len(values) > 6:
        fields.update(zip(VLLM_STORED_TAIL, values[6:], strict=False))
    return tag, fields


def ref_stored(fields: dict[str, Any], rank: int) -> Stored | None:
    units, size = fields["token_ids"], fields["block_size"]
    bigram = bool(units) and isinstance(units[0], list)
    full = min(len(units) // size, len(fields["block_hashes"]))
    if full == 0:
        return None
    units = units[: full * size]
    tokens = [pair[0] for pair in units] + [units[-1][1]] if bigram else units
    parent = fields["parent_block_hash"]
    return Stored(
        rank,
        None if parent is None else u64(parent),
        tuple(u64(value) for value in fields["block_hashes"][:full]),
        le(tokens),
        size,
        lookahead_tokens=1 if bigram else 0,
        lora_name=fields.get("lora_name"),
        # SGLang 0.5.23 maps: top-level cache_salt; the positional era: the trailing metadata map
        cache_salt=fields.get("cache_salt") or (fields.get("metadata") or {}).get("cache_salt"),
    )


@dataclass
class RefBatch:
    events: list[KvEvent]
    seq: int | None
    dp_rank: int | None
    timestamp: float | None
    epoch: str | None


def ref_decode_zmq(message: Sequence[bytes]) -> RefBatch:
    topic, seq, payload = message
    epoch = topic.split(EPOCH_MARKER, 1)[1].split(b"\x00", 1)[0].decode() if EPOCH_MARKER in topic else None
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(body, dict):
        ts, raw_events = body["ts"], body["events"]
        rank = body.get("attn_dp_rank", body.get("data_parallel_rank"))
    else:
        ts, raw_events, rank = body[0], body[1], body[2] if len(body) > 2 else None
    dp = rank or 0
    events: list[KvEvent] = []
    for raw in raw_events:
        tag, fields = ref_fields(raw)
        if tag == "BlockStored" and (event := ref_stored(fields, dp)) is not None:
            events.append(event)
        elif tag == "BlockRemoved":
            events.append(Removed(dp, tuple(u64(value) for value in fields["block_hashes"])))
        elif tag == "AllBlocksCleared":
            events.append(Cleared(dp))
    return RefBatch(events, int.from_bytes(seq, "big"), rank, ts, epoch)


def ref_decode_trtllm(message: Sequence[bytes], tokens_per_block: int = 32) -> RefBatch:
    partial: set[tuple[int, int]] = set()
    events: list[KvEvent] = []
    for event in json.loads(message[0]):
        if not event:
            continue
        data, dp = event["data"], event.get("attention_dp_rank", 0)
        if data["type"] == "stored":
            hashes: list[int] = []
            tokens: list[int] = []
            for block in data["blocks"]:
                if len(block["tokens"]) != tokens_per_block:
                    partial.add((dp, block["block_hash"]))
                    break
                hashes.append(block["block_hash"])
                tokens.extend(token["token_id"] for token in block["tokens"])
            if hashes:
                events.append(stored(dp, data["parent_hash"], hashes, tokens, tokens_per_block))
        elif data["type"] == "removed":
            kept = tuple(u64(v) for v in data["block_hashes"] if (dp, v) not in partial)
            if kept:
                events.append(Removed(dp, kept))
    return RefBatch(events, None, None, None, None)


# ---------------------------------------------------------------------------------------- the tests


def comparable(events: Sequence[KvEvent]) -> list[KvEvent]:
    """Events that change the index; a decoder may also emit no-op removals or restart resyncs."""
    return [
        e
        for e in events
        if not isinstance(e, Resync) and not (isinstance(e, Removed) and not e.engine_hashes)
    ]


@pytest.mark.parametrize("name", sorted(ZMQ_SCENARIOS))
def test_zmq_reference_round_trip(name: str) -> None:
    scenario = ZMQ_SCENARIOS[name]()
    batch = ref_decode_zmq(scenario.message)
    assert batch.events == scenario.events
    assert (batch.seq, batch.dp_rank, batch.timestamp, batch.epoch) == (
        scenario.seq, scenario.dp_rank, scenario.timestamp, scenario.epoch,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRTLLM_SCENARIOS))
def test_trtllm_reference_round_trip(name: str) -> None:
    scenario = TRTLLM_SCENARIOS[name]()
    assert ref_decode_trtllm(scenario.message).events == scenario.events


@pytest.mark.parametrize("name", sorted(ZMQ_SCENARIOS))
def test_zmq_balancer_decoder_round_trip(name: str) -> None:
    module = pytest.importorskip("balancer.engines.sglang")
    scenario = ZMQ_SCENARIOS[name]()
    batch = module.SglangDecoder().decode(scenario.message)
    assert comparable(batch.events) == scenario.events
    assert not [e for e in batch.events if isinstance(e, Resync)]
    assert batch.errors == ()
    assert (batch.seq, batch.dp_rank, batch.timestamp, batch.epoch) == (
        scenario.seq, scenario.dp_rank, scenario.timestamp, scenario.epoch,
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRTLLM_SCENARIOS))
def test_trtllm_balancer_decoder_round_trip(name: str) -> None:
    module = pytest.importorskip("balancer.engines.trtllm")
    scenario = TRTLLM_SCENARIOS[name]()
    batch = module.TrtllmDecoder().decode(scenario.message)
    assert comparable(batch.events) == scenario.events
    assert all(e.reason == "restart" for e in batch.events if isinstance(e, Resync))  # only `created`
    assert batch.errors == ()
