"""The engines kvlb speaks, one module per engine (pure: no I/O, no clock, no module state).

* :mod:`balancer.engines.sglang`: SGLang's ZMQ frames ``[topic, seq, msgpack]`` (the decoder vLLM
  shares) and SGLang's spec; :mod:`~balancer.engines.sglang_typed` its typed msgpack schema,
  :mod:`~balancer.engines.sglang_load` the parsers of its load reports (``/v1/loads``,
  ``/get_load``, ``sglang:``/``sglang_`` metrics).
* :mod:`balancer.engines.vllm`: vLLM's spec (SGLang's decoder) and the parser of its load report
  (``vllm:`` metrics).
* :mod:`balancer.engines.trtllm`: TRT-LLM ``POST /kv_cache_events`` JSON drains and TRT-LLM's spec;
  :mod:`~balancer.engines.trtllm_load` the parsers of its load reports (iteration stats,
  ``trtllm_`` metrics).

Each engine module defines ``SPEC``, an :class:`~balancer.engines.spec.EngineSpec` holding every
engine-specific choice (decoder, hash alignment, default block size, event transport, load scrape
targets, lease takeover); :mod:`balancer.engines.registry` maps engine names to them. Nothing outside
this package branches on an engine's name or spells an engine's metric names or report fields
(``tests/unit/test_engine_branches.py`` checks both); the generic parts the engines' load parsers are
built from (the Prometheus text parser, the range checks, ``ScrapedLoad``) are in
:mod:`balancer.load.scrape`. This module holds the decoder seam shared by every engine.

A decoder turns engine bytes into engine-neutral events. It may keep per-stream state (TRT-LLM
remembers partial blocks and ``event_id`` per rank), but it never does I/O and never reads a clock. A
message that cannot be decoded at all raises :class:`balancer.errors.EventDecodeError`; a malformed
event *inside* a good message is skipped and its reason recorded in ``DecodedBatch.errors``, so one
bad event never loses its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from balancer.events import KvEvent


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """What one transport message held.

    ``seq`` is the publisher's batch sequence number (ZMQ frame 2), ``None`` when the transport has
    none (TRT-LLM orders by per-event ``event_id``, checked inside the decoder). ``dp_rank`` is the
    envelope's rank when it names one. ``epoch`` is SGLang's publisher epoch from the topic metadata
    (a change means the publisher restarted). ``ignored`` counts events dropped on purpose (unknown
    tags, partial blocks, other media or windows); ``errors`` gives one reason per malformed event.
    ``positions`` maps each DP rank the message held events of to the last per-event id of that rank
    in it (TRT-LLM's ``event_id``, ignored and malformed events included), so that a balancer taking
    the replica over can check that what it drains next follows on (empty when the transport numbers
    messages instead: ``seq``). ``forgotten`` counts the entries of the decoder's per-stream memory
    dropped at its cap while decoding this message (TRT-LLM's partial-block hashes past
    ``max_partial_hashes``), for ``kvlb_events_decoder_forgotten_total``.
    """

    events: list[KvEvent]
    seq: int | None = None
    dp_rank: int | None = None
    timestamp: float | None = None
    epoch: str | None = None
    ignored: int = 0
    errors: tuple[str, ...] = field(default_factory=tuple)
    positions: dict[int, int] = field(default_factory=dict)
    forgotten: int = 0


class Decoder(Protocol):
    """Turns one transport message (a list of frames; an HTTP body is one frame) into events."""

    engine: str

    def decode(self, frames: Sequence[bytes]) -> DecodedBatch:
        """Decode one message; raises ``EventDecodeError`` when the message as a whole is unusable."""
        ...


@runtime_checkable
class ResumableDecoder(Decoder, Protocol):
    """A decoder that numbers events per rank (:attr:`DecodedBatch.positions`) and can be told where
    a previous consumer of the stream stopped, so its first events are checked against that."""

    def resume_after(self, positions: Mapping[int, int]) -> None:
        """Each rank of ``positions`` continues after that id: the next one must be its successor
        (else ``Resync(rank, "gap")``, or ``"regression"``/``"restart"`` as for any later event)."""
        ...


DecoderFactory = Callable[[int], Decoder]
"""Tokens per KV block of the replica → a new decoder for one event stream."""
