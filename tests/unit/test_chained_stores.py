"""Chained stores: the SGLang/vLLM decoder's typed path and its ``chain`` mode, and their application.

The typed path (``SglangDecoder(typed=True)``, the default) must decode every message exactly as the
generic path does; ``chain=True`` merges runs of one-block stores into ``chained`` events, which
:func:`split_chained` turns back into the events decoded one by one; and a ``PrefixTable`` applying a
chained event ends in the state (and counts) that applying those events gives, whatever its state:
suspect or dropped blocks after a gap, a tight capacity, unknown parents, reused engine hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import msgpack
import pytest
from sglang_frames import SEQ, u32

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder
from balancer.engines.vllm import SPEC as VLLM_SPEC
from balancer.errors import EventDecodeError
from balancer.events import KvEvent, Resync, Stored, split_chained
from balancer.index.hashing import BlockHasher
from balancer.index.memory import MemoryIndex
from balancer.index.redis.plan import split_batch
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.pipeline import IngestSettings, ReplicaPipeline
from balancer.types import EngineHash, ReplicaId
from replicas.wire.sglang import KvEventEncoder

BS = 4
A, B = ReplicaId("a"), ReplicaId("b")


def one_block(engine_hash: int, parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": [engine_hash],
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }


def frames_of(events: list[Any], dp_rank: int | None = 0) -> list[bytes]:
    return [b"kv", SEQ, msgpack.packb([1.5, events, dp_rank])]


def expanded(events: list[KvEvent]) -> list[KvEvent]:
    out: list[KvEvent] = []
    for event in events:
        if type(event) is Stored and event.chained:
            out.extend(split_chained(event))
        else:
            out.append(event)
    return out


def outcome(decoder: SglangDecoder, frames: list[bytes]) -> DecodedBatch | str:
    try:
        return decoder.decode(frames)
    except EventDecodeError as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_run_of_one_block_stores_becomes_one_chained_event() -> None:
    chain = [
        one_block(10 + i, None if i == 0 else 9 + i, list(range(i * BS, (i + 1) * BS))) for i in range(5)
    ]
    tail = [{"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU"}]
    frames = frames_of(chain + tail)
    plain = SglangDecoder(BS).decode(frames)
    merged = SglangDecoder(BS, chain=True).decode(frames)
    assert len(plain.events) == 6
    assert merged.events[0] == Stored(
        0, None, tuple(EngineHash(10 + i) for i in range(5)), u32(list(range(5 * BS))), BS, chained=True
    )
    assert merged.events[1:] == plain.events[5:]
    assert expanded(merged.events) == plain.events
    assert split_chained(merged.events[0], 2) == [
        Stored(0, None, (EngineHash(10), EngineHash(11)), u32(list(range(2 * BS))), BS, chained=True),
        Stored(
            0,
            EngineHash(11),
            (EngineHash(12), EngineHash(13)),
            u32(list(range(2 * BS, 4 * BS))),
            BS,
            chained=True,
        ),
        Stored(0, EngineHash(13), (EngineHash(14),), u32(list(range(4 * BS, 5 * BS))), BS),
    ]


def test_runs_break_where_the_chain_or_the_shape_does() -> None:
    events = [
        one_block(1, None, [1, 2, 3, 4]),
        one_block(2, 1, [5, 6, 7, 8]),
        one_block(3, 77, [9, 10, 11, 12]),  # another parent: a new run
        one_block(4, 3, [13, 14, 15, 16]),
        {**one_block(5, 4, [1, 2, 3, 4]), "cache_salt": "s"},  # not plain: on its own
        one_block(6, 5, [1, 2, 3, 4]),
        {**one_block(7, 6, [1, 2, 3, 4, 5, 6, 7, 8]), "block_hashes": [7, 8]},  # two blocks: on its own
    ]
    merged = SglangDecoder(BS, chain=True).decode(frames_of(events))
    assert [
        (type(e).__name__, getattr(e, "chained", None), len(getattr(e, "engine_hashes", ())))
        for e in merged.events
    ] == [
        ("Stored", True, 2),
        ("Stored", True, 2),
        ("Stored", False, 1),
        ("Stored", False, 1),
        ("Stored", False, 2),
    ]
    assert expanded(merged.events) == SglangDecoder(BS, typed=False).decode(frames_of(events)).events


def test_a_bad_token_in_a_run_is_its_own_events_error() -> None:
    events = [
        one_block(1, None, [1, 2, 3, 4]),
        one_block(2, 1, [5, 6, 1 << 33, 8]),
        one_block(3, 2, [9, 9, 9, 9]),
    ]
    generic = SglangDecoder(BS, typed=False).decode(frames_of(events))
    merged = SglangDecoder(BS, chain=True).decode(frames_of(events))
    assert generic.errors == ("event 1: token_ids are not u32 ints",)
    assert merged.errors == generic.errors and merged.events == generic.events and len(merged.events) == 2


def test_the_flood_shape_takes_the_typed_path_and_decodes_alike() -> None:
    encoder = KvEventEncoder()
    parent = None
    events = []
    for i in range(200):
        events.append(encoder.block_stored([-(1 << 62) + i], parent, [i, i + 1, i + 2, i + 3], BS))
        parent = -(1 << 62) + i
    frames = [b"kv", SEQ, encoder.batch(1.0, events, 0)]
    generic = SglangDecoder(BS, typed=False).decode(frames)
    assert SglangDecoder(BS).decode(frames) == generic
    merged = SglangDecoder(BS, chain=True).decode(frames)
    assert len(merged.events) == 1 and expanded(merged.events) == generic.events


def test_sources_use_the_chain_decoder() -> None:
    assert VLLM_SPEC.chain_decoder is not None
    decoder = VLLM_SPEC.chain_decoder(16)
    assert isinstance(decoder, SglangDecoder) and decoder.chain and decoder.block_size == 16


def _random_message(rng: random.Random, live: list[int]) -> list[bytes]:
    """A batch of mostly chained one-block stores (some runs broken, reused hashes, removals)."""
    encoder = KvEventEncoder(flavor=rng.choice(("sglang", "vllm")))
    events: list[object] = []
    parent = rng.choice(live) if live and rng.random() < 0.6 else None
    for _ in range(rng.randint(1, 40)):
        roll = rng.random()
        if roll < 0.08 and live:
            events.append(encoder.block_removed(rng.sample(live, min(len(live), rng.randint(1, 3)))))
            continue
        if roll < 0.12:
            parent = rng.choice([*live, rng.getrandbits(64)])  # a new run, maybe under an unknown parent
        engine_hash = rng.choice(live) if live and roll > 0.97 else rng.getrandbits(64)  # a reused handle
        tokens = [rng.randrange(6) for _ in range(BS)]  # few distinct blocks: shared and re-stored keys
        events.append(encoder.block_stored([engine_hash], parent, tokens, BS))
        live.append(engine_hash)
        parent = engine_hash
    del live[:-200]
    return [b"kv", SEQ, encoder.batch(1.0, events, 0)]


def _state(table: PrefixTable) -> object:
    caches = {
        (cache.replica, cache.dp_rank): (
            list(cache.keys.items()),
            dict(cache.dups),
            cache.held,
            list(cache.suspect),
            list(cache.dropped.items()),
        )
        for ranks in table._slots.caches.values()
        for cache in ranks.values()
    }
    return list(table._holders.items()), caches, table.counters


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("capacity", [48, 100_000])
def test_a_table_applies_chained_events_as_their_events(seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    limits = TableLimits(capacity_blocks=capacity, gap_hold_s=5.0)
    one_by_one, chained = (PrefixTable(BlockHasher("m", BS), limits) for _ in range(2))
    plain_decoder, chain_decoder = SglangDecoder(BS), SglangDecoder(BS, chain=True)
    live: list[int] = []
    merged_events = 0
    for step in range(60):
        now = step * 0.5
        frames = _random_message(rng, live)
        plain, merged = plain_decoder.decode(frames), chain_decoder.decode(frames)
        assert expanded(merged.events) == plain.events
        merged_events += sum(type(e) is Stored and e.chained for e in merged.events)
        replica = A if rng.random() < 0.8 else B
        results = [
            table.apply(replica, events, now)
            for table, events in ((one_by_one, plain.events), (chained, merged.events))
        ]
        assert results[0] == results[1]
        roll = rng.random()
        if roll < 0.1:  # an event gap: every block becomes suspect
            for table in (one_by_one, chained):
                table.apply(A, [Resync(0, "gap")], now)
        elif roll < 0.2:  # a receipt: some suspects confirmed, others dropped unconfirmed
            keys = list(one_by_one._holders)
            found, missing = keys[: len(keys) // 3], keys[len(keys) // 3 : len(keys) // 2]
            for table in (one_by_one, chained):
                table.settle_suspect(A, found, missing, now)
        elif roll < 0.25:  # routed: speculative holdings a store confirms
            keys = list(one_by_one._holders)[-10:]
            for table in (one_by_one, chained):
                table.add_speculative(A, keys, 3.0, now)
        assert _state(one_by_one) == _state(chained)
    assert merged_events > 0


async def test_an_oversize_chained_event_is_applied_in_runs_not_dropped() -> None:
    index = MemoryIndex(BlockHasher("m", BS))
    metrics = Metrics.create()
    pipeline = ReplicaPipeline(
        A, "sglang", index, metrics=metrics, settings=IngestSettings(max_event_blocks=3)
    )
    event = Stored(
        0, None, tuple(EngineHash(h) for h in range(7)), u32(list(range(7 * BS))), BS, chained=True
    )
    task = asyncio.create_task(pipeline.run())
    try:
        pipeline.offer(IngestBatch((event,)))
        assert await pipeline.wait_applied(5.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert index.table.held_blocks(A) == 7 and index.table.engine_hashes(A) == set(range(7))
    assert pipeline.overflows == 0


def test_vllm_groups_and_extra_keys_decode_alike_on_both_paths() -> None:
    def store(engine_hash: int, group: int, kind: str, extra: object = None) -> dict[str, Any]:
        return {
            **one_block(engine_hash, None, [1, 2, 3, 4]),
            "lora_name": None,
            "extra_keys": extra,
            "group_idx": group,
            "kv_cache_spec_kind": kind,
        }

    messages = [
        [store(1, 0, "sliding_window"), store(2, 1, "full_attention"), store(3, 0, "full_attention")],
        [store(4, 1, "full_attention", [None]), store(5, 1, "full_attention", [["mm-hash"]])],
        [store(6, 1, "full_attention", "bad"), {**store(7, 1, "full_attention"), "group_idx": "x"}],
        [{"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0}],
    ]
    generic, typed = SglangDecoder(BS, typed=False), SglangDecoder(BS)
    for events in messages:
        assert typed.decode(frames_of(events)) == generic.decode(frames_of(events))
    assert typed._main_group == generic._main_group == 1


def test_the_redis_plan_gets_the_events_of_a_chained_store() -> None:
    event = Stored(
        0, None, tuple(EngineHash(h) for h in range(5)), u32(list(range(5 * BS))), BS, chained=True
    )
    assert split_batch(BlockHasher("m", BS), [event], 1000) == [split_chained(event)]
