"""``kvlb.v1.Admin`` and gRPC auth over a real grpc.aio channel (emulated replicas)."""

from __future__ import annotations

import logging

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_harness import bearer, failure, grpc_running, token_request
from kvlb_harness import MODEL, shared_deepseek

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.tokenizer.tokenizer import Tokenizer

PREFIX = list(range(1000, 1032))
"""32 token ids: 8 full blocks of the emulator's 4-token pages."""
ADMIN = bearer("root")


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def weights(**values: float | None) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(values)
    return struct


async def test_set_policy_changes_decisions_at_once_and_http_sees_the_same_version(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="balancer.api.admin")
    async with grpc_running(tokenizer, auth__admin_token="root") as g:
        holder = await g.http.warm(PREFIX)

        async def routed(count: int, reserve: bool = False) -> list[str]:
            requests = [
                pb.RouteRequest(request=token_request([*PREFIX, i]), reserve=reserve) for i in range(count)
            ]
            answers = [await g.balancer.Route(r) for r in requests]
            for answer in answers if reserve else ():
                await g.balancer.Release(pb.ReleaseRequest(request_id=answer.request_id))
            return [answer.replica_id for answer in answers]

        assert await routed(3) == [holder] * 3
        answer = await g.admin.SetPolicy(pb.SetPolicyRequest(name="round_robin"), metadata=ADMIN)
        assert answer.policy.name == "round_robin" and answer.policy.version == 2
        assert [(c.field, c.old.string_value, c.new.string_value) for c in answer.changed] == [
            ("name", "cost", "round_robin")
        ]
        audit = [r.getMessage() for r in caplog.records if r.name == "balancer.api.admin"]
        assert len(audit) == 1 and audit[0].startswith("policy v2 set by token:")
        assert len(set(await routed(4))) == 1  # a Route without reserve commits nothing: no rotation
        assert sorted(set(await routed(4, reserve=True))) == ["r0", "r1"]  # committed: it rotates
        http_view = await g.http.admin("GET", "/admin/policy")
        assert http_view["version"] == 2 and http_view["name"] == "round_robin"
        assert http_view["updated_by"] == answer.policy.updated_by

        change = pb.SetPolicyRequest(name="cost", weights=weights(overlap_credit=0.25, kv_usage_ceiling=0.9))
        answer = await g.admin.SetPolicy(change, metadata=ADMIN)
        assert answer.policy.version == 3 and answer.policy.weights["overlap_credit"] == 0.25
        assert {c.field for c in answer.changed} == {"name", "overlap_credit", "kv_usage_ceiling"}
        assert (await g.http.admin("GET", "/admin/policy"))["weights"]["kv_usage_ceiling"] == 0.9
        explained = await g.admin.Explain(
            pb.ExplainRequest(request=token_request([*PREFIX, 5])), metadata=ADMIN
        )
        terms = {t.replica: t for t in explained.decision.terms}
        # prefill = pending + request_blocks - credit * overlap = 0 + 8 - 0.25 * 8 on the holder.
        assert terms[holder].prefill_term == pytest.approx(6.0)
        assert explained.kind == "completions" and explained.prompt_tokens == 33

        refused = await failure(
            g.admin.SetPolicy(pb.SetPolicyRequest(weights=weights(overlap_credit=5)), metadata=ADMIN)
        )
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlap_credit" in refused.details()
        unknown = await failure(g.admin.SetPolicy(pb.SetPolicyRequest(name="nope"), metadata=ADMIN))
        assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in unknown.details()
        assert (await g.admin.GetPolicy(pb.GetPolicyRequest(), metadata=ADMIN)).version == 3


async def test_list_and_drain_replicas(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, auth__admin_token="root") as g:
        listed = await g.admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)
        assert [(r.id, r.routable, r.draining, r.block_size) for r in listed.replicas] == [
            ("r0", True, False, 4),
            ("r1", True, False, 4),
        ]
        http_views = (await g.http.admin("GET", "/admin/replicas"))["replicas"]
        assert listed.replicas[0].details["url"] == http_views[0]["url"] == listed.replicas[0].url
        assert listed.replicas[0].details["health"]["breaker"] == http_views[0]["health"]["breaker"]

        drain = pb.DrainReplicaRequest(replica_id="r0", reason="node maintenance")
        drained = await g.admin.DrainReplica(drain, metadata=(*ADMIN, ("x-kvlb-actor", "alice")))
        health = (await g.http.replica_view("r0"))["health"]
        assert drained.draining and health["draining"] is True
        assert (health["drain"]["by"], health["drain"]["reason"]) == ("alice", "node maintenance")
        listed = await g.admin.ListReplicas(pb.ListReplicasRequest(), metadata=ADMIN)
        assert listed.replicas[0].details["health"]["drain"]["reason"] == "node maintenance"
        too_long = pb.DrainReplicaRequest(replica_id="r1", reason="x" * 501)
        refused = await failure(g.admin.DrainReplica(too_long, metadata=ADMIN))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "'reason'" in refused.details()
        assert (await g.http.replica_view("r1"))["health"]["draining"] is False
        for i in range(3):
            routed = await g.balancer.Route(pb.RouteRequest(request=token_request([*PREFIX, i])))
            assert routed.replica_id == "r1"
        # The HTTP twins' answers: the drain's note, and explain's left_out saying why r0 has no terms.
        assert (drained.drain["by"], drained.drain["reason"]) == ("alice", "node maintenance")
        assert drained.drain["caller"] == health["drain"]["caller"]
        explained = await g.admin.Explain(pb.ExplainRequest(request=token_request(PREFIX)), metadata=ADMIN)
        explained_http = await g.http.admin("POST", "/admin/explain", {"model": MODEL, "prompt": PREFIX})
        assert [t.replica for t in explained.decision.terms] == ["r1"]
        assert dict(explained.left_out) == explained_http["left_out"] == {"r0": "draining"}
        undrain = pb.DrainReplicaRequest(replica_id="r0", undrain=True)
        undrained = await g.admin.DrainReplica(undrain, metadata=ADMIN)
        assert not undrained.draining and not undrained.HasField("drain")
        explained = await g.admin.Explain(pb.ExplainRequest(request=token_request(PREFIX)), metadata=ADMIN)
        assert len(explained.decision.terms) == 2 and not explained.left_out
        missing = await failure(g.admin.DrainReplica(pb.DrainReplicaRequest(replica_id="r9"), metadata=ADMIN))
        assert missing.code() == grpc.StatusCode.NOT_FOUND and "r0, r1" in missing.details()


async def test_api_keys_and_the_admin_token_guard_their_services(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, 1, auth__api_keys=["sk-one"], auth__admin_token="root") as g:
        route = pb.RouteRequest(request=token_request(PREFIX))
        for metadata in ((), bearer("sk-wrong"), (("authorization", "sk-one"),), ADMIN):
            error = await failure(g.balancer.Route(route, metadata=metadata))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "Bearer <key>" in error.details() and "sk-one" not in error.details()
        generate = g.balancer.Generate(token_request(PREFIX))
        assert (await failure(generate.read())).code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await g.balancer.Route(route, metadata=bearer("sk-one"))).replica_id == "r0"

        get = pb.GetPolicyRequest()
        for metadata in ((), bearer("nope")):
            error = await failure(g.admin.GetPolicy(get, metadata=metadata))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "admin token" in error.details()
        denied = await failure(g.admin.GetPolicy(get, metadata=bearer("sk-one")))
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await g.admin.GetPolicy(get, metadata=ADMIN)).version == 1
        # Per-call weights are refused unless auth.allow_weight_override; Explain (admin) takes them.
        overridden = (*bearer("sk-one"), ("x-kvlb-weights", '{"overlap_credit": 0.5}'))
        error = await failure(g.balancer.Route(route, metadata=overridden))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "x-kvlb-weights" in error.details()
        explain = pb.ExplainRequest(request=token_request(PREFIX))
        tried = (*ADMIN, ("x-kvlb-weights", '{"overlap_credit": 0.5}'))
        assert (await g.admin.Explain(explain, metadata=tried)).weights["overlap_credit"] == 0.5


async def test_what_if_and_an_audited_set_policy(tokenizer: Tokenizer) -> None:
    async with grpc_running(tokenizer, auth__admin_token="root") as g:
        await g.http.warm(PREFIX)
        for i in range(6):
            await g.balancer.Route(pb.RouteRequest(request=token_request([*PREFIX, i]), reserve=True))
        same = await g.admin.WhatIf(pb.WhatIfRequest(), metadata=ADMIN)
        assert same.decisions == 7 and same.changed_share == 0.0  # the warm-up and 6 reserved Routes
        assert same.before == same.after and {r.replica for r in same.replicas} == {"r0", "r1"}
        assert same.details["changed_share"] == 0.0 and len(same.notes) >= 1
        cold = await g.admin.WhatIf(
            pb.WhatIfRequest(weights=weights(overlap_credit=0.0), last=4, sample=2), metadata=ADMIN
        )
        assert cold.decisions == 4
        assert cold.after.predicted_cached_tokens <= cold.before.predicted_cached_tokens
        bad = await failure(
            g.admin.WhatIf(pb.WhatIfRequest(weights=weights(overlap_credit=9.0)), metadata=ADMIN)
        )
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "overlap_credit" in (bad.details() or "")
        bad = await failure(g.admin.WhatIf(pb.WhatIfRequest(policy="nope"), metadata=ADMIN))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        denied = await failure(g.admin.WhatIf(pb.WhatIfRequest()))
        assert denied.code() == grpc.StatusCode.UNAUTHENTICATED

        change = pb.SetPolicyRequest(weights=weights(decode_weight=0.3), reason="from gRPC")
        await g.admin.SetPolicy(change, metadata=(*ADMIN, ("x-kvlb-actor", "bob")))
        entries = (await g.http.admin("GET", "/admin/audit"))["entries"]
        assert [(e["actor"], e["reason"]) for e in entries] == [("bob", "from gRPC")]
        assert entries[0]["change"] == {"before": {"decode_weight": 0.1}, "after": {"decode_weight": 0.3}}
