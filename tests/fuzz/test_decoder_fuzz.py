"""Decoder fuzzing: hostile engine messages never crash a decoder, the index, or the next message.

Per engine, one stateful decoder (as in production: TRT-LLM's remembers ``event_id`` and partial
blocks) decodes ``KVLBTEST_FUZZ_PAYLOADS`` messages from :mod:`fuzz_payloads` (default 5 000 in
``make test``; ``make faults`` runs 100 000 per engine), and every decoded batch is applied to a real
:class:`~balancer.index.table.PrefixTable`. What must hold for every payload:

* ``decode`` returns a :class:`DecodedBatch` whose events are engine-neutral and well-formed, or raises
  :class:`EventDecodeError`: nothing else (no ``KeyError``, ``RecursionError``, ``OverflowError``...);
* ``apply`` never raises and the table stays within its block capacity and slot cap;
* no single payload costs more than ``SLOW_PAYLOAD_S`` of the thread's CPU time (no quadratic blow-up
  on a crafted input; CPU, not wall time, so a machine that takes the test off its core for a second
  does not fail it);
* afterwards a fresh valid message still decodes and its blocks are matched (no poisoned state).

The mix must reach deep paths: the test also asserts that a fair share of payloads decoded to events,
was rejected whole, or had single events rejected (so the fuzzer is not just feeding garbage to the
first check).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from fuzz_payloads import BLOCK_SIZE, TRT_TOKENS_PER_BLOCK, sglang_payloads, trtllm_payloads
from fuzz_results import save_result

from balancer.engines import DecodedBatch, Decoder
from balancer.engines.sglang import SglangDecoder
from balancer.engines.trtllm import TrtllmDecoder
from balancer.errors import EventDecodeError
from balancer.events import Cleared, Removed, Resync, Stored
from balancer.index.hashing import BlockHasher
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.types import U64_MASK, ReplicaId

PAYLOADS = int(os.environ.get("KVLBTEST_FUZZ_PAYLOADS", "5000"))
SEED = int(os.environ.get("KVLBTEST_FUZZ_SEED", "20261122"))
SLOW_PAYLOAD_S = 1.0
CAPACITY_BLOCKS = 2_000
MAX_SLOTS = 64
REPLICA = ReplicaId("fuzz-0")


@dataclass(frozen=True)
class Engine:
    name: str
    decoder: Callable[[], Decoder]
    payloads: Callable[[int, int], Iterator[list[bytes]]]
    block_size: int
    mode: str


ENGINES = {
    "sglang": Engine(
        "sglang", lambda: SglangDecoder(block_size=BLOCK_SIZE), sglang_payloads, BLOCK_SIZE, "plain"
    ),
    "trtllm": Engine(
        "trtllm",
        lambda: TrtllmDecoder(tokens_per_block=TRT_TOKENS_PER_BLOCK, max_partial_hashes=4096),
        trtllm_payloads,
        TRT_TOKENS_PER_BLOCK,
        "trtllm",
    ),
}


def check_batch(batch: DecodedBatch) -> None:
    assert isinstance(batch, DecodedBatch)
    assert batch.ignored >= 0 and all(isinstance(reason, str) for reason in batch.errors)
    for event in batch.events:
        assert type(event) in (Stored, Removed, Cleared, Resync), type(event)
        assert type(event.dp_rank) is int and event.dp_rank >= 0
        if isinstance(event, Stored | Removed):
            assert event.engine_hashes and all(
                type(h) is int and 0 <= h <= U64_MASK for h in event.engine_hashes
            )
        if isinstance(event, Stored):
            assert event.parent is None or 0 <= event.parent <= U64_MASK
            assert event.lookahead_tokens in (0, 1) and event.block_size >= 1
            assert len(event.tokens) == 4 * (event.block_count * event.block_size + event.lookahead_tokens)


def table_for(engine: Engine) -> PrefixTable:
    hasher = BlockHasher("fuzz-model", engine.block_size, engine.mode)  # type: ignore[arg-type]
    return PrefixTable(hasher, TableLimits(capacity_blocks=CAPACITY_BLOCKS, max_slots=MAX_SLOTS))


def describe(frames: list[bytes]) -> str:
    return " | ".join(frame[:120].hex() for frame in frames)


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_hostile_messages_never_crash_the_decoder_or_the_index(name: str) -> None:
    engine = ENGINES[name]
    decoder = engine.decoder()
    table = table_for(engine)
    outcomes: Counter[str] = Counter()
    slowest_s = 0.0
    started = time.perf_counter()
    for index, frames in enumerate(engine.payloads(SEED, PAYLOADS)):
        begin = time.thread_time()
        try:
            batch = decoder.decode(frames)
        except EventDecodeError as exc:
            assert exc.reason, describe(frames)
            outcomes["rejected"] += 1
        except Exception as exc:  # the finding: report the payload so it can be replayed
            raise AssertionError(f"payload {index} (seed {SEED}) raised {exc!r}: {describe(frames)}") from exc
        else:
            check_batch(batch)
            outcomes["with_events" if batch.events else "empty"] += 1
            outcomes["event_errors"] += bool(batch.errors)
            table.apply(REPLICA, batch.events, now=index * 0.001)
        slowest_s = max(slowest_s, time.thread_time() - begin)
        assert slowest_s < SLOW_PAYLOAD_S, f"payload {index} took {slowest_s:.2f}s of CPU: {describe(frames)}"
    elapsed_s = time.perf_counter() - started
    stats = table.stats()
    assert stats.unique_blocks <= CAPACITY_BLOCKS
    total = sum(outcomes[k] for k in ("rejected", "with_events", "empty"))
    assert total == PAYLOADS
    for outcome in ("rejected", "with_events", "event_errors"):
        assert outcomes[outcome] >= PAYLOADS // 20, f"{outcome}: {dict(outcomes)} (fuzzer too shallow)"
    print(
        f"\nfuzz {name}: {PAYLOADS} payloads in {elapsed_s:.1f}s "
        f"({PAYLOADS / elapsed_s:.0f}/s, slowest {slowest_s * 1000:.1f} ms): {dict(outcomes)}; "
        f"index {stats.unique_blocks} unique blocks"
    )
    save_result(
        f"fuzz_{name}_decoder",
        {
            "payloads": PAYLOADS,
            "seconds": round(elapsed_s, 1),
            "slowest_ms": round(slowest_s * 1000, 1),
            "outcomes": dict(outcomes),
        },
    )
    _still_works(engine, decoder, table)


def _still_works(engine: Engine, decoder: Decoder, table: PrefixTable) -> None:
    """A valid message after the storm: decoded, applied, and its blocks matched."""
    tokens = list(range(1000, 1000 + 3 * engine.block_size))
    if engine.name == "trtllm":
        from replicas.wire import trtllm as wire

        blocks = [(0xABC0 + i, tokens[i * engine.block_size : (i + 1) * engine.block_size]) for i in range(3)]
        body = wire.encode_drain(
            [wire.created(0, [64, 0], 4096, 0), wire.stored(1, None, blocks, 4096, dp_rank=0)]
        )
        batch = decoder.decode([body])
    else:
        from replicas.wire import sglang as wire

        encoder = wire.KvEventEncoder()
        stored = encoder.block_stored([0xABC0, 0xABC1, 0xABC2], None, tokens, engine.block_size)
        batch = decoder.decode(
            wire.frames("kv", 1, encoder.batch(1.0, [encoder.all_blocks_cleared(), stored], 0))
        )
    assert not batch.errors
    table.apply(REPLICA, batch.events, now=1e9)
    keys = table.hasher.request_keys([*tokens, 1])
    assert table.match(keys, [REPLICA], now=1e9).blocks.get(REPLICA) == 3


def test_a_trtllm_engine_restarted_with_a_shorter_window_is_not_ignored() -> None:
    """Found by the fuzzer: one event with a huge ``window_size`` (or an engine redeployed with a
    shorter context under the same URL) raised the decoder's max window for good, and every later
    event of the shorter window was ignored."""
    from replicas.wire import trtllm as wire

    decoder = TrtllmDecoder(tokens_per_block=4)
    decoder.decode([wire.encode_drain([wire.created(0, [64, 0], 32768), wire.removed(1, [7], 32768)])])
    assert decoder.max_window_size == 32768
    restarted = [wire.created(0, [64, 0], 4096), wire.stored(1, None, [(5, [1, 2, 3, 4])], 4096)]
    batch = decoder.decode([wire.encode_drain(restarted)])
    assert batch.events[0] == Resync(0, "restart")
    assert [type(e) for e in batch.events[1:]] == [Stored]
    assert decoder.max_window_size == 4096
