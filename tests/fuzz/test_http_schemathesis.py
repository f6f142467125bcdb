"""HTTP fuzzing with schemathesis against kvlb's own OpenAPI document (``/openapi.json``).

For every operation, schemathesis generates requests from the document (valid and invalid bodies,
headers, path parameters) and sends them to a live balancer in front of two emulated replicas, with
API keys and an admin token configured. Every answer is checked by schemathesis's default checks: no
5xx that the document does not list (never a 500), a documented status code, content type and
headers, and a body matching the documented schema. ``KVLBTEST_SCHEMATHESIS_EXAMPLES`` sets the examples
per operation (default 15; ``make faults`` runs 200).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from fuzz_results import save_result
from hypothesis import HealthCheck, settings
from live_service import LiveService, live

from balancer.api.openapi import openapi_document

STATUSES: Counter[int] = Counter()
"""Statuses of every generated request of this module (for ``make faults``' report)."""
EXAMPLES = int(os.environ.get("KVLBTEST_SCHEMATHESIS_EXAMPLES", "15"))
API_KEY = "sk-fuzz-client-key"
ADMIN_TOKEN = "fuzz-admin-token"

schema = schemathesis.openapi.from_dict(openapi_document())
EXCLUDED = [schemathesis.checks.positive_data_acceptance]
"""The document describes only the fields kvlb reads; a schema-valid body can still be refused, by kvlb
(``1.0`` is a JSON-Schema integer but not a token id) or by the replica (prompt over its context)."""


@pytest.fixture(scope="module")
def service() -> Iterator[LiveService]:
    with live(
        2, auth__api_keys=[API_KEY], auth__admin_token=ADMIN_TOKEN, limits__max_prompt_tokens=4096
    ) as svc:
        yield svc


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as http:
        yield http


def auth_for(path: str) -> dict[str, str]:
    token = ADMIN_TOKEN if path.startswith("/admin") else API_KEY
    return {"Authorization": f"Bearer {token}"}


def test_the_served_document_is_the_fuzzed_one(service: LiveService, session: requests.Session) -> None:
    served = session.get(service.url + "/openapi.json", timeout=5).json()
    assert served == openapi_document()


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_every_operation_conforms(
    case: schemathesis.Case, service: LiveService, session: requests.Session
) -> None:
    # What is validated must be what is sent: a query parameter whose value is None or an empty
    # list, which requests drops from the URL, is dropped from the case too, and a one-element list,
    # which requests sends as that one value, becomes that value (else a negative case "an array"
    # reaches kvlb as a valid request, and its 200 reads as accepting invalid data). An *undocumented*
    # parameter (a negative case "an extra parameter") is sent with a plain value instead of being
    # dropped, so that it stays the extra parameter the case is about.
    if case.query:
        documented = {parameter.name for parameter in case.operation.query}
        query: dict[str, Any] = {}
        for name, value in case.query.items():
            if value is None or value == []:  # requests sends neither
                if name not in documented:
                    query[name] = "x"
                continue
            query[name] = value[0] if isinstance(value, list) and len(value) == 1 else value
        case.query = query
    response = case.call_and_validate(
        base_url=service.url,
        session=session,
        headers=auth_for(case.path),
        timeout=30,
        excluded_checks=EXCLUDED,
    )
    STATUSES[response.status_code] += 1


def test_zz_figures_for_the_report() -> None:
    """Runs last in this module: the number of requests schemathesis sent, by status."""
    save_result(
        "fuzz_http_schemathesis",
        {"payloads": sum(STATUSES.values()), "seconds": "-", "slowest_ms": "-", "outcomes": dict(STATUSES)},
    )
