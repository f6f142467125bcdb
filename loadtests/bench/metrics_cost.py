"""In-process benchmark of one ``/metrics`` render at a fleet size: ``generate_latest`` against
:class:`balancer.exposition.Exposition`, and the merge of ``kvlb serve --workers 2``.

Not part of ``kvlb bench``: a probe of the rendering alone, on a bare registry (no server, no load),
for comparing the two renderers in one process and two revisions (with ``PYTHONPATH`` at each tree:
on a tree without :mod:`balancer.exposition` only ``generate_latest`` is measured).

Two registries of :class:`balancer.metrics.Metrics` with ``--replicas`` replicas (ZMQ transports):

* ``load``: only the per-replica load figures (:meth:`~balancer.metrics.Metrics.set_replica_load`,
  every kind), what the round of 2026-12-01 (h-loadmetric) measured;
* ``full``: every replica also registered (:meth:`~balancer.metrics.Metrics.init_replica`'s counters at
  0), its health gauges set and, with ``--observed`` (default 1), one request's TTFT, end-to-end
  time and prediction error observed (a histogram child each): what ``/metrics`` holds after traffic.

Figures (ms, best and median of ``--repeats`` renders): ``generate_latest``; ``exposition`` (a kept
:class:`Exposition`, after one first render, whose time is ``exposition_first``); ``merge_2`` (the
gathering worker's :func:`balancer.api.siblings.merge_metrics` of two workers' texts; and, on a tree
that merges in steps, its longest step, wall / CPU). Bytes and
samples of one render. The process's own collector (CPU seconds) is left out so two renders compare;
the registry is built, then frozen out of the collector's walks (``gc.freeze``, as ``kvlb serve``
does after its start), so that a full collection does not land in one render rather than another.
On a tree whose :class:`Exposition` renders in steps (2026-12-01, h-metrics200): the longest step of
the first render and of the later ones (``longest_step_ms``: what the event loop is held at most; in
wall time and in the thread's CPU time, which the machine's load does not stretch),
and, in ``full``, ``changed``: a render after one more request of each replica was observed (its
TTFT, end-to-end time, prediction error and request count: every per-replica family of the request
path changed), with ``generate_latest`` of the same registry state.

    PYTHONPATH=$PWD python -m loadtests.bench.metrics_cost --replicas 200 [--repeats 30] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

from balancer.api.siblings import merge_metrics
from balancer.metrics import Metrics

try:  # absent on a tree from before 2026-12-01 (h-metricscost)
    from balancer.exposition import Exposition
except ImportError:  # pragma: no cover - an old tree
    Exposition = None  # type: ignore[assignment,misc]
try:  # absent on a tree from before 2026-12-01 (h-metrics200)
    from balancer.exposition import merge_rendered_steps
except ImportError:  # pragma: no cover - an old tree
    merge_rendered_steps = None  # type: ignore[assignment]


LOAD_KINDS = ("inflight", "peer_inflight", "pending_prefill_tokens", "decode_blocks", "waiting", "kv_usage")
"""The kinds of ``kvlb_replica_load`` (``balancer.metrics.LoadKind``; spelled out to run on a tree from
before h-loadmetric, which set ``kvlb_replica_load`` alone)."""


def set_load(metrics: Metrics, replica: str, kind: str, value: float) -> None:
    """Set one load figure as the tree's ``refresh_gauges`` does."""
    setter = getattr(metrics, "set_replica_load", None)
    if setter is not None:
        setter(replica, kind, value)
    else:  # a tree from before h-loadmetric
        metrics.replica_load.labels(replica, kind).set(value)


def build(replicas: int, full: bool, observed: int) -> CollectorRegistry:
    """A registry of ``replicas`` replicas (see the module docstring), the process collector left out."""
    metrics = Metrics.create()
    for collector in list(metrics.registry._collector_to_names):
        if isinstance(collector, ProcessCollector):
            metrics.registry.unregister(collector)
    for i in range(replicas):
        replica = f"replica-{i:03d}"
        if full:
            metrics.init_replica(replica, "vllm", replays=True)
            metrics.replica_healthy.labels(replica).set(1)
            metrics.replica_breaker_open.labels(replica).set(0)
            metrics.replica_model_mismatch.labels(replica).set(0)
            metrics.replica_key_refused.labels(replica).set(0)
            metrics.index_replica_blocks.labels(replica).set(i * 10)
            for _ in range(observed):
                metrics.ttft_seconds.labels("model", replica, "kv_aware").observe(0.2)
                metrics.e2e_seconds.labels("model", replica, "kv_aware").observe(1.5)
                metrics.prediction_error_blocks.labels(replica).observe(0)
                metrics.requests_total.labels("chat", "200", replica, "kv_aware").inc()
        for n, kind in enumerate(LOAD_KINDS):
            set_load(metrics, replica, kind, float(i + n) * (0.01 if kind == "kv_usage" else 3))
    return metrics.registry


def observe_requests(registry: CollectorRegistry, replicas: int, round_: int) -> None:
    """One more request of each replica, as :func:`build` observes them (``round_`` varies the values)."""
    collectors = registry._names_to_collectors
    ttft = collectors["kvlb_http_ttft_seconds"]
    e2e = collectors["kvlb_http_e2e_seconds"]
    error = collectors["kvlb_route_prediction_error_blocks"]
    requests = collectors["kvlb_http_requests_total"]
    for i in range(replicas):
        replica = f"replica-{i:03d}"
        ttft.labels("model", replica, "kv_aware").observe(0.05 * (round_ % 7))  # type: ignore[attr-defined]
        e2e.labels("model", replica, "kv_aware").observe(0.5 + round_ % 5)  # type: ignore[attr-defined]
        error.labels(replica).observe(round_ % 3 - 1)  # type: ignore[attr-defined]
        requests.labels("chat", "200", replica, "kv_aware").inc()  # type: ignore[attr-defined]


def timed(
    call: Callable[[], object], repeats: int, before: Callable[[int], None] | None = None
) -> dict[str, float]:
    """Best and median of ``repeats`` calls, in ms (``before(i)`` called untimed before each)."""
    times = []
    for i in range(repeats):
        if before is not None:
            before(i)
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return {"best_ms": round(min(times), 2), "median_ms": round(statistics.median(times), 2)}


def longest_step(steps: Generator[None, None, object]) -> tuple[float, float]:
    """The longest step of a render in steps, in wall time and in this thread's CPU time (ms: on a
    loaded machine the wall time of a step includes the time the process waited for a core)."""
    wall = cpu = 0.0
    while True:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            next(steps)
        except StopIteration:
            break
        finally:
            wall = max(wall, time.perf_counter() - start)
            cpu = max(cpu, time.thread_time() - start_cpu)
    return round(wall * 1e3, 2), round(cpu * 1e3, 2)


def measure(replicas: int, repeats: int, observed: int) -> dict[str, Any]:
    """Every figure of the module docstring, by registry."""
    out: dict[str, Any] = {}
    for name, full in (("load", False), ("full", True)):
        registry = build(replicas, full, observed)
        gc.collect()
        gc.freeze()  # what ``kvlb serve`` does after its start (balancer.gc_tuning.settle_after_start)
        text = generate_latest(registry)
        row: dict[str, Any] = {
            "bytes": len(text),
            "samples": sum(1 for line in text.splitlines() if line and not line.startswith(b"#")),
            "generate_latest": timed(lambda r=registry: generate_latest(r), repeats),  # type: ignore[misc]
        }
        if Exposition is not None:
            exposition = Exposition(registry)
            start = time.perf_counter()
            same = exposition.render() == text
            row["exposition_first_ms"] = round((time.perf_counter() - start) * 1e3, 2)
            row["exposition"] = timed(exposition.render, repeats)
            row["exposition_same_bytes"] = same
            if hasattr(exposition, "steps"):
                first = longest_step(Exposition(registry).steps())
                later = [longest_step(exposition.steps()) for _ in range(repeats)]
                row["longest_step_ms"] = {
                    "first": {"wall": first[0], "cpu": first[1]},
                    "later": {"wall": max(w for w, _ in later), "cpu": max(c for _, c in later)},
                }
            if full:

                def observe(i: int, r: CollectorRegistry = registry) -> None:
                    observe_requests(r, replicas, i + 1)

                row["changed"] = {
                    "generate_latest": timed(lambda r=registry: generate_latest(r), repeats, observe),  # type: ignore[misc]
                    "exposition": timed(exposition.render, repeats, observe),
                }
                row["changed_same_bytes"] = exposition.render() == generate_latest(registry)
        decoded = text.decode()
        row["merge_2"] = timed(lambda d=decoded: merge_metrics({0: d, 1: d}), max(1, repeats // 3))  # type: ignore[misc]
        if merge_rendered_steps is not None:
            wall, cpu = longest_step(merge_rendered_steps({0: decoded, 1: decoded}))
            row["merge_2_longest_step_ms"] = {"wall": wall, "cpu": cpu}
        out[name] = row
    return out


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| registry | samples | bytes | generate_latest best / median ms | exposition best / median ms "
        "(first) | merge of 2 workers best / median ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("load", "full"):
        row = result["registries"][name]
        gen = row["generate_latest"]
        exp = row.get("exposition")
        exp_text = (
            f"{exp['best_ms']} / {exp['median_ms']} ({row['exposition_first_ms']})" if exp else "absent"
        )
        merge = row["merge_2"]
        merge_text = f"{merge['best_ms']} / {merge['median_ms']}"
        merge_step = row.get("merge_2_longest_step_ms")
        if merge_step is not None:
            merge_text += f"; longest step {merge_step['wall']} / {merge_step['cpu']}"
        steps = row.get("longest_step_ms")
        if steps is not None:
            first, later = steps["first"], steps["later"]
            exp_text += (
                f"; longest step (wall / CPU) {first['wall']} / {first['cpu']} first, "
                f"{later['wall']} / {later['cpu']} later"
            )
        lines.append(
            f"| {name} | {row['samples']:,} | {row['bytes']:,} | {gen['best_ms']} / {gen['median_ms']} | "
            f"{exp_text} | {merge_text} |"
        )
    changed = result["registries"]["full"].get("changed")
    if changed is not None:
        gen, exp = changed["generate_latest"], changed["exposition"]
        lines.append(
            f"\nAfter one more request of each replica: generate_latest {gen['best_ms']} / "
            f"{gen['median_ms']} ms, exposition {exp['best_ms']} / {exp['median_ms']} ms (best / median)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, default=200, help="replicas in each registry (1..5000)")
    parser.add_argument("--repeats", type=int, default=30, help="renders timed per figure (1..1000)")
    parser.add_argument("--observed", type=int, default=1, help="requests observed per replica (0..100)")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args = parser.parse_args(argv)
    if not 1 <= args.replicas <= 5000 or not 1 <= args.repeats <= 1000 or not 0 <= args.observed <= 100:
        parser.error("--replicas 1..5000, --repeats 1..1000, --observed 0..100")
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    result = {
        "started_utc": started,
        "load_average": list(os.getloadavg()),
        "command": " ".join(["python -m loadtests.bench.metrics_cost", *sys.argv[1:]]),
        "replicas": args.replicas,
        "repeats": args.repeats,
        "observed": args.observed,
        "registries": measure(args.replicas, args.repeats, args.observed),
    }
    print(json.dumps(result, indent=2))
    if not args.json:
        print(table(result))
    return result


if __name__ == "__main__":
    main()
