"""The decoder contract (``balancer.engines.Decoder``), run on every engine's decoder.

Whatever bytes arrive, a decoder returns a :class:`DecodedBatch` of engine-neutral events or raises
:class:`EventDecodeError`, nothing else; a valid empty message gives no events; every ``Stored``
has exactly the tokens its blocks span; and decoding is deterministic. Each engine supplies a valid
sample message and a valid empty one in ``SAMPLES``; its decoder comes from its spec
(:data:`balancer.engines.registry.ENGINE_SPECS`), built for the engine's default block size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.engines import DecodedBatch, Decoder
from balancer.engines.registry import ENGINE_SPECS, engine_spec
from balancer.errors import EventDecodeError
from balancer.events import Cleared, Removed, Resync, Stored
from balancer.types import U64_MASK


@dataclass(frozen=True)
class Sample:
    message: list[bytes]
    """A valid message with at least one ``Stored``."""
    empty: list[bytes]
    """A valid message that holds no event."""


def _zmq(events: list[object]) -> list[bytes]:
    return [b"kv-events", (5).to_bytes(8, "big"), msgpack.packb([1.5, events, 0])]


_SGLANG = _zmq(
    [
        {
            "type": "BlockStored",
            "block_hashes": [-3488128144981237669, 1],
            "parent_block_hash": None,
            "token_ids": list(range(1, 33)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        },
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]
)
_VLLM = _zmq(
    [
        [
            "BlockStored",
            [(1 << 64) - 3],
            None,
            list(range(16)),
            16,
            None,
            "GPU",
            None,
            [None],
            0,
            "full_attention",
            None,
        ],
        ["BlockRemoved", [(1 << 64) - 3], "GPU", 0],
    ]
)


def _trtllm_token(token_id: int) -> dict[str, object]:
    return {"type": "unique_token", "token_id": token_id, "token_extra_id": 0}


_TRTLLM_BLOCK = {
    "type": "stored_block",
    "block_hash": 9622824665191806685,
    "tokens": [_trtllm_token(t) for t in range(100, 132)],  # tokens_per_block defaults to 32
    "cache_salt": None,
    "cache_level": 0,
    "priority": 35,
    "mm_keys": [],
}
_TRTLLM = [
    json.dumps(
        [
            {
                "event_id": 0,
                "data": {"type": "stored", "parent_hash": None, "blocks": [_TRTLLM_BLOCK]},
                "window_size": 4096,
            },
            {
                "event_id": 1,
                "data": {"type": "removed", "block_hashes": [9622824665191806685]},
                "window_size": 4096,
            },
        ]
    ).encode()
]

SAMPLES: dict[str, Sample] = {
    "sglang": Sample(_SGLANG, _zmq([])),
    "vllm": Sample(_VLLM, _zmq([])),
    "trtllm": Sample(_TRTLLM, [b"[]"]),
}

Factory = Callable[[], Decoder]


def _factory(engine: str) -> Factory:
    """A fresh decoder of ``engine`` per call, from its spec, for its default block size."""
    spec = engine_spec(engine)
    return lambda: spec.decoder(spec.default_block_size)


@pytest.fixture(scope="module", params=sorted(SAMPLES))
def engine(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def factory(engine: str) -> Factory:
    return _factory(engine)


def check_batch(batch: DecodedBatch) -> None:
    """What every returned batch must satisfy, whatever the input."""
    assert isinstance(batch, DecodedBatch)
    assert batch.ignored >= 0
    assert all(isinstance(reason, str) for reason in batch.errors)
    for event in batch.events:
        assert isinstance(event, Stored | Removed | Cleared | Resync)
        assert event.dp_rank >= 0
        if isinstance(event, Stored | Removed):
            assert all(0 <= h <= U64_MASK for h in event.engine_hashes)
        if isinstance(event, Stored):
            assert event.block_count >= 1 and event.block_size >= 1
            assert event.lookahead_tokens in (0, 1)
            assert event.parent is None or 0 <= event.parent <= U64_MASK
            assert len(event.tokens) == 4 * (event.block_count * event.block_size + event.lookahead_tokens)


def decode_or_reject(factory: Factory, frames: list[bytes]) -> None:
    try:
        batch = factory().decode(frames)
    except EventDecodeError as exc:
        assert exc.reason and isinstance(exc.reason, str)
        return
    check_batch(batch)


def test_every_registered_engine_has_a_sample() -> None:
    assert set(ENGINE_SPECS) == set(SAMPLES)


def test_decoder_names_its_engine(factory: Factory) -> None:
    assert isinstance(factory().engine, str) and factory().engine


def test_valid_sample_decodes_to_engine_neutral_events(engine: str, factory: Factory) -> None:
    batch = factory().decode(SAMPLES[engine].message)
    check_batch(batch)
    assert batch.errors == ()
    assert any(isinstance(event, Stored) for event in batch.events)


def test_valid_empty_message_gives_no_events(engine: str, factory: Factory) -> None:
    batch = factory().decode(SAMPLES[engine].empty)
    assert batch.events == [] and batch.errors == ()


def test_decoding_is_deterministic(engine: str, factory: Factory) -> None:
    sample = SAMPLES[engine].message
    assert factory().decode(sample) == factory().decode(sample)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"", b""],
        [b"", b"", b""],
        [b"\xc1\xff{not json"],
        [b"\xc1\xff{not json"] * 3,
        [b"\x00"] * 5,
    ],
    ids=["no-frames", "one-empty", "two-empty", "three-empty", "garbage", "three-garbage", "five-nul"],
)
def test_garbage_raises_only_event_decode_error(factory: Factory, frames: list[bytes]) -> None:
    with pytest.raises(EventDecodeError):
        factory().decode(frames)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=32), max_size=5))
def test_random_frames_never_raise_anything_else(factory: Factory, frames: list[bytes]) -> None:
    decode_or_reject(factory, frames)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupted_samples_never_raise_anything_else(
    engine: str, factory: Factory, data: st.DataObject
) -> None:
    frames = list(SAMPLES[engine].message)
    which = data.draw(st.integers(min_value=0, max_value=len(frames) - 1))
    frame = frames[which]
    start = data.draw(st.integers(min_value=0, max_value=len(frame)))
    noise = data.draw(st.binary(max_size=6))
    cut = data.draw(st.booleans())
    frames[which] = frame[:start] + noise + (b"" if cut else frame[start + len(noise) :])
    decode_or_reject(factory, frames)
