"""Fuzzing of the SGLang/vLLM ZMQ decoder (``balancer.engines.sglang``): structured payloads, raw and
corrupted frames, and seeded mutations of valid batches never raise anything but EventDecodeError."""

from __future__ import annotations

import random
from typing import Any

import msgpack
from fuzz_examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_frames import SEQ, TOKENS, stored

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder
from balancer.errors import EventDecodeError
from balancer.events import Cleared, Removed, Resync, Stored
from balancer.types import U64_MASK


def assert_well_formed(batch: DecodedBatch) -> None:
    assert isinstance(batch, DecodedBatch)
    for event in batch.events:
        assert isinstance(event, Stored | Removed | Cleared | Resync)
        assert event.dp_rank >= 0
        if isinstance(event, Stored | Removed):
            assert all(0 <= h <= U64_MASK for h in event.engine_hashes)
        if isinstance(event, Stored):
            assert event.block_count > 0 and event.block_size > 0 and event.lookahead_tokens in (0, 1)
            assert len(event.tokens) == 4 * (event.block_count * event.block_size + event.lookahead_tokens)


def decode_or_reject(frames: list[bytes]) -> None:
    try:
        batch = SglangDecoder().decode(frames)
    except EventDecodeError:
        return
    assert_well_formed(batch)


_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "metadata",
    "cache_salt",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "ts",
    "events",
]
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=12),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "full_attention", "type"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6),
    max_leaves=8,
)
_small_ints = st.integers(min_value=0, max_value=40)
_stored_like = st.builds(
    lambda hashes, parent, tokens, size, rest: ["BlockStored", hashes, parent, tokens, size, *rest],
    st.lists(_scalars, max_size=4),
    _scalars,
    st.lists(_small_ints | st.lists(_small_ints, min_size=2, max_size=2), max_size=12),
    st.integers(min_value=-1, max_value=5),
    st.lists(_scalars | st.dictionaries(st.sampled_from(_KEYS), _scalars, max_size=2), max_size=7),
)
_events = st.lists(_stored_like | _values, max_size=4)


@settings(max_examples=examples(800), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(st.none(), _scalars),
    _events,
    st.one_of(st.none(), st.integers(min_value=-2, max_value=3), _scalars),
    st.booleans(),
)
def test_fuzz_structured_payloads_never_raise_anything_else(
    ts: Any, events: Any, rank: Any, as_map: bool
) -> None:
    envelope: Any = {"ts": ts, "events": events, "attn_dp_rank": rank} if as_map else [ts, events, rank]
    decode_or_reject([b"kv", SEQ, msgpack.packb(envelope)])


@settings(max_examples=examples(1500), deadline=None)
@given(
    st.lists(st.binary(max_size=24), max_size=4),
    st.integers(min_value=0, max_value=200),
    st.binary(max_size=4),
)
def test_fuzz_raw_and_corrupted_frames_never_raise_anything_else(
    frames: list[bytes], cut: int, noise: bytes
) -> None:
    decode_or_reject(frames)
    valid = msgpack.packb([1.0, [stored([-5, 6], list(range(8)), 4), ["BlockRemoved", [6], "GPU"]], 0])
    decode_or_reject([b"kv", SEQ, valid[:cut] + noise + valid[cut + len(noise) :]])


def _mutate(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """One random structural edit somewhere in a decoded msgpack value."""
    if isinstance(value, list) and value and depth < 6 and rng.random() < 0.7:
        copy = list(value)
        at = rng.randrange(len(copy))
        copy[at] = _mutate(copy[at], rng, depth + 1)
        return copy
    if isinstance(value, dict) and value and depth < 6 and rng.random() < 0.7:
        copy = dict(value)
        key = rng.choice(list(copy))
        copy[key] = _mutate(copy[key], rng, depth + 1)
        return copy
    return rng.choice(_REPLACEMENTS)(value, rng)


_REPLACEMENTS: list[Any] = [
    lambda v, rng: None,
    lambda v, rng: rng.choice([True, -1, 0, 1 << 63, (1 << 64) - 1, -(1 << 63), 2.5, "", "GPU", b"\x00"]),
    lambda v, rng: [v, v],
    lambda v, rng: [],
    lambda v, rng: {"type": v},
    lambda v, rng: v[: rng.randrange(len(v) + 1)] if isinstance(v, list | str | bytes) else [v],
    lambda v, rng: [*v, v] if isinstance(v, list) else v,
]


def test_fuzz_seeded_mutations_of_valid_batches() -> None:
    """Thousands of cheap structural mutations of real-looking batches (seeded: reproducible)."""
    rng = random.Random(20261122)
    pairs = [[j, j + 1] for j in range(8)]
    map_event = {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32],
        "parent_block_hash": "abcdef",
        "token_ids": TOKENS,
        "block_size": 4,
        "medium": "GPU",
        "metadata": {"cache_salt": "s"},
    }
    events: list[Any] = [
        stored([-5, 6], list(range(8)), 4, 3),
        ["BlockRemoved", [6], "GPU"],
        ["AllBlocksCleared"],
        stored([1, 2], pairs, 4, None, {"cache_salt": "s"}),
        stored([1], TOKENS, 4, None, "lora", [["lora"]], 1, "full_attention", None),
        map_event,
    ]
    outcomes = {"rejected": 0, "events": 0, "errors": 0}
    for _ in range(6000):
        batch_events = [_mutate(event, rng) if rng.random() < 0.5 else event for event in events]
        payload: Any = [1.0, batch_events, rng.choice([0, 1, None])]
        if rng.random() < 0.1:
            payload = _mutate(payload, rng)
        try:
            batch = SglangDecoder().decode([b"kv", SEQ, msgpack.packb(payload)])
        except EventDecodeError:
            outcomes["rejected"] += 1
            continue
        assert_well_formed(batch)
        outcomes["events"] += len(batch.events)
        outcomes["errors"] += len(batch.errors)
    # the mutations reach every layer: whole-message rejects, skipped events and surviving events
    assert min(outcomes.values()) > 100
