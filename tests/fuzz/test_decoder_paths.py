"""The SGLang/vLLM decoder's typed fast path and chain mode decode hostile messages as the generic path.

The :mod:`fuzz_payloads` messages (SGLang and vLLM flavours, maps and arrays, mostly mutated) go
through three stateful decoders fed in the same order: the generic path only
(``SglangDecoder(typed=False)``), the default (the typed path first), and the sources' chain mode.
The default must give the very same outcome (the batch, or the same error); chain mode the same
batch once its ``chained`` events are split back into their events.
"""

from __future__ import annotations

import os
from dataclasses import replace

from fuzz_payloads import BLOCK_SIZE, sglang_payloads

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder
from balancer.errors import EventDecodeError
from balancer.events import KvEvent, Stored, split_chained

PAYLOADS = int(os.environ.get("KVLBTEST_FUZZ_PAYLOADS", "5000"))
SEED = int(os.environ.get("KVLBTEST_FUZZ_SEED", "20261122"))


def outcome(decoder: SglangDecoder, frames: list[bytes]) -> DecodedBatch | str:
    try:
        return decoder.decode(frames)
    except EventDecodeError as exc:
        return str(exc)  # "reason: detail"


def expanded(batch: DecodedBatch | str) -> DecodedBatch | str:
    if isinstance(batch, str):
        return batch
    events: list[KvEvent] = []
    for event in batch.events:
        events.extend(split_chained(event) if type(event) is Stored and event.chained else [event])
    return replace(batch, events=events)


def test_typed_and_chained_decoding_match_the_generic_path() -> None:
    generic = SglangDecoder(BLOCK_SIZE, typed=False)
    typed = SglangDecoder(BLOCK_SIZE)
    chained = SglangDecoder(BLOCK_SIZE, chain=True)
    decoded = 0
    for frames in sglang_payloads(SEED, PAYLOADS):
        expected = outcome(generic, frames)
        # compared by repr: a NaN timestamp equals itself there
        assert repr(outcome(typed, frames)) == repr(expected), frames
        assert repr(expanded(outcome(chained, frames))) == repr(expected), frames
        decoded += not isinstance(expected, str) and bool(expected.events)
    assert decoded > PAYLOADS // 20  # not only rejected messages
