"""The Grafana dashboard and the alert rules: they parse, and every metric they query is one kvlb
exports, checked against the registry and against a running ``kvlb serve``'s ``/metrics``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests import DEPLOY, K8S
from procs_free import free_port
from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from promeval import run_rule_tests
from promql import exposed_series, metric_names

from balancer.console import STATIC_FILES, read_static
from balancer.metrics import Metrics

DASHBOARD = DEPLOY / "grafana" / "kvlb-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "kvlb-alerts.yaml"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$job": ".*", "$replica": ".*"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[str]:
    board = dashboard()
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def queried_names() -> set[str]:
    names: set[str] = set()
    for query in dashboard_queries() + [rule["expr"] for rule in alert_rules()]:
        variable = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)  # Grafana: (series, label)
        names |= metric_names(variable.group(1) if variable else query)
    return names


def test_metric_names_are_extracted_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, replica) (rate(a_bucket{job=~"x|y", b="c{d}"}[5m] offset 1d)))'
        " / on (replica) group_left max without (kind) (b:rate5m) > bool 2e3 and c_total unless d"
    )
    assert metric_names(expr) == {"a_bucket", "b:rate5m", "c_total", "d"}


def test_dashboard_is_the_generators_output_and_well_formed() -> None:
    spec = importlib.util.spec_from_file_location("kvlb_dashboard", DEPLOY / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert DASHBOARD.read_text() == generator.render(), "run: python deploy/grafana/generate.py"
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = {p["title"] for p in board["panels"]}
    for wanted in ("Requests/s by status", "Time to first token", "Event lag per replica"):
        assert wanted in titles
    for item in board["panels"]:
        if item["type"] != "row":
            assert item["targets"] and all(t["expr"] and t["refId"] for t in item["targets"]), item["title"]


def test_alert_rules_ship_unchanged_as_a_prometheusrule() -> None:
    rule = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    names = {r["alert"] for r in alert_rules()}
    wanted = {"KvlbReplicaCacheInvisible", "KvlbIndexLagging", "KvlbCacheHitRateDrop", "KvlbHighErrorRate"}
    assert wanted <= names
    for item in alert_rules():
        assert item["labels"]["severity"] in ("warning", "critical")
        assert item["annotations"]["runbook"].startswith("docs/operations.md#")


def test_runbook_anchors_exist() -> None:
    text = (DEPLOY.parent / "docs" / "operations.md").read_text()
    anchors = {
        "-".join("".join(c for c in line.lstrip("#").strip().lower() if c.isalnum() or c in " -").split())
        for line in text.splitlines()
        if line.startswith("#")
    }
    for item in alert_rules():
        assert item["annotations"]["runbook"].split("#")[1] in anchors, item["alert"]


DEPRECATED = {"kvlb_replica_load": "one gauge per unit: kvlb_replica_inflight_seqs, ... (h-loadmetric)"}
"""Metrics kvlb still exports for one release, which nothing it ships may read."""


def test_nothing_shipped_reads_a_deprecated_metric() -> None:
    """No dashboard query or alert rule names a deprecated metric, nor does any other file kvlb ships
    for its deployment (the PrometheusRule, Compose, the image) or the console's page."""
    assert not queried_names() & set(DEPRECATED), sorted(queried_names() & set(DEPRECATED))
    shipped = [path for path in sorted(DEPLOY.rglob("*")) if path.is_file()]
    assert ALERTS in shipped and DASHBOARD in shipped and K8S / "base" / "prometheusrule.yaml" in shipped
    texts = {str(path.relative_to(DEPLOY)): path.read_bytes() for path in shipped}
    texts |= {f"console/{name}": read_static(name) for name in STATIC_FILES}
    for name in DEPRECATED:
        readers = [where for where, text in texts.items() if name.encode() in text]
        assert not readers, f"{name} is deprecated ({DEPRECATED[name]}) but read by {readers}"


FLEET_ONLY = {"kvlb_redis_up"}
"""Queried series only a balancer with ``redis.url`` exports (one without Redis has no Redis to be up)."""


def test_every_queried_metric_is_in_the_registry() -> None:
    metrics = Metrics.create()
    metrics.set_redis_up(True)  # as the fleet mode does at its start
    exported = exposed_series(generate_latest(metrics.registry).decode())
    missing = queried_names() - exported
    assert not missing, f"queried but not exported by balancer/metrics.py: {sorted(missing)}"


def test_every_queried_label_and_rate_fits_the_metric() -> None:
    """A matcher or a ``sum by`` names a label the metric has (or one Prometheus or ``--workers``
    adds), and ``rate``/``increase`` read counters (or histogram parts), never a gauge."""
    metrics = Metrics.create()
    families: dict[str, tuple[str, set[str]]] = {}
    for item in fields(metrics):
        collector = getattr(metrics, item.name)
        if isinstance(collector, Counter | Gauge | Histogram):
            suffixes = ("_total",) if collector._type == "counter" else ("", "_bucket", "_count", "_sum")
            for suffix in suffixes:
                families[collector._name + suffix] = (collector._type, set(collector._labelnames))
    added = {"job", "instance", "worker", "le"}
    for query in dashboard_queries() + [rule["expr"] for rule in alert_rules()]:
        for selector in re.finditer(r"([a-z_:][\w:]*)\{([^{}]*)\}", query):
            name, matchers = selector.groups()
            if name in families:
                used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
                assert used <= families[name][1] | added, (name, used, query)
        for grouped in re.finditer(r"\bby \(([^()]*)\) \((?:rate|increase)\(([a-z_:][\w:]*)", query):
            by, name = grouped.groups()
            if name in families:  # a sum by a label the metric lacks folds every series into one
                wanted = {label.strip() for label in by.split(",") if label.strip()}
                assert wanted <= families[name][1] | added, (name, wanted, query)
        for read in re.finditer(r"\b(rate|increase)\(([a-z_:][\w:]*)", query):
            name = read.group(2)
            kind = families[name][0] if name in families else "counter"  # the process collector's
            assert kind == "counter" or name.endswith(("_bucket", "_count", "_sum")), (name, query)


def served_metrics(tmp_path: Path, config_text: str) -> str:
    """``/metrics`` of a ``kvlb serve`` started with ``config_text``, then stopped."""
    pytest.importorskip("balancer.app", reason="kvlb serve is not available")
    config = tmp_path / "kvlb.yaml"
    config.write_text(config_text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLB_")}
    process = subprocess.Popen(
        [sys.executable, "-m", "balancer", "serve", "--config", str(config), "--no-uvloop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # {"kvlb": "serving", "url": ...} once it listens
        assert line, process.stderr.read() if process.stderr else "kvlb serve exited"
        url = json.loads(line)["url"]
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            exposition = response.read().decode()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return exposition


def test_every_queried_metric_is_served_by_a_running_kvlb(tmp_path: Path) -> None:
    exposition = served_metrics(tmp_path, "listen: {host: 127.0.0.1, port: 0}\nscrape_interval_s: 0\n")
    exposed = exposed_series(exposition)
    missing = queried_names() - exposed - FLEET_ONLY
    assert not missing, f"queried but not on a running kvlb's /metrics: {sorted(missing)}"
    assert not FLEET_ONLY & exposed, "a balancer without Redis exports kvlb_redis_up (reads as an outage)"


NO_SAMPLES_WITHOUT = {
    "kvlb_redis_lease_events_total": "redis.url (fleet mode)",
    "kvlb_redis_errors_total": "redis.url (fleet mode)",
    "kvlb_admission_shed_total": "a first request shed (its reasons are not written at 0 at the start)",
}
"""Families whose matched label values this balancer does not export before what is named happens
(checked elsewhere: tests/integration, the alert walks)."""


def test_every_label_value_the_rules_match_is_served_by_a_running_kvlb(tmp_path: Path) -> None:
    """Each ``name{label="value"}`` an alert rule matches exactly (``cause="frames"``,
    ``outcome="nothing"``, ``status="error"``, ...) is a series a running kvlb serves from its start,
    with a ZMQ replica and a TRT-LLM one configured (their engines down): a rule matching a label value
    kvlb never writes (a typo, a renamed reason) reads nothing and can never fire."""
    dead = [free_port() for _ in range(4)]
    config = (
        "listen: {host: 127.0.0.1, port: 0}\nscrape_interval_s: 0\npools:\n  - model: m\n    replicas:\n"
        f'      - {{id: zmq-0, url: "http://127.0.0.1:{dead[0]}", engine: sglang, block_size: 16,'
        f' events: "tcp://127.0.0.1:{dead[1]}", replay: "tcp://127.0.0.1:{dead[2]}"}}\n'
        f'      - {{id: trt-0, url: "http://127.0.0.1:{dead[3]}", engine: trtllm, block_size: 32}}\n'
    )
    served = [
        (sample.name, sample.labels)
        for family in text_string_to_metric_families(served_metrics(tmp_path, config))
        for sample in family.samples
    ]
    checked = set()
    for rule in alert_rules():
        for selector in re.finditer(r"([a-z_:][\w:]*)\{([^{}]*)\}", rule["expr"]):
            name, matchers = selector.groups()
            wanted = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers))  # = only: not =~ != !~
            if not wanted or name in NO_SAMPLES_WITHOUT:
                continue
            found = any(n == name and wanted.items() <= labels.items() for n, labels in served)
            assert found, f"{rule['alert']}: no {name} series with {wanted} on a running kvlb"
            checked.add((name, tuple(sorted(wanted.items()))))
    assert ("kvlb_events_shed_runs_total", (("cause", "frames"),)) in checked
    assert ("kvlb_events_replay_polls_total", (("outcome", "nothing"),)) in checked


def test_alert_rule_tests_pass_on_the_python_evaluator() -> None:
    """The promtool rule tests, evaluated by ``promeval`` (CI has no promtool): labels and ``for``."""
    tests = sorted((DEPLOY / "prometheus").glob("*.test.yaml"))
    assert len(tests) == 2
    for path in tests:
        failures = run_rule_tests(yaml.safe_load(path.read_text()), alert_rules())
        assert not failures, f"{path.name}: {failures}"


def test_the_python_evaluator_fails_a_wrong_rule() -> None:
    """The same tests against rules that cannot fire, or fire without a cause: each is caught."""
    cases = yaml.safe_load((DEPLOY / "prometheus" / "kvlb-alerts.test.yaml").read_text())
    for name, right, wrong in (
        ("KvlbIndexLagging", "> 5", "> 500"),
        ("KvlbNoHealthyReplica", "== 0", ">= 0"),
        ("KvlbReplicaSlow", "4 * min", "40 * min"),
        ("KvlbTtftSloMissed", ">= 50", ">= 0"),
        ("KvlbLeasesLost", ">= 3", ">= 30"),
        ("KvlbReplicaServesAnotherModel", "== 1", "== 2"),
        ("KvlbHighErrorRate", "queue_timeout|tenant_inflight", "no_such_reason"),
        ("KvlbReplicaLoadFiguresRejected", "[10m]", "[40m]"),
        ("KvlbEventPublisherBadFrames", 'cause="frames"', 'cause="budget"'),
        ("KvlbRedisMirrorResyncing", ">= 3", ">= 30"),
        ("KvlbDiscoveryObjectsOverCap", "> 0", ">= 0"),
    ):
        rules = [
            {**rule, "expr": rule["expr"].replace(right, wrong)} if rule["alert"] == name else rule
            for rule in alert_rules()
        ]
        # only this alert's checks: each check evaluates its own rule alone, so the others' could
        # not catch it (all of them, 11 times over, took 11 s of a loaded full run)
        assert any(name in failure for failure in run_rule_tests(checks_of(cases, name), rules)), name


def checks_of(test_file: dict[str, Any], alertname: str) -> dict[str, Any]:
    """``test_file`` with only the ``alert_rule_test`` checks of ``alertname`` (and their cases)."""
    cases = []
    for case in test_file["tests"]:
        checks = [check for check in case["alert_rule_test"] if check["alertname"] == alertname]
        if checks:
            cases.append({**case, "alert_rule_test": checks})
    assert cases, f"no rule test checks {alertname}"
    return {**test_file, "tests": cases}


promtool = shutil.which("promtool")


@pytest.mark.skipif(promtool is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_every_query_and_rule(tmp_path: Path) -> None:
    assert promtool is not None
    queries = []
    for query in dashboard_queries():
        if query.startswith("label_values("):
            continue
        for variable, value in GRAFANA_VARIABLES.items():
            query = query.replace(variable, value)
        queries.append(query)
    recording = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"q{i}", "expr": q} for i, q in enumerate(queries)]}
        ]
    }
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(recording))
    for rules in (path, ALERTS):
        result = subprocess.run(
            [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(promtool is None, reason="promtool (Debian package prometheus) not installed")
def test_alerts_fire_on_the_failures_they_describe() -> None:
    assert promtool is not None
    tests = [str(path) for path in sorted((DEPLOY / "prometheus").glob("*.test.yaml"))]
    assert len(tests) == 2
    result = subprocess.run([promtool, "test", "rules", *tests], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
