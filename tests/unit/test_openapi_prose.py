"""The OpenAPI document (:func:`balancer.api.openapi.openapi_document`) against docs/http-api.md's
prose: every field the OpenAI endpoints' table says kvlb reads is a property of the endpoint's
request body, and every request header the doc lists is a parameter of ``/v1/*``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from balancer.api.openapi import openapi_document

DOC = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text("utf-8")


def body_properties(path: str) -> set[str]:
    schema: dict[str, Any] = openapi_document()["paths"][path]["post"]["requestBody"]["content"]
    return set(schema["application/json"]["schema"]["properties"])


def test_every_field_kvlb_reads_is_in_the_request_schema() -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        row = re.search(rf"^\| `POST {re.escape(path)}` \| ([^|]+) \|", DOC, re.MULTILINE)
        assert row is not None, path
        read = {name for field in re.findall(r"`([a-z_/]+)`", row[1]) for name in field.split("/")}
        assert read and read <= body_properties(path), (path, sorted(read - body_properties(path)))


def test_every_documented_request_header_is_a_parameter_of_v1() -> None:
    table = DOC.split("### Request headers", 1)[1].split("###", 1)[0]
    headers = {h.lower() for h in re.findall(r"^\| `([A-Za-z-]+)[:`]", table, re.MULTILINE)} - {
        "authorization"
    }
    for path in ("/v1/chat/completions", "/v1/completions"):
        names = {p["name"] for p in openapi_document()["paths"][path]["post"]["parameters"]}
        assert headers and headers <= names, (path, sorted(headers - names))
