"""What one entry of kvlb's long-lived containers costs (tracemalloc, in this process).

docs/reliability.md, "Memory", has a table of every long-lived container of ``balancer/``: its count
bound, its byte bound, and the overflow metric. A container whose entries have a fixed small size is
bounded in bytes by its count; this prints that size, measured on the real classes with entries at
their largest (the longest ids and strings the request path accepts), so the table's products are
figures and not guesses. ``python -m loadtests.container_figures`` (from the repository root) runs
every part; naming parts runs only those:

* ``segments``: :class:`~balancer.tokenizer.segments.SegmentCache`: what an entry costs besides its
  text and 8 bytes an id (:data:`~balancer.tokenizer.segments.SEGMENT_ENTRY_BYTES` covers it), and
  its ``u32`` copy, for segments of four alphabets;
* ``limiter``: :class:`~balancer.log_limit.RepeatLimiter`, a cause with a 128-character subject;
* ``tracker``: :class:`~balancer.load.tracker.LoadTracker`, a reservation under a 128-character
  request id (:data:`~balancer.api.middleware.MAX_REQUEST_ID_CHARS`, printable, as an id of 4-byte
  characters);
* ``removed``: :class:`~balancer.metrics.RemovedReplicas`, a 128-character replica id;
* ``receipts``: :class:`~balancer.routing.receipts.ReceiptBook`, one replica's full window;
* ``key_memo``: :class:`~balancer.index.hashing.KeyMemo`, one run of 32 blocks;
* ``hints``: :class:`~balancer.index.redis.plan.ParentHints`, one engine hash → key;
* ``series``: :class:`~balancer.service.series.SeriesSampler`, one interval with
  ``series_max_replicas`` replicas of 128-character ids;
* ``trtllm``: :class:`~balancer.engines.trtllm.TrtllmDecoder`'s partial-block hashes, one 64-bit
  hash of a rank;
* ``discovery``: what Kubernetes discovery keeps of a pod and an EndpointSlice (the fixtures of
  ``tests/fixtures/k8s/``, trimmed real objects), whole and as
  :func:`~balancer.discovery.k8s_objects.kept_pod` and
  :func:`~balancer.discovery.k8s_objects.kept_slice` keep them (each parsed, kept, the rest freed),
  with what :func:`~balancer.discovery.k8s_objects.kept_bytes` counts of each kept one (the figure
  ``discovery.max_object_bytes`` bounds); also a slice of 1,000 endpoints (Kubernetes' most) and a
  pod with 64 KiB of ``kvlb.io/`` annotations, made from the fixtures;
* ``audit``: :class:`~balancer.service.audit.AuditLog`, a change of every weight with the longest
  reason and actor.

Each line: the part, the entries made, the bytes traced per entry.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from balancer.api.middleware import MAX_REQUEST_ID_CHARS
from balancer.discovery.k8s_objects import kept_bytes, kept_pod, kept_slice
from balancer.engines.trtllm import TrtllmDecoder
from balancer.index.hashing import MEMO_CHUNK_BLOCKS, KeyMemo
from balancer.index.redis.plan import BatchPlan, ParentHints
from balancer.load.tracker import LoadTracker
from balancer.log_limit import RepeatLimiter
from balancer.metrics import RemovedReplicas
from balancer.policy import PolicyWeights
from balancer.routing.receipts import RECEIPT_WINDOW, Receipt, ReceiptBook
from balancer.service.audit import MAX_ACTOR_CHARS, MAX_REASON_CHARS, AuditEntry, AuditLog
from balancer.service.series import SeriesSampler
from balancer.tokenizer.segments import SegmentCache, segment_bytes
from balancer.types import EngineHash, ReplicaId


def per_entry(fill: Callable[[], object], entries: int) -> float:
    """Bytes traced per entry while ``fill`` makes ``entries`` of them (what it returns is kept
    alive until measured: the container)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = fill()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del kept
    return grown / entries


def _given(made: list[int], _: str) -> list[int]:
    return made


def _long_id(number: int, chars: int = MAX_REQUEST_ID_CHARS) -> str:
    """An id of ``chars`` characters, 4 bytes each (the widest a printable id may be)."""
    return (f"\U0001f600{number:08d}" * chars)[:chars]


def _packed_all(cache: SegmentCache, texts: list[str]) -> object:
    """Every text's ``u32`` copy (made at its first packed hit, then kept by the cache)."""
    return [cache.packed_ids(text, _nothing) for text in texts]


def _nothing(_: str) -> list[int]:
    return []


def segments() -> None:
    alphabets = {"ascii": "abcdefgh ", "latin-1": "éàü ", "cjk": "中文字 ", "emoji": "😀😁 "}
    count, chars, ids = 2000, 4096, 1024
    for name, alphabet in alphabets.items():
        texts = [
            (alphabet * (chars // len(alphabet) + 1))[: chars - 8] + f"{number:08d}"
            for number in range(count)
        ]
        encoded = [[number % 1000] * ids for number in range(count)]
        text_bytes = sum(map(sys.getsizeof, texts))
        cache = SegmentCache(max_tokens=10**9, max_bytes=10**12, min_chars=1, ints=tuple(range(1000)))

        def fill(
            cache: SegmentCache = cache, texts: list[str] = texts, encoded: list[list[int]] = encoded
        ) -> object:
            for text, made in zip(texts, encoded, strict=True):
                cache.ids(text, functools.partial(_given, made))
            return cache

        entry = per_entry(fill, count) - 8 * ids  # the texts existed before: not traced
        copy = per_entry(functools.partial(_packed_all, cache, texts), count)
        counted = (cache.cached_bytes - text_bytes) / count - 8 * ids - 4 * ids
        print(
            f"segments {name}: {count} entries of {chars} characters and {ids} ids: entry {entry:.0f} B"
            f" besides text and 8 B an id, u32 copy {copy:.0f} B ({4 * ids} B of ids);"
            f" counted {counted:.0f} B besides text and 12 B an id (segment_bytes of one:"
            f" {segment_bytes(texts[0], ids)} B)"
        )


def limiter() -> None:
    count = 1024
    limiter = RepeatLimiter(max_causes=count)

    def fill() -> object:
        for number in range(count):
            limiter.occur(f"malformed\x00{_long_id(number)}", 0.0)
        return limiter

    print(f"limiter: {count} causes with a 128-character subject: {per_entry(fill, count):.0f} B a cause")


def tracker() -> None:
    count = 65_536
    load = LoadTracker()
    ids = [_long_id(number) for number in range(count)]
    replicas = [ReplicaId(f"replica-{number}") for number in range(8)]

    def fill() -> object:
        for number, request_id in enumerate(ids):
            load.reserve(request_id, replicas[number % 8], 8192, 512, 0.0)
        return load

    entry = per_entry(fill, count) + sys.getsizeof(ids[0])  # the ids existed before: not traced
    print(f"tracker: {count} reservations, 128-character ids: {entry:.0f} B a reservation with its id")


def removed() -> None:
    count = 4096
    ids = [_long_id(number) for number in range(count)]
    book = RemovedReplicas()

    def fill() -> object:
        for replica in ids:
            book.add(replica)
        return book

    entry = per_entry(fill, count) + sys.getsizeof(ids[0])
    print(f"removed: {count} replica ids of 128 characters: {entry:.0f} B an id")


def receipts() -> None:
    replicas = 64
    book = ReceiptBook()

    def fill() -> object:
        for number in range(replicas * RECEIPT_WINDOW):
            replica = ReplicaId(f"replica-{number % replicas}")
            book.record(Receipt(replica, 16, number % 5000, (number * 7) % 5000))
        return book

    print(
        f"receipts: {replicas} replicas × {RECEIPT_WINDOW}:"
        f" {per_entry(fill, replicas):.0f} B a replica's window"
    )


def key_memo() -> None:
    runs, block_size = 4096, 16
    memo = KeyMemo(runs)
    packed = [
        array(
            "I", range(number * block_size * MEMO_CHUNK_BLOCKS, (number + 1) * block_size * MEMO_CHUNK_BLOCKS)
        ).tobytes()
        for number in range(runs)
    ]

    def fill() -> object:
        for number, run in enumerate(packed):
            memo.keys(number, run, block_size, MEMO_CHUNK_BLOCKS)
        return memo

    print(f"key_memo: {runs} runs of {MEMO_CHUNK_BLOCKS} blocks: {per_entry(fill, runs):.0f} B a run")


def hints() -> None:
    count = 100_000
    parents = ParentHints(count)
    plan = BatchPlan(
        overlay={0: {(number * 0x9E3779B97F4A7C15) % 2**64: number << 20 for number in range(count)}}
    )

    def fill() -> object:
        parents.learn("replica-0", plan)
        return parents

    print(f"hints: {count} engine hashes of 64 bits: {per_entry(fill, count):.0f} B a hint")


def series() -> None:
    intervals, replicas = 120, 256
    sampler = SeriesSampler(5.0, intervals, replicas)
    names = [_long_id(number) for number in range(replicas)]

    def fill() -> object:
        for interval in range(intervals):
            wall = 1_000_000.0 + 5.0 * interval
            for replica in names:
                sampler.on_commit(replica, 8192, 4096, wall)
            for sample in range(200):
                sampler.on_ttft(0.001 * (1 + sample), wall)
        return sampler

    print(
        f"series: {intervals} intervals of {replicas} replicas:"
        f" {per_entry(fill, intervals):.0f} B an interval"
    )


def trtllm() -> None:
    count = 65_536
    decoder = TrtllmDecoder(max_partial_hashes=count)

    def fill() -> object:
        for number in range(count):
            decoder._remember_partial(number % 8, EngineHash((number * 0x9E3779B97F4A7C15) % 2**64))
        return decoder

    print(f"trtllm: {count} partial-block hashes: {per_entry(fill, count):.0f} B a hash")


K8S_FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "k8s"


def _kept_pod(pod: dict[str, Any]) -> object:
    return kept_pod(pod, "kvlb.io/")


def _parsed(text: str, count: int) -> object:
    return [json.loads(text) for _ in range(count)]


def _kept(text: str, count: int, keep: Callable[[dict[str, Any]], object]) -> object:
    return [keep(json.loads(text)) for _ in range(count)]


def _large_objects() -> dict[str, str]:
    """A slice of 1,000 endpoints and a pod with 64 KiB of the prefix's annotations, from the
    fixtures (distinct names, addresses and UIDs, as a real one has)."""
    slice_obj = json.loads((K8S_FIXTURES / "endpointslice-sglang.json").read_text())
    endpoint = slice_obj["endpoints"][0]
    endpoints = []
    for n in range(1000):
        item = json.loads(json.dumps(endpoint))
        item["addresses"] = [f"10.{n // 250}.{n % 250}.17"]
        item["targetRef"].update(name=f"sglang-{n}", uid=f"9f1c2d3e-0000-4000-8000-{n:012d}")
        item["hostname"] = f"sglang-{n}"
        endpoints.append(item)
    slice_obj["endpoints"] = endpoints
    pod = json.loads((K8S_FIXTURES / "pod-sglang-0.json").read_text())
    pod["metadata"]["annotations"].update({f"kvlb.io/extra-{n}": "x" * 1000 for n in range(64)})
    return {"slice of 1,000 endpoints": json.dumps(slice_obj), "pod, 64 KiB of annotations": json.dumps(pod)}


def discovery() -> None:
    keeps: dict[str, tuple[str, Callable[[dict[str, Any]], object]]] = {
        "pod-sglang-0.json": ((K8S_FIXTURES / "pod-sglang-0.json").read_text(), _kept_pod),
        "endpointslice-sglang.json": ((K8S_FIXTURES / "endpointslice-sglang.json").read_text(), kept_slice),
    }
    large = _large_objects()
    keeps["slice of 1,000 endpoints"] = (large["slice of 1,000 endpoints"], kept_slice)
    keeps["pod, 64 KiB of annotations"] = (large["pod, 64 KiB of annotations"], _kept_pod)
    for name, (text, keep) in keeps.items():
        count = 4096 if len(text) < 100_000 else 64
        whole = per_entry(functools.partial(_parsed, text, count), count)
        kept = per_entry(functools.partial(_kept, text, count, keep), count)
        counted = kept_bytes(keep(json.loads(text)))
        print(
            f"discovery {name}: {len(text)} B of JSON: whole {whole:.0f} B an object, kept {kept:.0f} B, "
            f"kept_bytes {counted} B ({counted / kept:.2f}x)"
        )


def audit() -> None:
    count = 1000
    log = AuditLog(count)
    names = list(PolicyWeights().to_dict())

    def fill() -> object:
        for number in range(count):
            before = {name: float(number) for name in names}
            after = {name: float(number + 1) for name in names}
            actor = _long_id(number, MAX_ACTOR_CHARS)
            reason = _long_id(number, MAX_REASON_CHARS)
            log.add(
                AuditEntry(
                    float(number), actor, f"token {number:016x} from 127.0.0.1", reason, number, before, after
                )
            )
        return log

    print(f"audit: {count} changes of {len(names)} weights: {per_entry(fill, count):.0f} B a change")


PARTS: dict[str, Callable[[], None]] = {
    "segments": segments,
    "limiter": limiter,
    "tracker": tracker,
    "removed": removed,
    "receipts": receipts,
    "key_memo": key_memo,
    "hints": hints,
    "series": series,
    "trtllm": trtllm,
    "discovery": discovery,
    "audit": audit,
}


def main(argv: Sequence[str]) -> int:
    """Runs the parts ``argv`` names (all when it names none); 2 with the usage on an unknown one."""
    unknown = [name for name in argv if name not in PARTS]
    if unknown:
        print(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    for name in argv or list(PARTS):
        PARTS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
