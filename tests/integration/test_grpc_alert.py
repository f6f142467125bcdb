"""gRPC failures reach ``KvlbHighErrorRate``: Generate calls refused with ``UNAVAILABLE`` (every
replica drained), scraped twice from the balancer's real ``/metrics`` and evaluated by
``tests/deploy/promeval.py``: the rule's error share counts them (it counted HTTP 5xx alone)."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_harness import failure, grpc_running, token_request
from kvlb_harness import shared_deepseek

from balancer.tokenizer.tokenizer import Tokenizer

sys.path.append(str(Path(__file__).resolve().parents[1] / "deploy"))
from promeval import Evaluator, Store

PROMPT = list(range(100, 140))
ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "kvlb-alerts.yaml"


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_grpc_unavailable_counts_as_an_error(tokenizer: Tokenizer) -> None:
    rules = {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    share = rules["KvlbHighErrorRate"]["expr"].strip().rsplit(">", 1)[0]  # the ratio it compares
    store = Store()
    async with grpc_running(tokenizer) as g:
        for t in (0.0, 60.0, 120.0):  # each series needs two scrapes for a rate
            async with g.http.session.get(g.http.url + "/metrics") as response:
                store.add_scrape(t, await response.text())
            if t == 120.0:
                break
            for replica in ("r0", "r1"):
                await g.http.admin("POST", f"/admin/replicas/{replica}/undrain")
            await g.balancer.Generate(token_request(PROMPT)).read()
            for replica in ("r0", "r1"):
                await g.http.admin("POST", f"/admin/replicas/{replica}/drain")
            for _ in range(3):
                error = await failure(g.balancer.Generate(token_request(PROMPT)).read())
                assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert Evaluator(store).instant(share, 120.0) == {(): 0.75}  # 3 of every 4 calls failed
