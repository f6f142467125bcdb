"""In-process micro-benchmark of the prefix table's held-roots count and what keeping it costs.

Not part of ``kvlb bench``: a probe of ``PrefixTable`` alone (block size 16, the default limits),
for comparing two revisions of the table (run it with ``PYTHONPATH`` at each one's tree: it uses
the public methods only).

* ``held_roots``: one call for all 8 replicas (a reused tuple, as the router passes) on a table
  holding ``ROOTS`` prompt chains of 4 blocks, one root each, replica ``i % 8`` holding chain ``i``
  (``--roots``, default 32, 1,000 and 10,000).
* ``store`` / ``remove``: a 1,000-block ``Stored`` (no parent) by one replica, or the
  ``Removed`` of its 1,000 engine hashes, on a table that holds 1,000 other roots (so the root
  list is not empty); the other one of the pair runs untimed between two calls.
* ``add_speculative``: a routed 512-block prompt (a new prompt each call, every key new to the
  table), 30 s, as a lease's first add, on that same table.

Prints, per part, the process CPU time per call: the best of three batches (µs; ``store`` and
``remove`` make ``--calls``/10 calls a batch, ``add_speculative`` too).

    PYTHONPATH=$PWD python loadtests/bench/roots_micro.py [--roots 32,1000,10000] [--calls N]

Instructions (repeatable on a busy machine, unlike times): ``--callgrind PART`` runs only that part
(``held_roots`` at the first ``--roots`` value), calling it through ``operator.call``, whose
inclusive cost under ``valgrind --tool=callgrind`` is then the instructions of those calls;
divide by the count it prints (three batches: of ``--calls`` for ``held_roots``, of a tenth of it
for the others)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=cg.out \\
        python loadtests/bench/roots_micro.py --callgrind store --calls 20
    callgrind_annotate --threshold=100 --inclusive=yes cg.out | grep _operator_call
"""

from __future__ import annotations

import argparse
import operator
import random
import time
from collections.abc import Callable

from balancer.events import Removed, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 16
HASHER = BlockHasher("bench-model", BS)
REPLICAS = tuple(ReplicaId(f"r{i}") for i in range(8))
PARTS = ("held_roots", "store", "remove", "add_speculative")


def _stored(tokens: list[int], first_hash: int) -> Stored:
    blocks = len(tokens) // BS
    engine = tuple(EngineHash(first_hash + i) for i in range(blocks))
    return Stored(0, None, engine, pack_tokens(tokens), BS)


def _removed(first_hash: int, blocks: int) -> Removed:
    return Removed(0, tuple(EngineHash(first_hash + i) for i in range(blocks)))


def rooted_table(roots: int, rng: random.Random) -> PrefixTable:
    """``roots`` chains of 4 blocks, chain ``i`` stored by replica ``i % 8``."""
    table = PrefixTable(HASHER)
    for i in range(roots):
        tokens = [rng.randrange(1, 100_000) for _ in range(4 * BS)]
        table.apply(REPLICAS[i % 8], [_stored(tokens, 1 + 4 * i)], 0.0)
    return table


def best_of_three(calls: int, call: Callable[[int], object], through: bool) -> float:
    """The least process CPU time per call (seconds) over three batches of ``calls``."""
    best = float("inf")
    for batch in range(3):
        started = time.process_time()
        for i in range(calls):
            if through:
                operator.call(call, batch * calls + i)
            else:
                call(batch * calls + i)
        best = min(best, (time.process_time() - started) / calls)
    return best


def bench_held_roots(roots: int, calls: int, through: bool) -> float:
    table = rooted_table(roots, random.Random(1))
    among = REPLICAS
    counts = table.held_roots(among, 1.0)
    assert sum(counts.values()) == roots, counts
    return best_of_three(calls, lambda _: table.held_roots(among, 1.0), through)


def bench_ingest(part: str, calls: int, through: bool) -> float:
    """The ``Stored`` (or the ``Removed``) alone, the other one run untimed between two calls."""
    rng = random.Random(2)
    table = rooted_table(1000, rng)
    tokens = [rng.randrange(1, 100_000) for _ in range(1000 * BS)]
    store = [_stored(tokens, 1_000_000)]
    remove = [_removed(1_000_000, 1000)]
    replica = REPLICAS[0]
    timed, between = (store, remove) if part == "store" else (remove, store)
    if part == "remove":
        table.apply(replica, store, 1.0)
    best = float("inf")
    for _ in range(3):
        spent = 0.0
        for _ in range(calls):
            started = time.process_time()
            if through:
                operator.call(table.apply, replica, timed, 1.0)
            else:
                table.apply(replica, timed, 1.0)
            spent += time.process_time() - started
            table.apply(replica, between, 1.0)
        best = min(best, spent / calls)
    return best


def bench_add_speculative(calls: int, through: bool) -> float:
    rng = random.Random(3)
    table = rooted_table(1000, rng)
    prompts = [
        tuple(HASHER.request_keys([rng.randrange(1, 100_000) for _ in range(512 * BS + 1)]))
        for _ in range(3 * calls)
    ]
    replica = REPLICAS[1]
    return best_of_three(calls, lambda i: table.add_speculative(replica, prompts[i], 30.0, 1.0), through)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", default="32,1000,10000", help="roots for held_roots (comma-separated)")
    parser.add_argument("--calls", type=int, default=200, help="calls per batch (default 200)")
    parser.add_argument("--callgrind", choices=PARTS, help="run only this part, through operator.call")
    args = parser.parse_args()
    roots = [int(n) for n in args.roots.split(",")]
    parts = (args.callgrind,) if args.callgrind else PARTS
    through = args.callgrind is not None
    for part in parts:
        if through:  # three batches each
            per_batch = args.calls if part == "held_roots" else max(1, args.calls // 10)
            print(f"{part}: {3 * per_batch} calls through operator.call")
        if part == "held_roots":
            for count in roots[:1] if through else roots:
                cpu = bench_held_roots(count, args.calls, through)
                print(f"held_roots, {count} roots, 8 replicas: {cpu * 1e6:.2f} us per call")
        elif part in ("store", "remove"):
            cpu = bench_ingest(part, max(1, args.calls // 10), through)
            print(f"{part} of 1,000 blocks: {cpu * 1e6:.1f} us per call")
        else:
            cpu = bench_add_speculative(max(1, args.calls // 10), through)
            print(f"add_speculative of 512 new blocks: {cpu * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
