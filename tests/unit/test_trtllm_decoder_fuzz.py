"""TRT-LLM decoder: random streams checked against ``FakeTrtllm`` and fuzzing of event shapes, JSON
bodies and raw bytes (the goldens and per-rule tests are in ``test_trtllm_decoder.py``)."""

from __future__ import annotations

import json
from typing import Any

from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from trtllm_fake import U64, FakeTrtllm, decode, partial_hashes, summary

from balancer.engines import DecodedBatch
from balancer.engines.trtllm import TrtllmDecoder
from balancer.errors import EventDecodeError
from balancer.events import Removed, Resync, Stored


def check_invariants(decoder: TrtllmDecoder, batch: DecodedBatch, body_events: int) -> None:
    for item in batch.events:
        assert 0 <= item.dp_rank < decoder.max_dp_ranks
        if isinstance(item, Stored):
            assert item.block_count >= 1
            assert len(item.tokens) == 4 * decoder.tokens_per_block * item.block_count
            assert all(0 <= h <= U64 for h in item.engine_hashes)
            assert item.parent is None or 0 <= item.parent <= U64
        elif isinstance(item, Removed):
            assert item.engine_hashes and all(0 <= h <= U64 for h in item.engine_hashes)
        else:
            assert isinstance(item, Resync)
    assert len(batch.errors) <= body_events
    assert batch.ignored >= 0
    assert partial_hashes(decoder) <= decoder.max_partial_hashes


# --------------------------------------------------------------------------- random streams


@settings(max_examples=examples(150), deadline=None, database=None)
@given(st.data())
def test_random_streams_decode_as_the_encoder_expects(data: st.DataObject) -> None:
    tpb = data.draw(st.sampled_from([1, 2, 4]), label="tpb")
    ranks = data.draw(st.integers(1, 3), label="ranks")
    vswa = data.draw(st.booleans(), label="vswa")
    engine = FakeTrtllm(tpb, (256, 4096) if vswa else (4096,), ranks, data.draw(st.booleans()))
    if vswa or data.draw(st.booleans(), label="from start"):
        for rank in range(ranks):
            engine.start(rank)
    else:
        for rank in range(ranks):
            engine.lose(rank, data.draw(st.integers(0, 1000)))
    for _ in range(data.draw(st.integers(1, 16), label="steps")):
        rank = data.draw(st.integers(0, ranks - 1))
        _disturb(engine, rank, data)
        _operate(engine, rank, data)
    engine.drain()
    decoder = TrtllmDecoder(tokens_per_block=tpb)
    for drain in engine.drains:
        assert summary(decode(decoder, drain["body"])) == drain["expected"]


def _disturb(engine: FakeTrtllm, rank: int, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["none"] * 6 + ["lose", "rewind", "restart", "drain"]))
    if kind == "lose":
        engine.lose(rank, data.draw(st.integers(1, 5)))
    elif kind == "rewind" and rank in engine.last_emitted:
        engine.rewind(rank, data.draw(st.integers(0, engine.last_emitted[rank])))
    elif kind == "restart":
        engine.start(rank)
    elif kind == "drain":
        engine.drain()


def _operate(engine: FakeTrtllm, rank: int, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["store", "store", "remove", "offload", "onboard", "priority", "empty"]))
    known = engine.history[rank]
    window = data.draw(st.sampled_from(engine.windows))
    if kind == "store" or not known:
        tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3 * engine.tpb + 1))
        parent = data.draw(st.none() | st.sampled_from(tuple(known))) if known else None
        salt = data.draw(st.sampled_from([None, "s"]))
        engine.store(rank, tokens, parent, window, salt, data.draw(st.sampled_from([0, 0, 0, 1])))
    elif kind == "remove":
        engine.remove(
            rank, data.draw(st.lists(st.sampled_from(tuple(known)), min_size=1, max_size=3)), window
        )
    elif kind == "empty":
        engine.empty()
    else:
        level = {"offload": (0, 1), "onboard": (1, 0), "priority": None}[kind]
        engine.update(rank, data.draw(st.sampled_from(tuple(known))), level)


# --------------------------------------------------------------------------- fuzzing

_KEYS = [
    "event_id", "data", "type", "window_size", "attention_dp_rank", "parent_hash", "blocks", "block_hash",
    "tokens", "token_id", "cache_level", "old_value", "new_value", "block_hashes", "cache_salt", "mm_keys",
    "lora_id", "priority",
]  # fmt: skip
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**66), 2**66)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["created", "stored", "removed", "updated", "00ff", "ab" * 32])
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=12,
)


_JUNK = (
    _SCALARS | st.lists(_SCALARS, max_size=2) | st.dictionaries(st.sampled_from(_KEYS), _SCALARS, max_size=2)
)
"""Cheap wrong values (non-recursive, so thousands of examples stay fast)."""


def _mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, _JUNK)


_HASHES = (
    st.sampled_from([1, 2, 3, U64, -1, "00ff"]) | st.integers(-(2**63), U64) | st.text("0123456789abcdef")
)
_TOKEN = st.fixed_dictionaries({"token_id": _mostly(st.integers(0, 2**32 - 1) | st.just("ab" * 32))})
_BLOCK = st.fixed_dictionaries(
    {
        "block_hash": _mostly(_HASHES),
        "tokens": _mostly(st.lists(_TOKEN, max_size=5)),
        "cache_level": _mostly(st.sampled_from([0, 0, 1])),
    },
    optional={"cache_salt": _mostly(st.none() | st.text(max_size=3)), "mm_keys": _JUNK, "lora_id": _JUNK},
)
_DIFF = st.fixed_dictionaries(
    {"new_value": _mostly(st.integers(0, 2)), "old_value": _mostly(st.integers(0, 2))}
)
_STORED = {
    "type": st.just("stored"),
    "parent_hash": _mostly(st.none() | _HASHES),
    "blocks": _mostly(st.lists(_BLOCK, max_size=3)),
}
_REMOVED = {"type": st.just("removed"), "block_hashes": _mostly(st.lists(_HASHES, max_size=3))}
_UPDATED = {
    "type": st.just("updated"),
    "block_hash": _mostly(_HASHES),
    "cache_level": _mostly(st.none() | _DIFF),
}
_DATA = st.one_of(
    st.fixed_dictionaries({"type": st.just("created")}),
    st.fixed_dictionaries(_STORED),
    st.fixed_dictionaries(_REMOVED),
    st.fixed_dictionaries(_UPDATED),
)
_EVENT = st.one_of(
    st.fixed_dictionaries(
        {
            "event_id": _mostly(st.integers(0, 6)),
            "data": _mostly(_DATA),
            "window_size": _mostly(st.sampled_from([512, 4096])),
        },
        optional={"attention_dp_rank": _mostly(st.integers(0, 3))},
    ),
    st.just({}),
    _JUNK,
)


@settings(max_examples=examples(1000), deadline=None, database=None)
@given(st.lists(st.lists(_EVENT, max_size=8), min_size=1, max_size=3))
def test_fuzz_event_shapes_never_escape(drains: list[list[Any]]) -> None:
    decoder = TrtllmDecoder(tokens_per_block=4, max_partial_hashes=4, max_dp_ranks=3)
    for body in drains:
        check_invariants(decoder, decode(decoder, body), len(body))


@settings(max_examples=examples(400), deadline=None, database=None)
@given(_JSON)
def test_fuzz_any_json_body(body: Any) -> None:
    decoder = TrtllmDecoder()
    try:
        batch = decode(decoder, body)
    except EventDecodeError:
        assert not isinstance(body, list)
    else:
        check_invariants(decoder, batch, len(body))


@settings(max_examples=examples(500), deadline=None, database=None)
@given(st.binary(max_size=64) | st.builds(lambda b: b"[" + b, st.binary(max_size=32)))
def test_fuzz_raw_bytes(frame: bytes) -> None:
    decoder = TrtllmDecoder()
    try:
        batch = decoder.decode([frame])
    except EventDecodeError:
        return
    check_invariants(decoder, batch, len(json.loads(frame)))
