"""The admin API's dry run (I/O): ``POST /admin/explain``, the decision a request would get now.

Behind ``auth.admin_token`` like every ``/admin`` path (the middleware). The body of a chat or
completions request (``messages`` decides which); returns the full decision with every replica's
cost terms. Nothing is committed. The ``x-kvlb-weights`` header is honoured here whatever
``auth.allow_weight_override`` says.

:func:`explain_raw` does the work without aiohttp, so the gRPC admin service
(:mod:`balancer.api.grpc.admin`) calls the same code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from balancer import strict_json
from balancer.api.middleware import REQUEST_ID, STATE
from balancer.api.openai import WEIGHTS_HEADER, find_pool, read_body, tokenize
from balancer.api.parsing import (
    NO_QUERY,
    RequestKind,
    check_query,
    parse_json_object,
    parse_request,
    parse_weights_header,
)
from balancer.policy import PolicyWeights
from balancer.routing.left_out import left_out_names
from balancer.routing.router import RoutePlan
from balancer.service.dispatch import Forward, select
from balancer.service.state import ServiceState


@dataclass(frozen=True, slots=True)
class Explained:
    """The decision a request would get now, and what it was computed with."""

    model: str
    kind: RequestKind
    weights: PolicyWeights
    plan: RoutePlan
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    """The pool's replicas that were not candidates, and why (``draining``, ``failing health
    probes``, ``breaker open``, ``breaker trial in flight``, or ``full``: at
    ``limits.max_inflight_per_replica``), as the router's selection found them
    (:attr:`RoutePlan.left_out <balancer.routing.router.RoutePlan.left_out>`): they have no row in
    the terms."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "kind": self.kind,
            "prompt_tokens": self.plan.prompt_tokens,
            "cached_tokens": self.plan.cached_tokens,
            "sequences": self.plan.sequences,
            "decode_blocks": self.plan.decode_blocks,
            "weights": self.weights.to_dict(),
            "decision": dataclasses.asdict(self.plan.decision),
            "left_out": self.left_out,
        }


async def explain(request: web.Request) -> web.Response:
    """Dry-run routing of a request body: the decision and all its terms, without committing."""
    check_query(request.query, NO_QUERY)
    state = request.app[STATE]
    limits = state.settings.limits
    raw = await read_body(request, limits.max_body_bytes, state.settings.timeouts)
    explained = await explain_raw(state, raw, request.headers.get(WEIGHTS_HEADER), request[REQUEST_ID])
    return web.json_response(explained.to_json(), dumps=strict_json.dumps)


async def explain_raw(
    state: ServiceState, raw: bytes, weights_header: str | None, request_id: str
) -> Explained:
    """Dry-run routing of a chat or completions body (``messages`` decides which); commits nothing.
    ``weights_header`` is an ``x-kvlb-weights`` value laid over the policy's weights."""
    kind: RequestKind = "chat" if "messages" in parse_json_object(raw) else "completions"
    parsed = parse_request(raw, kind)
    pool = find_pool(state, parsed.model)
    weights = state.policy.view.weights
    if weights_header is not None:
        weights = parse_weights_header(weights_header, weights)
    token_ids = await tokenize(pool, parsed, state.settings.limits.max_prompt_tokens)
    job = Forward(
        pool,
        token_ids,
        weights,
        parsed.session_key,
        parsed.max_tokens,
        raw,
        "",
        request_id,
        0.0,
        sequences=parsed.sequences,
    )
    plan = select(state, job)
    return Explained(pool.model, kind, weights, plan, left_out_names(plan.left_out))
