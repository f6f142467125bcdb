"""``/metrics``'s renderer writes what ``prometheus_client.generate_latest`` writes, byte for byte.

:class:`balancer.exposition.Exposition` keeps each series' text between scrapes; these renders run
on real registries (kvlb's own :class:`balancer.metrics.Metrics` with 50 replicas, and a plain one
with every kind of sample it meets) and change them between renders: values, removed children,
children added again (a new ``_created``), escaping, NaN, infinities, large and negative values.
The merge of ``kvlb serve --workers N`` (:func:`balancer.exposition.merge_rendered`) writes what the
parser-based merge writes, from the same texts.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from balancer.api.siblings import absent_worker_metrics, merge_metrics, merge_parsed
from balancer.exposition import Exposition, merge_rendered, merge_rendered_steps
from balancer.metrics import LOAD_KIND_METRICS, Metrics

REPLICAS = 50


class _Timestamped(Collector):
    """A custom collector with timestamps and odd values (the generic path)."""

    def __init__(self) -> None:
        self.value = 1.5

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily("odd_values", 'Help with \\ and\nnewline "quoted".', labels=["x"])
        family.add_metric(["a\\b"], self.value, timestamp=1_700_000_000.25)
        family.add_metric(['q"uote\nline'], math.nan)
        family.add_metric(["inf"], math.inf)
        family.add_metric(["-inf"], -math.inf)
        family.add_metric(["big"], 12_345_678.0)
        family.add_metric(["neg"], -12_345_678.5)
        family.add_metric(["negzero"], -0.0)
        family.add_metric(["tiny"], 1e-9)
        return [family]


def _without_process(registry: CollectorRegistry) -> CollectorRegistry:
    """``registry`` without its ``ProcessCollector`` (CPU seconds move between two renders)."""
    for collector in list(registry._collector_to_names):
        if isinstance(collector, ProcessCollector):
            registry.unregister(collector)
    return registry


def test_a_plain_registry_renders_alike_across_changes() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things counted.", ["replica", "reason"], registry=registry)
    bare = Counter("bare_total", "An unlabelled counter.", registry=registry)
    gauge = Gauge("level_ratio", "A level.", ["replica"], registry=registry)
    computed = Gauge("computed", "A gauge read from a function.", registry=registry)
    histogram = Histogram(
        "wait_seconds", "Waits.", ["pool", "replica"], registry=registry, buckets=(0.1, 2.5, 10)
    )
    summary = Summary("size_bytes", "Sizes.", ["kind"], registry=registry)
    info = Info("build", "Build facts.", registry=registry)
    odd = _Timestamped()
    registry.register(odd)
    exposition = Exposition(registry)
    level = [0.0]
    computed.set_function(lambda: level[0])
    info.info({"version": "1.2", "quote": 'a"b'})
    for i in range(20):
        counter.labels(f"r{i}", "gap").inc(i)
        gauge.labels(f"r{i}").set(i / 7)
        histogram.labels("m", f"r{i}").observe(i / 3)
    summary.labels("body").observe(100)
    bare.inc(3)
    assert exposition.render() == generate_latest(registry)
    for step in range(4):
        level[0] = 2_000_000.0 * step
        odd.value = -step * 1e7
        for i in range(0, 20, 2):
            gauge.labels(f"r{i}").set(-i * 1e6)
            counter.labels(f"r{i}", "gap").inc()
            histogram.labels("m", f"r{i}").observe(step * 4.0)
        counter.remove("r3", "gap")
        gauge.remove("r5")
        if step % 2:
            counter.labels("r3", "gap").inc(2)  # back again: a new _created
            gauge.labels("r5").set(math.nan)
            gauge.labels('esc"a\\pe\n').set(math.inf)
        else:
            gauge.labels("r7").set(-0.0)
        summary.labels(f"k{step}").observe(step)
        assert exposition.render() == generate_latest(registry), step


def test_kvlb_metrics_of_many_replicas_render_alike_and_forget_removed_series() -> None:
    metrics = Metrics.create()
    _without_process(metrics.registry)
    exposition = Exposition(metrics.registry)
    for i in range(REPLICAS):
        replica = f"replica-{i:03d}"
        metrics.init_replica(replica, "vllm", replays=i % 2 == 0)
        for kind in LOAD_KIND_METRICS:
            metrics.set_replica_load(replica, kind, i * 1.5)
        metrics.replica_healthy.labels(replica).set(1)
        metrics.ttft_seconds.labels("m", replica, "kv").observe(i / 100)
    assert exposition.render() == generate_latest(metrics.registry)
    kept = exposition.prefixes
    for i in range(0, REPLICAS, 2):
        metrics.forget_replica(f"replica-{i:03d}")
    for i in range(1, REPLICAS, 2):
        metrics.set_replica_load(f"replica-{i:03d}", "inflight", i + 1)
        metrics.events_seq_gaps_total.labels(f"replica-{i:03d}").inc()
    assert exposition.render() == generate_latest(metrics.registry)
    assert exposition.prefixes < kept * 0.6  # the removed replicas' texts went with their series
    metrics.init_replica("replica-000", "vllm", replays=True)  # added again
    metrics.set_replica_load("replica-000", "kv_usage", 0.25)
    assert exposition.render() == generate_latest(metrics.registry)


def _run(steps: Generator[None, None, bytes]) -> tuple[bytes, int]:
    """The text a render in steps returns, and how many times it yielded."""
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(bytes, done.value), yields
        yields += 1


def test_renders_in_steps_and_two_at_once_write_what_generate_latest_writes() -> None:
    metrics = Metrics.create()
    _without_process(metrics.registry)
    for i in range(REPLICAS):
        metrics.init_replica(f"replica-{i:03d}", "vllm", replays=True)
        metrics.ttft_seconds.labels("m", f"replica-{i:03d}", "kv").observe(i / 10)
    expected = generate_latest(metrics.registry)
    exposition = Exposition(metrics.registry, step=100)
    text, yields = _run(exposition.steps())
    assert text == expected and yields >= 50  # the first render: every label text built
    text, yields = _run(exposition.steps())
    assert text == expected and yields >= 1  # unchanged: the families' kept texts
    for i in range(0, REPLICAS, 3):
        metrics.ttft_seconds.labels("m", f"replica-{i:03d}", "kv").observe(1.0)
        metrics.events_seq_gaps_total.labels(f"replica-{i:03d}").inc()
    expected = generate_latest(metrics.registry)
    first, second = exposition.steps(), exposition.steps()
    out: dict[int, bytes] = {}
    while len(out) < 2:  # two scrapes at once, their steps alternating
        for index, steps in enumerate((first, second)):
            if index not in out:
                try:
                    next(steps)
                except StopIteration as done:
                    out[index] = done.value
    assert out[0] == out[1] == expected
    assert exposition.render() == expected


def test_a_gauge_given_a_function_a_counter_reset_and_a_child_replaced_after_a_render() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("level_ratio", "A level.", ["replica"], registry=registry)
    counter = Counter("things", "Things counted.", ["replica"], registry=registry)
    for i in range(5):
        gauge.labels(f"r{i}").set(i)
        counter.labels(f"r{i}").inc(i)
    exposition = Exposition(registry)
    assert exposition.render() == generate_latest(registry)
    level = [7.5]
    gauge.labels("r2").set_function(lambda: level[0])
    assert exposition.render() == generate_latest(registry)
    level[0] = 8.5
    counter.labels("r1").reset()  # same child, a new _created
    assert exposition.render() == generate_latest(registry)
    counter.remove("r3")
    counter.labels("r3")  # a new child at 0 where one at 3 was
    gauge.remove("r4")
    gauge.labels("r4").set(4)  # a new child, the same value
    assert exposition.render() == generate_latest(registry)


def _odd_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_Timestamped())
    gauge = Gauge("level_ratio", "A level.", ["replica"], registry=registry)
    gauge.labels('esc"a\\pe\n').set(math.inf)
    gauge.labels("big").set(1.5e9)
    Histogram("wait_seconds", "Waits.", ["pool"], registry=registry).labels("m").observe(0.3)
    Counter("bare_total", "An unlabelled counter.", registry=registry).inc(3)
    Summary("size_bytes", "Sizes.", registry=registry).observe(10)
    return registry


def test_the_workers_merge_writes_what_the_parsed_merge_writes() -> None:
    metrics = Metrics.create()
    for i in range(20):
        metrics.init_replica(f"replica-{i:03d}", "vllm", replays=True)
        metrics.set_replica_load(f"replica-{i:03d}", "kv_usage", i / 20)
    texts = {
        2: generate_latest(metrics.registry).decode(),
        0: generate_latest(_odd_registry()).decode(),
        1: absent_worker_metrics(4),
        3: Exposition(metrics.registry).render().decode(),
    }
    merged = merge_rendered(texts)
    assert merged is not None
    assert merged == merge_parsed(texts)
    assert merge_metrics(texts) == merged
    steps = merge_rendered_steps(texts, step=100)
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            assert done.value == merged
            break
        yields += 1
    assert yields >= sum(text.count("\n") for text in texts.values()) // 100 - 1


def test_a_text_not_as_kvlb_renders_it_is_parsed() -> None:
    odd = "# HELP x_total Things.\n# TYPE x_total counter\nx_total 1.0\ny_untyped 2.0\n"
    texts = {0: odd, 1: absent_worker_metrics(0)}
    assert merge_rendered(texts) is None
    assert merge_metrics(texts) == merge_parsed(texts)
    info = CollectorRegistry()
    Info("build", "Build facts.", registry=info).info({"version": "1"})
    texts = {0: generate_latest(info).decode()}
    assert merge_metrics(texts) == merge_parsed(texts)
