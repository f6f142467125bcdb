"""The Dynamo ``RadixTree`` side of ``kvlb bench index`` (I/O: optional native import, /proc).

Dynamo's tree is fed the same ``Stored`` events as JSON ``KvCacheEvent`` bytes, with per-block token
hashes (XXH3-64, seed 1337, as Dynamo computes them) worked out before timing, so its apply time
covers parsing and insertion but no hashing; kvlb's apply hashes tokens. Its memory is the growth
of this process's resident set, which also counts allocator slack.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from loadtests.bench.index_bench import BenchShape, Workload

DYNAMO_SEED = 1337
"""Dynamo's XXH3 seed for per-block token hashes (docs/reference/engine-events.md §5.2)."""


def _load() -> tuple[Any, Callable[..., list[int]], str] | None:
    try:
        from dynamo.llm import RadixTree, compute_block_hash_for_seq
    except ImportError:
        return None
    try:
        from importlib.metadata import version

        found = version("ai-dynamo-runtime")
    except Exception:  # metadata missing: the import still worked
        found = "unknown"
    return RadixTree, compute_block_hash_for_seq, found


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``), ``None`` elsewhere."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _block_hashes(tokens: bytes, block_bytes: int) -> list[int]:
    return [
        xxhash.xxh3_64_intdigest(tokens[i : i + block_bytes], DYNAMO_SEED)
        for i in range(0, len(tokens) - block_bytes + 1, block_bytes)
    ]


def _event_json(
    event_id: int, parent: int | None, hashes: tuple[int, ...], tokens_hashes: list[int]
) -> bytes:
    blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, tokens_hashes, strict=True)]
    body = {"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}
    return json.dumps(body).encode()


def _p(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0


def run(
    shape: BenchShape, workload: Workload, expected: Callable[[str], int], kvlb: dict[str, Any]
) -> dict[str, Any]:
    """Measure Dynamo on the same shapes; ``{"available": False}`` when it does not import."""
    loaded = _load()
    if loaded is None:
        return {"available": False, "reason": "not installed (pip install 'kvlb[bench]')"}
    radix_tree, hash_seq, version = loaded
    block_bytes = 4 * shape.block_size
    gc.collect()
    rss_before = rss_bytes()
    tree = radix_tree()
    wall_ns = cpu_ns = 0
    for event_id, (replica, event) in enumerate(workload.events):
        tokens_hashes = _block_hashes(event.tokens, block_bytes)
        body = _event_json(event_id, event.parent, event.engine_hashes, tokens_hashes)
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()  # process: its tree runs in a thread
        tree.apply_event(replica, body)
        wall_ns += time.perf_counter_ns() - wall
        cpu_ns += time.process_time_ns() - cpu
    rss_after = rss_bytes()
    match = _match(shape, tree, workload, expected)
    hashing = _hashing(shape, hash_seq)
    del tree
    result: dict[str, Any] = {
        "available": True,
        "version": version,
        "apply_blocks_per_s": workload.held_blocks / (wall_ns / 1e9),
        "apply_blocks_per_cpu_s": workload.held_blocks / (max(cpu_ns, 1) / 1e9),
        "match_us": match,
        "rss_bytes_per_block": None
        if rss_before is None or rss_after is None
        else (rss_after - rss_before) / workload.held_blocks,
        "hash_8k_ms": hashing,
    }
    result["ratios_kvlb_over_dynamo"] = _ratios(kvlb, result)
    return result


def _match(
    shape: BenchShape, tree: Any, workload: Workload, expected: Callable[[str], int]
) -> dict[str, Any]:
    block_bytes = 4 * shape.block_size
    prompts = [(kind, _block_hashes(tokens, block_bytes)) for kind, tokens in workload.prompts]
    every: list[int] = []
    cpu: list[int] = []
    errors = 0
    for i in range(shape.matches):
        kind, hashes = prompts[i % len(prompts)]
        start = time.perf_counter_ns()
        scores = tree.find_matches(hashes).scores
        every.append(time.perf_counter_ns() - start)
        errors += max(scores.values(), default=0) != expected(kind)
    for i in range(shape.matches):
        start = time.process_time_ns()
        tree.find_matches(prompts[i % len(prompts)][1])
        cpu.append(time.process_time_ns() - start)
    return {
        "p50": _p(every, 0.5),
        "p99": _p(every, 0.99),
        "mean": statistics.fmean(every) / 1000.0,
        "cpu": {"p50": _p(cpu, 0.5), "p99": _p(cpu, 0.99)},
        "wrong_results": errors,
    }


def _hashing(shape: BenchShape, hash_seq: Callable[..., list[int]]) -> dict[str, float]:
    import random

    rng = random.Random(shape.seed)
    tokens = [rng.randrange(150_000) for _ in range(shape.hash_tokens)]
    result: dict[str, float] = {}
    for block_size in (16, 32):
        samples = []
        for _ in range(shape.hash_repeats):
            start = time.perf_counter_ns()
            hash_seq(tokens, block_size)
            samples.append(time.perf_counter_ns() - start)
        result[str(block_size)] = statistics.median(samples) / 1e6
    return result


def _ratios(kvlb: dict[str, Any], dynamo: dict[str, Any]) -> dict[str, float | None]:
    def ratio(ours: float | None, theirs: float | None) -> float | None:
        return None if not ours or not theirs else ours / theirs

    return {
        "apply_blocks_per_s": ratio(kvlb["apply_blocks_per_s"], dynamo["apply_blocks_per_s"]),
        "apply_blocks_per_cpu_s": ratio(kvlb["apply_blocks_per_cpu_s"], dynamo["apply_blocks_per_cpu_s"]),
        "match_p50_us": ratio(kvlb["match_us"]["p50"], dynamo["match_us"]["p50"]),
        "match_p99_us": ratio(kvlb["match_us"]["p99"], dynamo["match_us"]["p99"]),
        "match_cpu_p50_us": ratio(kvlb["match_us"]["cpu"]["p50"], dynamo["match_us"]["cpu"]["p50"]),
        "bytes_per_block": ratio(kvlb.get("rss_bytes_per_block"), dynamo["rss_bytes_per_block"]),
        "hash_8k_ms_16": ratio(kvlb["hash_8k_ms"]["16"], dynamo["hash_8k_ms"]["16"]),
        "hash_8k_ms_32": ratio(kvlb["hash_8k_ms"]["32"], dynamo["hash_8k_ms"]["32"]),
    }
