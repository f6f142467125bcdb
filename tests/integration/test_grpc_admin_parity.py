"""The gRPC admin answers carry the facts of their HTTP twins (``GET /admin/replicas``, ``GET
/admin/policy``, ``POST /admin/explain``), over a real balancer with its gRPC server and two emulated
vLLM engines: r0 serves another model name than its pool, r1 needs an API key and is drained."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
import zmq.asyncio
from kvlb_harness import MODEL, replica_entry, wait_ready

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer._proto.kvlb.v1 import balancer_pb2_grpc as pb_grpc
from balancer.app import Balancer
from balancer.config import load
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.faults import FaultSettings
from replicas.sim.profiles import get_profile
from replicas.sim.replica import Replica

KEY = "sk-engine-parity-4242"
ADMIN = (("authorization", "Bearer root"),)
PROMPT = list(range(1, 40))

TYPED = {
    "unroutable": ("unroutable",),
    "model_mismatch": ("health", "model_mismatch"),
    "drain_kept": ("health", "drain_kept"),
    "api_key_source": ("api_key",),
    "breaker": ("health", "breaker"),
    "health_last_error": ("health", "last_error"),
    "dp_size": ("dp_size",),
    "events_hint": ("events", "hint"),
    "routable": ("routable",),
    "inflight": ("inflight",),
}
"""``Replica`` field -> where ``GET /admin/replicas`` shows the same fact."""
SOURCE_FACTS = ("kind", "endpoint", "dp_rank", "connected", "last_error", "messages", "gaps", "resyncs")


def typed(message: Any, name: str) -> object:
    """A field of ``message``; ``None`` for an optional one that is unset."""
    try:
        if not message.HasField(name):
            return None
    except ValueError:  # not an optional field: always has a value
        pass
    return getattr(message, name)


def at(view: dict[str, Any], path: tuple[str, ...]) -> object:
    value: Any = view
    for key in path:
        value = None if value is None else value.get(key)
    return value


@asynccontextmanager
async def parity_rig(
    tmp_path: Path,
) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession, pb_grpc.AdminStub]]:
    zctx = zmq.asyncio.Context()
    engines: list[Replica] = []
    balancer: Balancer | None = None
    try:
        for name, faults, key in (
            ("r0", FaultSettings(served_model="llama-3"), None),
            ("r1", FaultSettings(), KEY),
        ):
            config = ReplicaConfig(
                name=name,
                engine="vllm",
                profile=get_profile("cpu-test"),
                page_size=16,
                faults=faults,
                api_key=key,
            )
            engine = Replica(config, TokenIdTokenizer(), zctx)
            await engine.start()
            engines.append(engine)
        entries = [replica_entry(engines[0]), {**replica_entry(engines[1]), "api_key_env": "ENGINE_KEY"}]
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0, "grpc_port": 0},
            "auth": {"admin_token": "root"},
            "pools": [{"model": MODEL, "replicas": entries}],
            "health_interval_s": 0.2,
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(tree), encoding="utf-8")
        balancer = Balancer(load(path, env={"ENGINE_KEY": KEY}), tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        headers = {"Authorization": "Bearer root"}
        async with aiohttp.ClientSession(headers=headers) as session:
            await wait_ready(session, balancer.url)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{balancer.grpc_port}") as channel:
                yield balancer, session, pb_grpc.AdminStub(channel)
    finally:
        if balancer is not None:
            await balancer.stop()
        for engine in reversed(engines):
            await engine.stop()
        zctx.destroy(linger=0)


async def http_json(session: aiohttp.ClientSession, method: str, url: str, body: object = None) -> Any:
    async with session.request(method, url, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_grpc_admin_answers_carry_the_facts_of_their_http_twins(tmp_path: Path) -> None:
    """Until 2026-12-01 (h-grpcparity) gRPC ``ListReplicas`` had no typed ``unroutable``,
    ``model_mismatch``, ``drain_kept``, API key source, event sources or ``workers``; ``GetPolicy`` no
    ``policies`` nor ``ranges``; ``Explain`` no ``sequences`` nor ``decode_blocks``."""
    async with parity_rig(tmp_path) as (balancer, session, admin):
        http_policy = await http_json(session, "GET", balancer.url + "/admin/policy")
        policy = await admin.GetPolicy(pb.GetPolicyRequest(), metadata=ADMIN)
        assert list(policy.policies) == http_policy["policies"] and "round_robin" in policy.policies
        ranges = {
            name: {"low": r.low, "high": r.high, "low_open": r.low_open, "nullable": r.nullable}
            for name, r in policy.ranges.items()
        }
        assert ranges == http_policy["ranges"] and ranges["overlap_credit"]["high"] > 0

        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 7, "n": 3}
        http_explained = await http_json(session, "POST", balancer.url + "/admin/explain", body)
        request = pb.GenerateRequest(
            model=MODEL, prompt_token_ids=pb.TokenIds(ids=PROMPT), max_tokens=7, extra_json='{"n": 3}'
        )
        explained = await admin.Explain(pb.ExplainRequest(request=request), metadata=ADMIN)
        assert explained.sequences == http_explained["sequences"] == 3
        assert explained.decode_blocks == http_explained["decode_blocks"] > 0
        assert dict(explained.left_out) == http_explained["left_out"] == {"r0": "serves another model"}

        drain = pb.DrainReplicaRequest(replica_id="r1", reason="parity check")
        await admin.DrainReplica(drain, metadata=(*ADMIN, ("x-kvlb-actor", "sre")))
        http_views = {
            v["id"]: v
            for v in (await http_json(session, "GET", balancer.url + "/admin/replicas"))["replicas"]
        }
        listed = await admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)
        assert list(listed.workers) == [] and list(listed.workers_missing) == []  # one process
        assert [r.id for r in listed.replicas] == sorted(http_views) == ["r0", "r1"]
        for replica in listed.replicas:
            view = http_views[replica.id]
            for name, path in TYPED.items():
                assert typed(replica, name) == at(view, path), (replica.id, name, view)
            sources = view["events"]["sources"]
            assert len(replica.event_sources) == len(sources) > 0
            for source, source_view in zip(replica.event_sources, sources, strict=True):
                for name in SOURCE_FACTS:
                    assert typed(source, name) == source_view[name], (replica.id, name, source_view)
            drain_view = at(view, ("health", "drain"))
            if drain_view is None:
                assert not replica.HasField("drain")
            else:
                shown = dict(replica.drain)
                assert {k: shown[k] for k in ("by", "caller", "reason")} == {
                    k: drain_view[k] for k in ("by", "caller", "reason")
                }

        r0, r1 = listed.replicas
        assert r0.unroutable == "serves another model" and "['llama-3']" in r0.model_mismatch
        assert not r0.HasField("api_key_source") and not r0.HasField("drain")
        assert r1.unroutable == "draining" and not r1.HasField("model_mismatch")
        assert r1.api_key_source == "api_key_env ENGINE_KEY" and KEY not in str(r1)
        assert (r1.drain["by"], r1.drain["reason"]) == ("sre", "parity check")
        assert r1.breaker == "closed" and all(s.connected for s in r1.event_sources)
