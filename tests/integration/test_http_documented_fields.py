"""docs/http-api.md against a real balancer: every field its admin table names is in a real answer
(and every top-level field of an answer is in ``/openapi.json`` where that describes the answer),
and every ``kvlb_*`` metric it names is exported at ``/metrics``.

The admin table's rows name their answers' fields as ``"name"`` or `` `name` ``; each row's names,
less the words that are not fields of a one-process answer (:data:`NOT_FIELDS`), must be keys
somewhere in the answer of a balancer with a decision recorded, a policy change audited and a
replica drained. A field renamed or dropped in the code (or misspelt in the doc) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kvlb_harness import MODEL, Harness, running, shared_deepseek

from balancer.api.openapi import openapi_document
from balancer.tokenizer.tokenizer import Tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"
TOKEN = "doc-token"
WORKERS_ONLY = {"worker", "workers", "workers_missing"}
"""Fields of a ``kvlb serve --workers N`` answer only (tests/e2e/test_serve_workers*.py)."""
KEPT_DRAIN_ONLY = {
    "removed_at_wall_ts", "removed_at_age_s", "expires_at_wall_ts", "expires_in_s", "source", "memory",
    "redis", "text",
}  # fmt: skip
"""The keys of a ``kept_drains`` entry (and its ``source`` values): no replica is removed here;
``tests/integration/test_drain_keep.py`` reads them from real answers, on both faces."""
NOT_FIELDS: dict[tuple[str, str], set[str]] = {
    ("PUT", "/admin/policy"): {"admin", "reason"},  # the actor's default; a body field
    ("POST", "/admin/explain"): {"draining", "full"},  # left_out's values (others: no such replica here)
    ("GET", "/admin/replicas"): {"null", "ok", "error", "silent", "stalled"}  # + the table cells
    | {"cached_tokens", "events_stalled_hint_s"}  # a usage field, a setting
    | WORKERS_ONLY
    | KEPT_DRAIN_ONLY,
    ("POST", "/admin/replicas/{id}/drain"): {"null", "health_drain_keep_s"},  # + a setting
    ("POST", "/admin/whatif"): {"last"} | WORKERS_ONLY,  # a body field
    ("GET", "/admin/decisions"): {"i", "since_id"} | WORKERS_ONLY,  # query words
    ("GET", "/admin/decisions/{id}"): {"draining", "full"},  # left_out's values
    ("GET", "/admin/audit"): WORKERS_ONLY,
    ("GET", "/admin/series"): {"minutes", "ttft_histograms", "null"} | WORKERS_ONLY,  # query words
}
PROMPT = list(range(100, 164))


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


def documented_rows() -> dict[tuple[str, str], str]:
    """``{(method, path): text}`` of the admin table's rows."""
    rows = {}
    for line in DOC.read_text("utf-8").splitlines():
        found = re.match(r"^\| `(GET|POST|PUT) (/admin[^`?]*)(\?[^`]*)?` \| (.*)$", line)
        if found:
            rows[found[1], found[2]] = found[4]
    return rows


def named_fields(text: str) -> set[str]:
    return set(re.findall(r'"([a-z_]+)"', text)) | set(re.findall(r"`([a-z_]+)`", text))


def keys_in(value: Any, out: set[str]) -> set[str]:
    if isinstance(value, dict):
        for key, inner in value.items():
            out.add(key)
            keys_in(inner, out)
    elif isinstance(value, list):
        for inner in value:
            keys_in(inner, out)
    return out


def schema_properties(method: str, template: str) -> set[str] | None:
    """The top-level properties the OpenAPI document gives the 200 answer (``None``: it lists none)."""
    document = openapi_document()
    path = template.replace("{id}", "{replica}") if "replicas" in template else template
    answer = document["paths"][path][method.lower()]["responses"]["200"]
    schema = answer.get("content", {}).get("application/json", {}).get("schema", {})
    parts = schema.get("allOf", [schema])
    names: set[str] = set()
    for part in parts:
        if "$ref" in part:
            part = document["components"]["schemas"][part["$ref"].rsplit("/", 1)[1]]
        names |= set(part.get("properties", {}))
    return names or None


async def answers(h: Harness, holder: str) -> dict[tuple[str, str], Any]:
    """One real answer per admin row, from a balancer that has routed, changed policy and drained."""
    explain = {"model": MODEL, "prompt": PROMPT}
    out: dict[tuple[str, str], Any] = {}
    out["PUT", "/admin/policy"] = await h.admin("PUT", "/admin/policy", {"weights": {"decode_weight": 0.2}})
    out["GET", "/admin/policy"] = await h.admin("GET", "/admin/policy")
    out["POST", "/admin/replicas/{id}/drain"] = await h.admin(
        "POST", "/admin/replicas/r1/drain", {"reason": "doc"}
    )
    out["POST", "/admin/explain"] = await h.admin("POST", "/admin/explain", explain)
    out["GET", "/admin/replicas"] = await h.admin("GET", "/admin/replicas")
    out["POST", "/admin/replicas/{id}/undrain"] = await h.admin("POST", "/admin/replicas/r1/undrain")
    out["GET", "/admin/replicas/{id}/blocks"] = await h.admin("GET", f"/admin/replicas/{holder}/blocks")
    out["POST", "/admin/whatif"] = await h.admin(
        "POST", "/admin/whatif", {"policy": "round_robin", "sample": 4}
    )
    out["GET", "/admin/decisions"] = await h.admin("GET", "/admin/decisions")
    newest = out["GET", "/admin/decisions"]["decisions"][0]["id"]
    out["GET", "/admin/decisions/{id}"] = await h.admin("GET", f"/admin/decisions/{newest}")
    out["GET", "/admin/audit"] = await h.admin("GET", "/admin/audit")
    out["GET", "/admin/series"] = await h.admin("GET", "/admin/series?minutes=1&ttft_histograms=1")
    return out


async def test_every_field_the_admin_table_names_is_in_a_real_answer(tokenizer: Tokenizer) -> None:
    rows = documented_rows()
    assert len(rows) >= 12, sorted(rows)
    async with running(tokenizer, 2, auth__admin_token=TOKEN) as h:
        holder = await h.warm(PROMPT)
        for i in range(3):  # decisions on the holder, which round robin's replay moves
            answer = await h.post(
                "/v1/completions", {"model": MODEL, "prompt": [*PROMPT, i], "max_tokens": 1}
            )
            assert answer.status == 200 and answer.headers["x-kvlb-replica"] == holder
        got = await answers(h, holder)
    assert set(rows) == set(got), "a row without an answer here, or an answer without its row"
    missing = {
        row: sorted(named_fields(text) - NOT_FIELDS.get(row, set()) - keys_in(got[row], set()))
        for row, text in rows.items()
    }
    assert {row: names for row, names in missing.items() if names} == {}
    # and where /openapi.json describes the answer's fields, it describes every one of them
    undescribed = {}
    for (method, template), answer in got.items():
        described = schema_properties(method, template)
        if described is not None and set(answer) - described:
            undescribed[method, template] = sorted(set(answer) - described)
    assert undescribed == {}


async def test_every_metric_the_doc_names_is_exported(tokenizer: Tokenizer) -> None:
    names = set(re.findall(r"`(kvlb_[a-z0-9_]+)", DOC.read_text("utf-8")))
    assert len(names) >= 20
    async with running(tokenizer, 1) as h, h.session.get(h.url + "/metrics") as response:
        text = await response.text()
    families = set(re.findall(r"^# TYPE (kvlb_[a-z0-9_]+) ", text, re.MULTILINE))
    # a counter's family drops the _total its samples carry
    exported = families | {f"{name}_total" for name in families}
    assert sorted(names - exported) == []
