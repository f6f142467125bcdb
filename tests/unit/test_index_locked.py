"""``LockedPrefixTable``: the same answers as a plain table, sliced applies, and safe sharing with a
thread that applies while this one matches (the ingest thread and the request loop)."""

from __future__ import annotations

import threading
import time

from balancer.events import Removed, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.locked import LockedPrefixTable
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 4
HASHER = BlockHasher("m", BS)
A, B = ReplicaId("a"), ReplicaId("b")


def chain(first_hash: int, blocks: int, first_token: int) -> list[Stored]:
    """``blocks`` one-block ``Stored`` events chained by parent, as SGLang publishes them."""
    events = []
    for i in range(blocks):
        tokens = range(first_token + i * BS, first_token + (i + 1) * BS)
        parent = None if i == 0 else EngineHash(first_hash + i - 1)
        events.append(Stored(0, parent, (EngineHash(first_hash + i),), pack_tokens(tokens), BS))
    return events


def test_sliced_apply_gives_the_plain_tables_result() -> None:
    plain, locked = PrefixTable(HASHER), LockedPrefixTable(HASHER, apply_slice_blocks=3)
    events = [*chain(1, 20, 1), Removed(0, (EngineHash(20),))]
    assert locked.apply(A, events, 0.0) == plain.apply(A, events, 0.0)
    keys = HASHER.request_keys(list(range(1, 1 + 20 * BS)))
    assert locked.match(keys, None, 0.0).blocks == plain.match(keys, None, 0.0).blocks == {A: 19}
    assert locked.held_blocks(A) == 19
    assert locked.stats() == plain.stats()


def test_an_empty_apply_still_expires_speculative_entries() -> None:
    table = LockedPrefixTable(HASHER)
    keys = HASHER.request_keys(list(range(1, 1 + 4 * BS)))
    table.add_speculative(B, keys, 1.0, 0.0)
    assert table.match(keys, None, 0.5).blocks == {B: 4}
    table.apply(A, [], 2.0)
    assert not table.has_speculative


def test_a_thread_applying_while_another_matches_never_breaks_either() -> None:
    """The ingest thread stores and drops chains while this thread matches and speculates: no
    exception on either side, and every match sees a whole prefix (a multiple of nothing torn)."""
    table = LockedPrefixTable(HASHER, apply_slice_blocks=16)
    errors: list[BaseException] = []
    stop = threading.Event()

    def ingest() -> None:
        try:
            round_ = 0
            while not stop.is_set():
                table.apply(A, chain(1, 64, 1), float(round_))
                table.apply(A, [Removed(0, tuple(EngineHash(h) for h in range(1, 65)))], float(round_))
                round_ += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=ingest)
    thread.start()
    keys = HASHER.request_keys(list(range(1, 1 + 64 * BS)))
    seen: set[int] = set()
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            seen.add(table.match(keys, None, 0.0).blocks.get(A, 0))
            table.add_speculative(B, keys[:8], 0.001, 0.0)
            table.stats()
    finally:
        stop.set()
        thread.join(5.0)
    assert not errors
    assert seen <= set(range(65))
    assert len(seen) > 1  # the matcher really ran while the chains came and went
