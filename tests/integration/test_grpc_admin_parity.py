"""The gRPC admin answers carry the facts of their HTTP twins (``GET /admin/replicas``, ``GET
/admin/policy``, ``POST /admin/explain``), over a real balancer with its gRPC server and two emulated
vLLM engines: r0 serves another model name than its pool, r1 needs an API key and is drained. A
second rig types the rest (h-grpcfields): k0's vLLM refuses kvlb's key, s1's SGLang stops publishing
while it computes, holds a reserved request of ``n = 3``, then a queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
import zmq.asyncio
from google.protobuf import json_format
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


@dataclass(frozen=True)
class Engine:
    """One emulated engine of a rig and how the balancer lists it."""

    name: str
    kind: str = "vllm"
    faults: FaultSettings = field(default_factory=FaultSettings)
    key: str | None = None
    """The API key the engine asks for (``None``: none)."""
    key_env: str | None = None
    """The variable the balancer reads its key for the engine from (``None``: it sends none)."""


PARITY_ENGINES = (
    Engine("r0", faults=FaultSettings(served_model="llama-3")),
    Engine("r1", key=KEY, key_env="ENGINE_KEY"),
)


@asynccontextmanager
async def parity_rig(
    tmp_path: Path,
    specs: tuple[Engine, ...] = PARITY_ENGINES,
    env: dict[str, str] | None = None,
    **top: Any,
) -> AsyncIterator[tuple[Balancer, aiohttp.ClientSession, grpc.aio.Channel, list[Replica]]]:
    """``specs`` as in-process engines behind a real balancer with gRPC (admin token ``root``;
    ``env``: the balancer's environment, ``top``: more settings): the balancer, an HTTP session
    with the admin token, a gRPC channel to it, and the engines."""
    zctx = zmq.asyncio.Context()
    engines: list[Replica] = []
    balancer: Balancer | None = None
    try:
        entries = []
        for spec in specs:
            config = ReplicaConfig(
                name=spec.name,
                engine=spec.kind,
                profile=get_profile("cpu-test"),
                page_size=16,
                faults=spec.faults,
                api_key=spec.key,
                time_scale=20.0,
            )
            engine = Replica(config, TokenIdTokenizer(), zctx)
            await engine.start()
            engines.append(engine)
            entry = replica_entry(engine)
            entries.append(entry if spec.key_env is None else {**entry, "api_key_env": spec.key_env})
        tree = {
            "listen": {"host": "127.0.0.1", "port": 0, "grpc_port": 0},
            "auth": {"admin_token": "root"},
            "pools": [{"model": MODEL, "replicas": entries}],
            "health_interval_s": 0.2,
            **top,
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(tree), encoding="utf-8")
        settings = load(path, env={"ENGINE_KEY": KEY} if env is None else env)
        balancer = Balancer(settings, tokenizers={MODEL: TokenIdTokenizer()})
        await balancer.start()
        headers = {"Authorization": "Bearer root"}
        async with aiohttp.ClientSession(headers=headers) as session:
            await wait_ready(session, balancer.url)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{balancer.grpc_port}") as channel:
                yield balancer, session, channel, engines
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
    async with parity_rig(tmp_path) as (balancer, session, channel, _):
        admin = pb_grpc.AdminStub(channel)
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


WRONG = "sk-engine-wrong-77d1"
BOUND_S = 1.0
"""``events_stalled_hint_s`` of the second rig (the default is 30 s)."""
WAIT_S = 20.0
NEW_TYPED = {
    "key_refused": ("health", "key_refused"),
    "events_stalled_s": ("events", "stalled_s"),
    "probe_ok": ("health", "probe_ok"),
    "consecutive_failures": ("health", "consecutive_failures"),
    "events_last_lag_s": ("events", "last_lag_s"),
    "events_last_resync_age_s": ("events", "last_resync_age_s"),
}
"""``Replica`` fields typed on 2026-12-01 (h-grpcfields) -> where ``GET /admin/replicas`` shows them."""
SUBMESSAGES = {"load": "load", "prediction": "prediction", "scrape": "scrape"}
"""``Replica`` message fields -> the HTTP view's object each types (field by field, same names)."""
AGE_TOLERANCE_S = 2.0
"""How far a time-dependent field (``*_age_s``, ``stalled_s``) may move between the HTTP and the gRPC
call of one comparison (seconds)."""
QUEUE = ("pending_prefill_seqs", "running_reqs", "waiting_reqs")
"""kvlb's sequences not at their first token, the engine's running and waiting requests (scraped)."""


def queued(load: dict[str, Any]) -> bool:
    """The 6 held requests are kvlb's load and the engine's, some of them in its queue (the engine
    admits what its 256-token KV pool takes)."""
    pending, running, waiting = (load[k] for k in QUEUE)
    return pending == 6 and waiting is not None and waiting > 0 and running + waiting == 6


AGES = frozenset({"events_stalled_s", "events_last_resync_age_s", "stats_age_s", "last_ok_age_s"})
"""Times that grow between the HTTP and the gRPC call of one comparison."""
COUNTERS = frozenset({"consecutive_failures", "scrapes", "errors"})
"""Counts that may grow between them (a probe or a scrape every 0.2 s; gRPC is asked second)."""


def same(name: str, got: object, want: object) -> bool:
    """``got`` (gRPC, asked second) is HTTP's ``want``: equal; a time within
    :data:`AGE_TOLERANCE_S`; a counter not below it."""
    if isinstance(got, int | float) and isinstance(want, int | float):
        if name in AGES:
            return abs(got - want) <= AGE_TOLERANCE_S
        if name in COUNTERS:
            return want <= got <= want + 50
    return got == want


def assert_typed_as_http(replica: Any, view: dict[str, Any]) -> None:
    """Every field typed on 2026-12-01 says what HTTP's ``view`` and gRPC's own ``details`` say
    (``details`` is the same view as the typed fields: exactly; HTTP's, fetched apart: :func:`same`)."""
    details = json_format.MessageToDict(replica.details)
    for name, path in NEW_TYPED.items():
        got = typed(replica, name)
        assert got == at(details, path), (replica.id, name, details)
        assert same(name, got, at(view, path)), (replica.id, name, got, view)
    for name, key in SUBMESSAGES.items():
        want, own = view.get(key), details.get(key)
        if want is None:
            assert not replica.HasField(name) and own is None, (replica.id, name)
            continue
        message = getattr(replica, name)
        names = list(message.DESCRIPTOR.fields_by_name)
        assert set(names) <= set(want), (name, names, want)  # typed from HTTP's names
        for field_name in names:
            got = typed(message, field_name)
            assert got == own[field_name], (replica.id, name, field_name, own)
            assert same(field_name, got, want[field_name]), (replica.id, name, field_name, got, want)
    assert set(replica.load.DESCRIPTOR.fields_by_name) == set(view["load"]) - {"replica"}  # all of it
    assert set(replica.prediction.DESCRIPTOR.fields_by_name) == set(view["prediction"])


async def views(session: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    answer = await http_json(session, "GET", url + "/admin/replicas")
    return {view["id"]: view for view in answer["replicas"]}


async def until(
    session: aiohttp.ClientSession, url: str, ready: Callable[[dict[str, dict[str, Any]]], bool]
) -> None:
    """Polls ``GET /admin/replicas`` until ``ready`` of its views (by id), within :data:`WAIT_S`."""
    seen: dict[str, dict[str, Any]] = {}
    try:
        async with asyncio.timeout(WAIT_S):
            while not ready(seen := await views(session, url)):  # noqa: ASYNC110 - polls the balancer
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s; the last views: {seen}") from None


async def complete(session: aiohttp.ClientSession, url: str, tag: int, count: int) -> list[str]:
    """``count`` completions of prompts no engine holds (new blocks computed); the replicas that served."""
    served = []
    for i in range(count):
        prompt = [1000 + tag * 100 + i, *range(2000 + tag * 64 + i * 7, 2000 + tag * 64 + i * 7 + 63)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            served.append(response.headers["x-kvlb-replica"])
    return served


async def test_grpc_types_the_key_refusal_the_stalled_publisher_and_the_load(tmp_path: Path) -> None:
    """k0's engine refuses kvlb's key; s1 published its blocks, then lost every batch for good while
    it computed new prompt blocks (a stalled publisher), and holds a reserved request of ``n = 3``.
    Until 2026-12-01 (h-grpcfields) gRPC ``ListReplicas`` said the refusal in ``unroutable`` only, had
    no ``stalled_s``, and the load, prediction and scrape only in ``details`` (numbers as doubles)."""
    specs = (Engine("k0", key=KEY, key_env="K0_KEY"), Engine("s1", kind="sglang"))
    top = {"events_stalled_hint_s": BOUND_S, "scrape_interval_s": 0.2}
    async with parity_rig(tmp_path, specs, env={"K0_KEY": WRONG}, **top) as rig:
        balancer, session, channel, engines = rig
        admin, router = pb_grpc.AdminStub(channel), pb_grpc.BalancerStub(channel)
        refused = "engine refuses kvlb's key (api_key_env K0_KEY)"
        await until(session, balancer.url, lambda v: v["k0"]["health"]["key_refused"] == refused)
        assert set(await complete(session, balancer.url, 0, 4)) == {"s1"}
        await until(  # s1 published what it computed
            session, balancer.url, lambda v: v["s1"]["events"]["sources"][0]["last_event_age_s"] is not None
        )
        faults = {"drop_events": 1.0, "replay_dropped": False}
        async with session.post(engines[1].url + "/admin/faults", json=faults) as response:
            assert response.status == 200, await response.text()
        async with asyncio.timeout(WAIT_S):  # due within 1.25 x the bound of the first computed request
            tag = 0
            while (await views(session, balancer.url))["s1"]["events"]["stalled_s"] is None:
                tag += 1
                await complete(session, balancer.url, tag, 2)
                await asyncio.sleep(0.2)

        request = pb.GenerateRequest(
            model=MODEL,
            prompt_token_ids=pb.TokenIds(ids=range(5000, 5100)),
            max_tokens=5,
            extra_json='{"n": 3}',
        )
        routed = await router.Route(pb.RouteRequest(request=request, reserve=True))
        assert routed.replica_id == "s1" and routed.reserved
        http_views = await views(session, balancer.url)
        listed = {
            r.id: r for r in (await admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)).replicas
        }
        assert sorted(listed) == ["k0", "s1"]
        for replica_id, replica in listed.items():
            assert_typed_as_http(replica, http_views[replica_id])

        k0, s1 = listed["k0"], listed["s1"]
        assert k0.key_refused == refused == k0.unroutable and k0.probe_ok and WRONG not in str(k0)
        assert not s1.HasField("key_refused") and not k0.HasField("events_stalled_s")
        assert s1.events_stalled_s >= BOUND_S and s1.events_hint.startswith("no KV event batch for ")
        assert (s1.load.pending_prefill_seqs, s1.inflight) == (3, 3)  # the reservation: n = 3 sequences
        assert s1.load.pending_prefill_tokens == routed.prompt_tokens - routed.predicted_cached_tokens > 0
        assert s1.load.HasField("waiting_reqs") and s1.load.HasField("stats_age_s")  # scraped
        assert k0.load.pending_prefill_seqs == 0 and k0.prediction.receipts == 0
        assert not k0.prediction.HasField("accuracy")
        assert s1.prediction.receipts >= 6 and s1.prediction.HasField("accuracy")
        assert s1.scrape.scrapes > 0 and s1.scrape.url.startswith(engines[1].url)

        await router.Release(pb.ReleaseRequest(request_id=routed.request_id))
        listed = {
            r.id: r for r in (await admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)).replicas
        }
        assert (listed["s1"].load.pending_prefill_seqs, listed["s1"].inflight) == (0, 0)

        # the engine's queue: s1 so slow that no step ends, 6 requests more than its KV pool takes
        async with session.post(engines[1].url + "/admin/faults", json={"slowdown": 1e6}) as response:
            assert response.status == 200, await response.text()
        held = [asyncio.create_task(complete(session, balancer.url, 90 + i, 1)) for i in range(6)]
        try:
            await until(session, balancer.url, lambda v: queued(v["s1"]["load"]))
            http_views = await views(session, balancer.url)
            listed = {
                r.id: r for r in (await admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)).replicas
            }
            for replica_id, replica in listed.items():
                assert_typed_as_http(replica, http_views[replica_id])
            load = listed["s1"].load
            assert queued({k: getattr(load, k) for k in QUEUE}), load
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
