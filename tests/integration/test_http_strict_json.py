"""Every JSON answer of every HTTP endpoint is strict JSON, even with every weight at its upper bound
(issue #17, defect 4): parsed with a parser that refuses ``NaN`` and ``Infinity``. Weights out of
range are refused with a 400 naming the field and its range, on ``PUT /admin/policy`` and on
``x-kvlb-weights``; the gRPC admin refuses them as ``INVALID_ARGUMENT``."""

from __future__ import annotations

import json
from typing import Any

import grpc
from google.protobuf import struct_pb2
from grpc_harness import grpc_running
from kvlb_harness import MODEL, Answer, Harness, shared_deepseek, sse_payloads

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.openapi import openapi_document
from balancer.policy.base import WEIGHT_RANGES

TOP = {name: r.high for name, r in WEIGHT_RANGES.items()}
"""Every weight at its upper bound: the largest costs kvlb can compute."""
PROMPT = list(range(300, 340))


def _refuse(literal: str) -> Any:
    raise AssertionError(f"{literal} is not JSON")


def strict(body: bytes) -> Any:
    return json.loads(body, parse_constant=_refuse)


async def call(
    h: Harness, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> Answer:
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    async with h.session.request(method, h.url + path, data=data, headers=headers) as response:
        return Answer(response.status, response.headers.copy(), await response.read())


async def test_every_json_answer_is_strict_json_with_every_weight_at_its_bound() -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 30}], "max_tokens": 1}
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    top_header = {"x-kvlb-weights": json.dumps(TOP)}
    async with grpc_running(shared_deepseek(), auth__allow_weight_override=True) as g:
        h = g.http
        await h.warm(PROMPT)
        requests: list[tuple[str, str, Any, dict[str, str] | None, int]] = [
            ("PUT", "/admin/policy", {"weights": TOP}, None, 200),
            ("GET", "/admin/policy", None, None, 200),
            ("POST", "/admin/explain", chat, None, 200),
            ("POST", "/admin/explain", completion, top_header, 200),
            ("GET", "/admin/replicas", None, None, 200),
            ("GET", "/admin/fleet", None, None, 200),
            ("POST", "/admin/replicas/r0/drain", None, None, 200),
            ("POST", "/admin/replicas/r0/undrain", None, None, 200),
            ("POST", "/admin/replicas/nope/drain", None, None, 404),
            ("POST", "/admin/replicas/nope/undrain", None, None, 404),
            ("GET", "/admin/replicas/r0/blocks?limit=10", None, None, 200),
            ("GET", "/admin/replicas/nope/blocks", None, None, 404),
            ("GET", "/admin/replicas/r0/blocks?limit=-1", None, None, 400),
            ("GET", "/healthz", None, None, 200),
            ("GET", "/readyz", None, None, 200),
            ("GET", "/openapi.json", None, None, 200),
            ("POST", "/admin/whatif", {"weights": TOP, "sample": 100}, None, 200),
            ("POST", "/admin/whatif", {"policy": "least_load"}, None, 200),
            ("GET", "/admin/decisions?limit=1000", None, None, 200),
            ("GET", "/admin/decisions/1", None, None, 200),
            ("GET", "/admin/audit", None, None, 200),
            ("GET", "/admin/series?minutes=15", None, None, 200),
            ("GET", "/admin/series?minutes=nan", None, None, 400),
            ("GET", "/admin/series?minutes=0.1&minutes=false", None, None, 400),  # given twice
            ("GET", "/admin/audit?limit=1&limit=1", None, None, 400),
            ("GET", "/v1/models", None, None, 200),
            ("GET", f"/v1/models/{MODEL}", None, None, 200),
            ("GET", "/v1/models/nope", None, None, 404),
            ("POST", "/v1/completions", completion, top_header, 200),
            ("POST", "/v1/chat/completions", chat, None, 200),
            ("POST", "/v1/completions", {**completion, "stream": True}, None, 200),
            # errors are JSON too
            ("PUT", "/admin/policy", {"weights": {"prefill_weight": 1e308}}, None, 400),
            ("PUT", "/admin/policy", b'{"weights": {"temperature": Infinity}}', None, 400),
            ("PUT", "/admin/policy", b'{"weights": {"prefill_weight": 1%s}}' % (b"0" * 400), None, 400),
            (
                "POST",
                "/admin/explain",
                completion,
                {"x-kvlb-weights": '{"queue_weight": 1%s}' % ("0" * 400)},
                400,
            ),
            (
                "POST",
                "/v1/completions",
                b'{"model": "sim-test", "prompt": [1, 2], "temperature": NaN}',
                None,
                400,
            ),
            ("POST", "/v1/completions", {**completion, "prompt": "a\udfff"}, None, 400),
            ("POST", "/v1/completions", completion, {"x-kvlb-weights": '{"queue_weight": 1e7}'}, 400),
            ("POST", "/admin/explain", {"model": MODEL, "prompt": "x"}, {"x-kvlb-weights": "{"}, 400),
            ("GET", "/v1/nowhere", None, None, 404),
            ("DELETE", "/admin/policy", None, None, 405),
        ]
        seen: set[tuple[str, str]] = {("GET", "/metrics")}  # Prometheus text, not JSON
        seen.add(("GET", "/ui/"))  # HTML (tests/security/test_console_security.py); its 404 is JSON:
        requests.append(("GET", "/ui/nowhere.js", None, None, 404))
        for method, path, body, headers, status in requests:
            answer = await call(h, method, path, body, headers)
            where = f"{method} {path} {body!r:.80}"
            assert answer.status == status, f"{where}: {answer.status} {answer.body[:300]!r}"
            if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
                payloads = sse_payloads(answer.body)
                assert payloads, where
            else:
                document = strict(answer.body)
                if status >= 400:
                    assert document["error"]["code"] == status, where
            template = path.replace("/r0/", "/{replica}/").replace("/nope/", "/{replica}/")
            template = template.split("?")[0].replace("/decisions/1", "/decisions/{id}")
            for name in (MODEL, "nope"):
                template = template.replace(f"/v1/models/{name}", "/v1/models/{model}")
            seen.add((method, template))
        documented = {(m.upper(), p) for p, ops in openapi_document()["paths"].items() for m in ops}
        assert documented <= seen, f"endpoints not checked: {sorted(documented - seen)}"

        explained = strict((await call(h, "POST", "/admin/explain", completion, top_header)).body)
        costs = [t["cost"] for t in explained["decision"]["terms"]]
        assert all(isinstance(c, float) for c in costs), costs  # finite numbers, not nulls

        refused = await call(h, "PUT", "/admin/policy", {"weights": {"prefill_weight": 1e308}})
        message = strict(refused.body)["error"]["message"]
        assert "policy.prefill_weight must be in [0, 1000], got 1e+308" in message

        # the gRPC admin goes through the same check
        weights = struct_pb2.Struct()
        weights.update({"temperature": 1e300})
        try:
            await g.admin.SetPolicy(pb.SetPolicyRequest(weights=weights))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "policy.temperature must be in [0, 1000000]" in (exc.details() or "")
        else:
            raise AssertionError("SetPolicy accepted temperature 1e300")
