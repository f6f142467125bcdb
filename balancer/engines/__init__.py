"""Sans-IO decoders, one module per engine (pure): engine bytes → engine-neutral events.

* :mod:`balancer.engines.sglang`: SGLang and vLLM ZMQ frames ``[topic, seq, msgpack]``.
* :mod:`balancer.engines.trtllm`: TRT-LLM ``POST /kv_cache_events`` JSON drains.

A decoder may keep per-stream state (TRT-LLM remembers partial blocks and ``event_id`` per rank), but
it never does I/O and never reads a clock. A message that cannot be decoded at all raises
:class:`balancer.errors.EventDecodeError`; a malformed event *inside* a good message is skipped and
its reason recorded in ``DecodedBatch.errors``, so one bad event never loses its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from balancer.events import KvEvent


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """What one transport message held.

    ``seq`` is the publisher's batch sequence number (ZMQ frame 2), ``None`` when the transport has
    none (TRT-LLM orders by per-event ``event_id``, checked inside the decoder). ``dp_rank`` is the
    envelope's rank when it names one. ``epoch`` is SGLang's publisher epoch from the topic metadata
    (a change means the publisher restarted). ``ignored`` counts events dropped on purpose (unknown
    tags, partial blocks, other media or windows); ``errors`` gives one reason per malformed event.
    """

    events: list[KvEvent]
    seq: int | None = None
    dp_rank: int | None = None
    timestamp: float | None = None
    epoch: str | None = None
    ignored: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)


class Decoder(Protocol):
    """Turns one transport message (a list of frames; an HTTP body is one frame) into events."""

    engine: str

    def decode(self, frames: Sequence[bytes]) -> DecodedBatch:
        """Decode one message; raises ``EventDecodeError`` when the message as a whole is unusable."""
        ...


DecoderFactory = Callable[[], Decoder]


def decoder_factories() -> dict[str, DecoderFactory]:
    """Every known decoder by engine name (``sglang``, ``vllm``, ``trtllm``); each call builds anew."""
    from balancer.engines import sglang, trtllm

    return {
        "sglang": sglang.SglangDecoder,
        "vllm": sglang.SglangDecoder,
        "trtllm": trtllm.TrtllmDecoder,
    }
