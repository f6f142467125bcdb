"""``kvlb.v1.Admin`` (I/O): the admin API of :mod:`balancer.api.admin` (and
:mod:`~balancer.api.admin_explain`, :mod:`~balancer.api.admin_replicas`, :mod:`~balancer.api.console`)
over gRPC, through the same functions (policy changes are versioned and audited the same way,
whichever transport made them).

Behind ``auth.admin_token`` when it is set (:func:`balancer.api.grpc.calls.authorize`).
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import quote

import grpc

from balancer import strict_json
from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.admin import (
    ACTOR_HEADER,
    actor_of,
    change_policy,
    drain_note,
    drain_view,
    policy_choices,
    set_draining,
)
from balancer.api.admin_explain import explain_raw
from balancer.api.admin_replicas import replicas_in_steps
from balancer.api.console import run_whatif
from balancer.api.errors import ApiError
from balancer.api.grpc.calls import WEIGHTS_METADATA, Call, method_handler
from balancer.api.grpc.messages import (
    decision_message,
    dict_of,
    openai_call,
    policy_message,
    struct_of,
    value_of,
)
from balancer.api.grpc.replica_messages import kept_drain_message, replica_message
from balancer.service.state import ServiceState
from balancer.types import ReplicaId

ADMIN_SERVICE: str = pb.DESCRIPTOR.services_by_name["Admin"].full_name
REPLICAS_PER_STEP = 5
"""Replica messages ``ListReplicas`` builds and encodes in one go before it lets the event loop run
other work: five took 0.27 ms of CPU, encoding included (median, load 11 on a 2-core machine), so a
list of 100 replicas holds the loop for twenty short stretches after its views (made as many at a
time: :func:`~balancer.api.admin_replicas.replica_views_in_steps`), not one long one (h-grpclist, 2026-12-01:
ten, not encoded; h-listreplicas: five, each step's messages encoded in it)."""


async def replica_parts(views: list[dict[str, Any]]) -> list[bytes]:
    """``GET /admin/replicas``' replica views (already made: a list nothing else changes) as encoded
    ``ListReplicasResponse`` messages holding :data:`REPLICAS_PER_STEP` replicas each, made and
    encoded one at a time with the loop let run in between. Encoded messages of one type laid end
    to end are one message whose repeated fields hold them all in order (protobuf's merge), so the
    parts joined, after the answer's other fields, are the whole answer, and grpc has nothing left
    to encode in one go."""
    parts: list[bytes] = []
    for start in range(0, len(views), REPLICAS_PER_STEP):
        if start:
            await asyncio.sleep(0)
        chunk = pb.ListReplicasResponse()
        for view in views[start : start + REPLICAS_PER_STEP]:
            replica_message(view, chunk.replicas.add())
        parts.append(chunk.SerializeToString())
    return parts


KEPT_DRAINS_PER_STEP = 20
"""Kept drain messages ``ListReplicas`` builds and encodes in one go (up to 1,000 are listed, each
with its ``drain`` as a ``Struct``) before it lets the loop run other work (h-workersmerge)."""


async def kept_drain_parts(views: list[dict[str, Any]]) -> list[bytes]:
    """The kept drains' views as encoded ``ListReplicasResponse`` messages of
    :data:`KEPT_DRAINS_PER_STEP` each, the loop let run in between (laid end to end, one message
    whose ``kept_drains`` holds them all in order, as :func:`replica_parts`)."""
    parts: list[bytes] = []
    for start in range(0, len(views), KEPT_DRAINS_PER_STEP):
        if start:
            await asyncio.sleep(0)
        chunk = pb.ListReplicasResponse(
            kept_drains=[kept_drain_message(kept) for kept in views[start : start + KEPT_DRAINS_PER_STEP]]
        )
        parts.append(chunk.SerializeToString())
    return parts


class AdminService:
    """GetPolicy, SetPolicy, Explain, ListReplicas, DrainReplica, WhatIf."""

    def __init__(self, state: ServiceState) -> None:
        self.state = state

    async def get_policy(self, request: pb.GetPolicyRequest, call: Call) -> pb.Policy:
        return policy_message(self.state.policy.view, policy_choices())

    async def set_policy(self, request: pb.SetPolicyRequest, call: Call) -> pb.SetPolicyResponse:
        body: dict[str, Any] = {}
        if request.HasField("name"):
            body["name"] = request.name
        if request.HasField("weights"):
            body["weights"] = dict_of(request.weights, "weights")
        if request.HasField("reason"):
            body["reason"] = request.reason
        actor = actor_of(call.metadata.get(ACTOR_HEADER))
        view, changes = await change_policy(self.state, body, call.caller(), actor)
        if self.state.admin_fan_out is not None:  # the other workers of kvlb serve --workers N
            sent: dict[str, Any] = {"name": view.name, "weights": view.weights.to_dict()}
            if "reason" in body:
                sent["reason"] = body["reason"]
            data = strict_json.dumps(sent).encode("utf-8")
            await self.state.admin_fan_out("PUT", "/admin/policy", data, call.metadata.get(ACTOR_HEADER))
        changed = [
            pb.PolicyChange(field=name, old=value_of(old), new=value_of(new))
            for name, (old, new) in changes.items()
        ]
        return pb.SetPolicyResponse(policy=policy_message(view), changed=changed)

    async def explain(self, request: pb.ExplainRequest, call: Call) -> pb.ExplainResponse:
        if not request.HasField("request"):
            raise ApiError(400, "'request' is required")
        call.adopt_request_id(request.request.request_id)
        body = openai_call(request.request, stream=False).body
        explained = await explain_raw(self.state, body, call.metadata.get(WEIGHTS_METADATA), call.request_id)
        plan = explained.plan
        return pb.ExplainResponse(
            model=explained.model,
            kind=explained.kind,
            prompt_tokens=plan.prompt_tokens,
            cached_tokens=plan.cached_tokens,
            weights=struct_of(explained.weights.to_dict()),
            decision=decision_message(plan.decision),
            left_out=explained.left_out,
            sequences=plan.sequences,
            decode_blocks=plan.decode_blocks,
        )

    async def list_replicas(self, request: pb.ListReplicasRequest, call: Call) -> bytes:
        """The ``ListReplicasResponse`` already encoded (:func:`replica_parts`): its views and its
        messages made a few replicas at a time, the loop let run in between."""
        answer = await replicas_in_steps(self.state)
        if self.state.replicas_gather is not None:  # every worker's, as GET /admin/replicas
            answer = await self.state.replicas_gather(answer)
        head = pb.ListReplicasResponse(
            workers=answer.get("workers", ()),
            workers_missing=answer.get("workers_missing", ()),
            kept_drains_total=answer["kept_drains_total"],
        )
        kept = await kept_drain_parts(answer["kept_drains"])
        parts = await replica_parts(answer["replicas"])
        return b"".join([head.SerializeToString(), *kept, *parts])

    async def drain_replica(self, request: pb.DrainReplicaRequest, call: Call) -> pb.DrainReplicaResponse:
        if not request.replica_id:
            raise ApiError(400, "'replica_id' is required")
        draining = not request.undrain
        body = {"reason": request.reason} if request.HasField("reason") else {}
        note = drain_note(self.state, body, call.caller(), actor_of(call.metadata.get(ACTOR_HEADER)))
        await set_draining(self.state, ReplicaId(request.replica_id), draining, note)
        if self.state.admin_fan_out is not None:  # the other workers of kvlb serve --workers N
            action = "drain" if draining else "undrain"
            path = f"/admin/replicas/{quote(request.replica_id, safe='')}/{action}"
            data = strict_json.dumps(note.replayed()).encode("utf-8") if draining else b""
            await self.state.admin_fan_out("POST", path, data, call.metadata.get(ACTOR_HEADER))
        answer = pb.DrainReplicaResponse(replica_id=request.replica_id, draining=draining)
        if draining:
            answer.drain.CopyFrom(struct_of(drain_view(note, self.state.wall_clock())))
        return answer

    async def what_if(self, request: pb.WhatIfRequest, call: Call) -> pb.WhatIfResponse:
        body: dict[str, Any] = {}
        for name in ("pool", "policy", "last", "sample"):
            if request.HasField(name):
                body[name] = getattr(request, name)
        if request.HasField("weights"):
            body["weights"] = dict_of(request.weights, "weights")
        answer = await run_whatif(self.state, body)
        if self.state.whatif_gather is not None:  # the other workers of kvlb serve --workers N
            answer = await self.state.whatif_gather(strict_json.dumps(body).encode("utf-8"), answer)

        def side(data: dict[str, Any]) -> pb.WhatIfSide:
            return pb.WhatIfSide(
                predicted_cached_tokens=data["predicted_cached_tokens"],
                hit_rate=data["hit_rate"],
                load_spread=data["load_spread"],
            )

        return pb.WhatIfResponse(
            pool=answer["pool"],
            policy=answer["policy"],
            decisions=answer["decisions"],
            changed_share=answer["changed_share"],
            before=side(answer["before"]),
            after=side(answer["after"]),
            replicas=[
                pb.WhatIfShare(
                    replica=r["replica"],
                    before_share=r["before_share"],
                    after_share=r["after_share"],
                    delta_share=r["delta_share"],
                )
                for r in answer["replicas"]
            ],
            notes=answer["notes"],
            details=struct_of(answer),
        )


def admin_handlers(state: ServiceState) -> Any:
    """The generic handler of ``kvlb.v1.Admin`` for ``grpc.aio.Server.add_generic_rpc_handlers``."""
    service = AdminService(state)
    name = ADMIN_SERVICE
    methods: dict[str, tuple[Any, type[Any], type[Any]]] = {
        "GetPolicy": (service.get_policy, pb.GetPolicyRequest, pb.Policy),
        "SetPolicy": (service.set_policy, pb.SetPolicyRequest, pb.SetPolicyResponse),
        "Explain": (service.explain, pb.ExplainRequest, pb.ExplainResponse),
        "ListReplicas": (service.list_replicas, pb.ListReplicasRequest, pb.ListReplicasResponse),
        "DrainReplica": (service.drain_replica, pb.DrainReplicaRequest, pb.DrainReplicaResponse),
        "WhatIf": (service.what_if, pb.WhatIfRequest, pb.WhatIfResponse),
    }
    return grpc.method_handlers_generic_handler(
        name,
        {
            method: method_handler(state, f"/{name}/{method}", "admin", run, request, response)
            for method, (run, request, response) in methods.items()
        },
    )
