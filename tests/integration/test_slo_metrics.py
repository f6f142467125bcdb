"""The TTFT SLO comes from the settings (``slo``), not from the alert rule: a real balancer exports
``kvlb_slo_ttft_seconds`` (its ``le`` label the bucket bound of ``kvlb_http_ttft_seconds`` it
names) and ``kvlb_slo_ttft_target_ratio``, the TTFT histogram has that bound and a ``pool`` label,
and ``KvlbTtftSloMissed`` (evaluated by ``promeval`` over the balancer's own ``/metrics``) reads
them: with an SLO of 1 ms every first token misses it, with the default 2.5 s none does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from kvlb_harness import MODEL, metric_value, running, shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))
from promeval import Evaluator, Store

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "kvlb-alerts.yaml"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def slo_rule() -> str:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    return str(next(r["expr"] for r in rules if r.get("alert") == "KvlbTtftSloMissed"))


@pytest.mark.parametrize(("ttft_s", "label", "missed"), [(0.001, "0.001", True), (2.5, "2.5", False)])
async def test_the_slo_rule_reads_the_configured_slo(
    tokenizer: Tokenizer, ttft_s: float, label: str, missed: bool
) -> None:
    async with running(tokenizer, 2, slo__ttft_s=ttft_s, slo__ttft_target_ratio=0.95) as h:
        store = Store()
        for minute in range(12):  # one scrape stands for a minute of rule time
            for i in range(6):
                body = {"model": MODEL, "prompt": f"minute {minute}, question {i}: why?", "max_tokens": 1}
                assert (await h.post("/v1/completions", body)).status == 200
            async with h.session.get(h.url + "/metrics") as response:
                text = await response.text()
            store.add_scrape(60.0 * minute, text)
        assert metric_value(text, "kvlb_slo_ttft_seconds", le=label) == ttft_s
        assert metric_value(text, "kvlb_slo_ttft_target_ratio") == 0.95
        assert metric_value(text, "kvlb_http_ttft_seconds_count", pool=MODEL) == 72
        assert metric_value(text, "kvlb_http_e2e_seconds_count", pool=MODEL) == 72
        bucket = metric_value(text, "kvlb_http_ttft_seconds_bucket", pool=MODEL, le=label)
        assert bucket == (0 if missed else 72), text
        share = Evaluator(store).instant(slo_rule(), 60.0 * 11)
        assert share == ({(): 1.0} if missed else {}), share
