"""In-process micro-benchmark of the prefix table's hot paths around speculative entries.

Not part of ``kvlb bench``: a probe of ``PrefixTable`` alone (block size 16, the default limits),
for comparing two revisions of the table (run it with ``PYTHONPATH`` at each one's tree):

* ``store``: ``_store_chain`` of one 512-block ``Stored`` (8,192 tokens) into an empty cache, with
  the replica having no speculative slot (``none``), its speculative slot pending on those very 512
  keys (``same``: the request routed there, before the engine reports), or pending on 512 other keys
  (``other``). Each timing is one call on a fresh table.
* ``route``: ``match_confirmed`` then ``add_speculative`` (30 s, as a lease's first add) of an
  8,192-token prompt over four replicas (``a`` holds the first 480 blocks for real, ``b`` the first
  256), each request a new tuple of keys as the router makes them, one simulated millisecond apart:
  ``repeat`` routes the same prompt to ``a``, ``fresh`` gives each request a new 64-token tail on
  one 8,128-token prefix (4 new keys each). ``stored`` is ``repeat`` with ``a``'s engine storing
  the whole prompt after every eighth request (a store of keys pending speculatively).

Prints, per case, the minimum and median over the repeats of the time per call (µs).

    PYTHONPATH=$PWD python loadtests/bench/spec_micro.py [--repeats N]
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time

from balancer.events import Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 16
HASHER = BlockHasher("bench-model", BS)
A, B, C, D = (ReplicaId(name) for name in "abcd")


def _stored(tokens: list[int], first_hash: int) -> Stored:
    blocks = len(tokens) // BS
    engine = tuple(EngineHash(first_hash + i) for i in range(blocks))
    return Stored(0, None, engine, pack_tokens(tokens), BS)


def bench_store(case: str, repeats: int, rng: random.Random) -> list[float]:
    tokens = [rng.randrange(1, 100_000) for _ in range(512 * BS)]
    other = [rng.randrange(1, 100_000) for _ in range(512 * BS)]
    event = _stored(tokens, 1)
    keys = tuple(HASHER.request_keys([*tokens, 1]))[:512]
    other_keys = tuple(HASHER.request_keys([*other, 1]))[:512]
    seed = HASHER.root_seed(None, None)
    timed = "now" in inspect.signature(PrefixTable._store_chain).parameters  # it takes ``now`` since 5b6ccc2
    times: list[float] = []
    for _ in range(repeats):
        table = PrefixTable(HASHER)
        cache = table._slots.new_cache(A, 0)
        assert cache is not None
        if case == "same":
            table.add_speculative(A, keys, 30.0, 0.0)
        elif case == "other":
            table.add_speculative(A, other_keys, 30.0, 0.0)
        started = time.perf_counter()
        if timed:
            table._store_chain(cache, seed, event, 1.0)  # type: ignore[call-arg, unused-ignore]
        else:
            table._store_chain(cache, seed, event)  # type: ignore[call-arg, unused-ignore]
        times.append(time.perf_counter() - started)
    return times


def bench_route(case: str, repeats: int, rng: random.Random, calls: int = 400) -> list[float]:
    prefix = [rng.randrange(1, 100_000) for _ in range(8128)]
    tail = [rng.randrange(1, 100_000) for _ in range(64)]
    prompt = prefix + tail
    among = (A, B, C, D)
    per_call: list[float] = []
    for _ in range(repeats):
        table = PrefixTable(HASHER)
        table.apply(A, [_stored(prompt[: 480 * BS], 1)], 0.0)
        table.apply(B, [_stored(prompt[: 256 * BS], 1)], 0.0)
        table.apply(C, [_stored([rng.randrange(1, 100_000) for _ in range(64 * BS)], 1)], 0.0)
        if case == "fresh":
            prompts = [prefix + [rng.randrange(1, 100_000) for _ in range(64)] for _ in range(calls)]
            listed = [tuple(HASHER.request_keys(p)) for p in prompts]
        else:
            base = HASHER.request_keys([*prompt, 1])
            listed = [tuple(base) for _ in range(calls)]
        whole = _stored(prompt, 1)
        now = 1.0
        spent = 0.0
        for i, keys in enumerate(listed):
            if case == "stored" and i % 8 == 7:
                table.apply(A, [whole], now)  # outside the timing: the engine reports the prompt
            started = time.perf_counter()
            table.match_confirmed(keys, among, now)
            table.add_speculative(A, keys, 30.0, now)
            spent += time.perf_counter() - started
            now += 0.001
        per_call.append(spent / calls)
    return per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(1)
    rows: list[tuple[str, list[float]]] = []
    for case in ("none", "same", "other"):
        rows.append((f"store 512 blocks, spec {case}", bench_store(case, 40 * args.repeats, rng)))
    for case in ("repeat", "fresh", "stored"):
        rows.append((f"match_confirmed+add_speculative 8k, {case}", bench_route(case, args.repeats, rng)))
    for name, times in rows:
        print(f"{name:48s} min {min(times) * 1e6:8.1f} µs  median {statistics.median(times) * 1e6:8.1f} µs")


if __name__ == "__main__":
    main()
