"""Builders of SGLang/vLLM ZMQ event messages shared by the SGLang decoder tests
(``test_sglang_decoder.py`` and ``test_sglang_decoder_fuzz.py``)."""

from __future__ import annotations

from array import array
from typing import Any

import msgpack

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder
from balancer.events import KvEvent

SEQ = (41).to_bytes(8, "big")
TOKENS = [11, 12, 13, 14]


def u32(tokens: list[int]) -> bytes:
    return array("I", tokens).tobytes()


def message(events: list[Any], dp_rank: int | None = 0, *, topic: bytes = b"kv") -> list[bytes]:
    return [topic, SEQ, msgpack.packb([1.25, events, dp_rank])]


def decode(events: list[Any], dp_rank: int | None = 0, decoder: SglangDecoder | None = None) -> DecodedBatch:
    return (decoder or SglangDecoder()).decode(message(events, dp_rank))


def stored(
    hashes: list[Any], tokens: list[Any], block_size: int = 4, parent: Any = None, *rest: Any
) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, block_size, None, "GPU", *rest]


def only(batch: DecodedBatch) -> KvEvent:
    assert batch.errors == ()
    (event,) = batch.events
    return event
