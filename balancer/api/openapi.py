"""The OpenAPI 3.1 description served at ``/openapi.json`` (pure: builds a dict).

Request and response bodies of the OpenAI endpoints are the engines' own (kvlb forwards them
untouched), so only the fields kvlb reads are described.
"""

from __future__ import annotations

import copy
from typing import Any

from balancer import __version__

_ERROR = {"$ref": "#/components/schemas/Error"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {
        400: "Malformed body or headers, or a query parameter the endpoint does not take or given twice"
        " (the message names it)",
        401: "Missing or wrong bearer token",
        403: "x-kvlb-weights sent while auth.allow_weight_override is off (/v1/*); on /admin/*, a client"
        " API key (authenticated, not the admin token), or a write whose Origin names another origin"
        " than the server's Host",
        404: "Unknown model (the message lists the known ones), replica, pool or decision",
        408: "Body not received within timeouts.body_read_s, or behind timeouts.body_min_rate_bytes_per_s",
        413: "Body over limits.max_body_bytes (with Expect: 100-continue, instead of the 100)",
        417: "An Expect other than 100-continue",
        429: "Over limits.max_inflight, the bodies held at limits.max_inflight_body_bytes or every replica"
        " at limits.max_inflight_per_replica with the admission queue full, the tenant's caps, the"
        " tenant over limits.tenant_rate_per_s (answered before the body is read), or too many what-if"
        " replays at once (Retry-After)",
        502: "Replicas failed before answering (after retries)",
        503: "No healthy replica, every replica tried answered 503, or waited limits.queue_timeout_s in the"
        " admission queue (Retry-After)",
        504: "A non-streaming answer not received within timeouts.total_s",
    }
    return {str(code): _json(_ERROR, text[code]) for code in codes}


_ROUTED_HEADERS = {
    "x-request-id": {
        "description": "The client's request id or a generated one",
        "schema": {"type": "string"},
    },
    "x-kvlb-replica": {"description": "The replica that served the request", "schema": {"type": "string"}},
    "x-kvlb-cached-tokens": {
        "description": "Prompt tokens predicted to be cached on that replica",
        "schema": {"type": "integer"},
    },
}

_GENERATE = {
    "parameters": [
        {"name": "x-request-id", "in": "header", "required": False, "schema": {"type": "string"}},
        {
            "name": "x-kvlb-weights",
            "in": "header",
            "required": False,
            "description": "JSON object of policy weight overrides (needs auth.allow_weight_override)",
            "schema": {"type": "string"},
        },
        {
            "name": "x-kvlb-tenant",
            "in": "header",
            "required": False,
            "description": "The request's tenant for admission's turns and per-tenant limits (first 128"
            " characters; the header's name is the setting tenant_header)",
            "schema": {"type": "string"},
        },
    ],
    "responses": {
        "200": {
            "description": "The replica's answer, relayed as is (JSON, or SSE when stream is true). A "
            'replica failing mid-stream ends the SSE stream with a `data: {"error": ...}` event.',
            "headers": _ROUTED_HEADERS,
        },
        **_errors(400, 401, 403, 404, 408, 413, 417, 429, 502, 503, 504),
    },
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_COMMON_FIELDS: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "A pool's model (404 lists the known ones)"},
    "stream": {"type": ["boolean", "null"], "description": "null: false"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
    "user": {"type": ["string", "null"], "description": "Session key of the session policy"},
    "n": {
        "type": ["integer", "null"],
        "minimum": 1,
        "description": "Sequences to generate (null: 1); the decode load counts n × max_tokens",
    },
}
_COMPLETION_BODY: dict[str, Any] = {
    "type": "object",
    "description": "Only the fields kvlb reads are described; the rest goes to the replica untouched.",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON_FIELDS,
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                {
                    "type": "array",
                    "description": "A batch of one prompt (a longer batch is a 400)",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "oneOf": [
                            {"type": "string"},
                            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                        ]
                    },
                },
            ]
        },
    },
}
_CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "description": "Only the fields kvlb reads are described; the rest goes to the replica untouched.",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON_FIELDS,
        "messages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["role"],
                "properties": {"role": {"type": "string"}, "content": {"type": ["string", "array", "null"]}},
            },
        },
        "tools": {
            "type": "array",
            "items": {"type": "object"},
            "description": "Rendered by the chat template",
        },
        "add_generation_prompt": {"type": "boolean"},
        "chat_template_kwargs": {
            "type": "object",
            "description": "More variables of the chat template (not messages, tools, add_generation_prompt)",
        },
    },
}


def openapi_document() -> dict[str, Any]:
    """The whole document (a fresh deep copy each call)."""
    return copy.deepcopy(
        {
            "openapi": "3.1.0",
            "info": {
                "title": "kvlb",
                "version": __version__,
                "description": "KV-cache-aware LLM load balancer",
            },
            "components": _COMPONENTS,
            "paths": {**_public_paths(), **_with_admin_403(_admin_paths())},
        }
    )


_COMPONENTS: dict[str, Any] = {
    "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
    "schemas": {
        "Error": {
            "type": "object",
            "properties": {
                "error": {
                    "type": "object",
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": "null"},
                        "code": {"type": "integer"},
                    },
                }
            },
        },
        "Policy": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "weights": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
                "version": {"type": "integer"},
                "updated_by": {"type": "string"},
                "updated_at": {"type": "number"},
                "policies": {"type": "array", "items": {"type": "string"}},
                "ranges": {
                    "type": "object",
                    "description": "Every weight's documented range (GET only)",
                    "additionalProperties": {
                        "type": "object",
                        "properties": {
                            "low": {"type": "number"},
                            "high": {"type": "number"},
                            "low_open": {"type": "boolean"},
                            "nullable": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def _public_paths() -> dict[str, Any]:
    ok = _json({"type": "object"}, "OK")
    bearer: dict[str, Any] = {"security": [{"bearer": []}]}
    return {
        "/v1/chat/completions": {
            "post": {
                "summary": "Chat completion (needs model, messages)",
                "requestBody": _body(_CHAT_BODY),
                **_GENERATE,
                **bearer,
            }
        },
        "/v1/completions": {
            "post": {
                "summary": "Completion (needs model, prompt: text or token ids)",
                "requestBody": _body(_COMPLETION_BODY),
                **_GENERATE,
                **bearer,
            }
        },
        "/v1/models": {
            "get": {
                "summary": "Models served (one per pool)",
                "responses": {"200": ok, **_errors(401)},
                **bearer,
            }
        },
        "/v1/models/{model}": {
            "get": {
                "summary": "One pool's model (its name may hold '/'); 404 lists the known ones",
                "parameters": [
                    {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {"200": ok, **_errors(401, 404)},
                **bearer,
            }
        },
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": ok}}},
        "/readyz": {
            "get": {
                "summary": "Readiness: every pool has a healthy replica and event sources run",
                "responses": {"200": ok, "503": _json({"type": "object"}, "Not ready, with reasons")},
            }
        },
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text"}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": ok}}},
        "/ui/": {
            "get": {
                "summary": "The web console (static; its data comes from /admin/* with the admin token)",
                "responses": {"200": {"description": "HTML, with a Content-Security-Policy"}},
            }
        },
    }


def _with_admin_403(paths: dict[str, Any]) -> dict[str, Any]:
    """Every admin operation may answer 403: a client API key is authenticated but not allowed there."""
    for operations in paths.values():
        for operation in operations.values():
            operation["responses"].setdefault("403", _errors(403)["403"])
    return paths


def _admin_paths() -> dict[str, Any]:
    ok = _json({"type": "object"}, "OK")
    admin: dict[str, Any] = {"security": [{"bearer": []}]}
    return {
        "/admin/policy": {
            "get": {
                "summary": "Policy in force",
                **admin,
                "responses": {"200": _json(_POLICY, "Policy"), **_errors(400, 401)},
            },
            "put": {
                "summary": "Change policy name and/or weights (applied at once, version + 1; with Redis,"
                " 503 when the fleet could not store it, and then applied nowhere)",
                **admin,
                "parameters": [_ACTOR],
                "requestBody": _body(_POLICY_CHANGE),
                "responses": {
                    "200": _json(_POLICY_CHANGED, "Policy after the change, and what changed"),
                    **_errors(400, 401, 403, 408, 413, 417, 503),
                },
            },
        },
        "/admin/explain": {
            "post": {
                "summary": "Dry-run routing of a request body: the decision with every cost term",
                **admin,
                "parameters": [
                    {
                        "name": "x-kvlb-weights",
                        "in": "header",
                        "required": False,
                        "description": "JSON object of policy weights to try (whatever"
                        " auth.allow_weight_override says)",
                        "schema": {"type": "string"},
                    }
                ],
                "requestBody": _body({"oneOf": [_CHAT_BODY, _COMPLETION_BODY]}),
                "responses": {"200": ok, **_errors(400, 401, 403, 404, 408, 413, 417, 429, 503)},
            }
        },
        "/admin/replicas": {
            "get": {
                "summary": "Health, load, index and event status per replica; kept_drains: the drains"
                " kept for replicas discovery removed (id, drain, removed_at_wall_ts, expires_at_wall_ts,"
                " source, text; newest 1,000) and kept_drains_total",
                **admin,
                "responses": {"200": ok, **_errors(400, 401)},
            }
        },
        "/admin/fleet": {
            "get": {
                "summary": "With Redis: fleet members, this balancer's leases and mirrors (else null)",
                **admin,
                "responses": {"200": ok, **_errors(400, 401)},
            }
        },
        "/admin/series": {
            "get": {
                "summary": "The console's time series per interval: requests per replica, predicted and "
                "reported hit rate, TTFT p50/p90 from a log-bucket histogram, within 4.8% (kvlb serve"
                " --workers N: every worker's, summed, the histograms too)",
                **admin,
                "parameters": [
                    {
                        "name": "minutes",
                        "in": "query",
                        "required": False,
                        "description": "How far back, in decimal digits as 10 or 0.5 (default 10; capped at"
                        " what the ring holds)",
                        "schema": {"type": "number", "exclusiveMinimum": 0},
                    },
                    {
                        "name": "ttft_histograms",
                        "in": "query",
                        "required": False,
                        "description": "1: each interval also lists its ttft_histogram (the counts its TTFT"
                        " percentiles come from, which add across workers); 0 (default): without",
                        "schema": {"type": "integer", "enum": [0, 1]},
                    },
                ],
                "responses": {"200": ok, **_errors(400, 401)},
            }
        },
        "/admin/replicas/{replica}/blocks": {
            "get": {
                "summary": "The block keys the index holds for one replica, per DP rank (confirmed blocks"
                " only), as 16 hex digits; a rank holding more than limit says truncated",
                **admin,
                "parameters": [
                    {"name": "replica", "in": "path", "required": True, "schema": {"type": "string"}},
                    {
                        "name": "limit",
                        "in": "query",
                        "required": False,
                        "description": "Most keys per rank, 0..10000 (default 1000)",
                        "schema": {"type": "string", "pattern": "^[0-9]{1,5}$"},
                    },
                ],
                "responses": {"200": ok, **_errors(400, 401, 404)},
            }
        },
        "/admin/replicas/{replica}/drain": {
            "post": {"summary": "Stop routing new requests to a replica", **admin, **_REPLICA}
        },
        "/admin/replicas/{replica}/undrain": {
            "post": {"summary": "Route to a drained replica again", **admin, **_REPLICA}
        },
        **_console_paths(admin),
    }


def _console_paths(admin: dict[str, Any]) -> dict[str, Any]:
    """The console's paths (:mod:`balancer.api.console`, ``PUT /admin/policy``'s audit)."""
    # Query values are strings: as integers, a negative case "452" (a string where an integer is
    # expected) would reach the server as the same bytes as a valid 452.
    query_int = {"type": "string", "pattern": "^[0-9]{1,4}$", "description": "1..1000"}
    return {
        "/admin/whatif": {
            "post": {
                "summary": "Replay the pool's recent decisions with proposed weights or another policy "
                "(commits nothing): changed share, predicted hit rate and load spread before and after "
                "(kvlb serve --workers N: every worker's replay, summed)",
                **admin,
                "requestBody": _body(_WHATIF),
                "responses": {
                    "200": _json(_WHATIF_ANSWER, "The replay's figures"),
                    **_errors(400, 401, 403, 404, 408, 413, 417, 429),
                },
            }
        },
        "/admin/decisions": {
            "get": {
                "summary": "Recent committed decisions with their cost terms, newest first "
                "(kvlb serve --workers N: every worker's, each with its worker)",
                **admin,
                "parameters": [
                    {"name": "pool", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "replica", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"}},
                    {
                        "name": "since_id",
                        "in": "query",
                        "required": False,
                        "description": "decisions after this id; or one id per worker, comma-separated "
                        "(the answer's next_since_id, to poll with)",
                        "schema": {"type": "string", "pattern": "^[0-9]{1,18}(,[0-9]{1,18}){0,1023}$"},
                    },
                    {"name": "limit", "in": "query", "required": False, "schema": query_int},
                ],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "properties": {
                                "decisions": {"type": "array", "items": {"type": "object"}},
                                "next_since_id": {"type": "string"},
                            },
                        },
                        "Decisions",
                    ),
                    **_errors(400, 401, 404),
                },
            }
        },
        "/admin/decisions/{id}": {
            "get": {
                "summary": "One recorded decision: its explanation (as /admin/explain) and its inputs",
                **admin,
                "parameters": [
                    {
                        "name": "id",
                        "in": "path",
                        "required": True,
                        "description": "In decimal digits",
                        "schema": {"type": "integer"},
                    }
                ],
                "responses": {"200": _json({"type": "object"}, "The decision"), **_errors(400, 401, 404)},
            }
        },
        "/admin/audit": {
            "get": {
                "summary": "Policy changes, newest first: when, who (x-kvlb-actor), what, why "
                "(kvlb serve --workers N: every worker's, each version once)",
                **admin,
                "parameters": [{"name": "limit", "in": "query", "required": False, "schema": query_int}],
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "properties": {"entries": {"type": "array", "items": {"type": "object"}}},
                        },
                        "Audit entries",
                    ),
                    **_errors(400, 401),
                },
            }
        },
    }


_WHATIF: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "pool": {"type": ["string", "null"], "description": "A pool's model; null: the only pool"},
        "weights": {
            "type": ["object", "null"],
            "additionalProperties": {"type": ["number", "null"]},
            "description": "Weights laid over the ones in force (ranges of docs/policies.md)",
        },
        "policy": {"type": ["string", "null"], "description": "Policy to replay; null: the one in force"},
        "last": {"type": ["integer", "null"], "minimum": 1, "description": "Newest N decisions only"},
        "sample": {"type": ["integer", "null"], "minimum": 0, "maximum": 100},
    },
}
_WHATIF_SIDE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "predicted_cached_tokens": {"type": "integer"},
        "hit_rate": {"type": "number"},
        "load_spread": {"type": "number"},
    },
}
_WHATIF_ANSWER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "pool": {"type": "string"},
        "policy": {"type": "string", "description": "The policy replayed"},
        "weights": {
            "type": "object",
            "description": "The weights replayed (the proposed ones over those in force)",
        },
        "decisions": {"type": "integer"},
        "changed": {"type": "integer", "description": "Decisions that would go to another replica"},
        "changed_share": {"type": "number"},
        "before": _WHATIF_SIDE,
        "after": _WHATIF_SIDE,
        "replicas": {"type": "array", "items": {"type": "object"}},
        "sample": {"type": "array", "items": {"type": "object"}},
        "notes": {"type": "array", "items": {"type": "string"}},
        "tallies": {"type": "object", "description": "The counts the notes give"},
        "model": {
            "type": "object",
            "description": "What the replay's models did: load_moved (decisions whose load moved), "
            "load_moved_seqs (their sequences, each counting its n), "
            "evicted_marks (prefix marks evicted where the replay overfilled a replica's pool)",
        },
        "elapsed_s": {"type": "number"},
    },
}


_POLICY = {"$ref": "#/components/schemas/Policy"}
_POLICY_CHANGED = {
    "allOf": [
        _POLICY,
        {
            "type": "object",
            "properties": {
                "changed": {
                    "type": "object",
                    "description": "Each field changed, as [old, new]",
                    "additionalProperties": {"type": "array", "minItems": 2, "maxItems": 2},
                }
            },
        },
    ]
}
_POLICY_CHANGE = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {
            "type": ["string", "null"],
            "description": "cost or a baseline (docs/policies.md); null keeps it",
        },
        "weights": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
        "reason": {"type": ["string", "null"], "maxLength": 500, "description": "Why, for the audit log"},
    },
}
_ACTOR = {
    "name": "x-kvlb-actor",
    "in": "header",
    "required": False,
    "description": "Who makes the change, for the audit log (printable, at most 64 characters; default"
    " admin)",
    "schema": {"type": "string", "maxLength": 64},
}
_REPLICA = {
    "parameters": [{"name": "replica", "in": "path", "required": True, "schema": {"type": "string"}}, _ACTOR],
    "requestBody": {
        "required": False,
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "reason": {
                            "type": ["string", "null"],
                            "maxLength": 500,
                            "description": "Why, kept with the drain (GET /admin/replicas: health.drain)",
                        }
                    },
                }
            }
        },
    },
    "responses": {"200": _json({"type": "object"}, "OK"), **_errors(400, 401, 403, 404, 408, 413, 417, 503)},
}
"""A drain or undrain (optional body: its reason): 503 when the fleet's Redis did not store it."""
