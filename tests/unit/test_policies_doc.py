"""docs/policies.md's weights table against :class:`~balancer.policy.base.PolicyWeights`: every
weight has a row, and each row's default is the one a policy starts with (``GET /admin/policy`` on a
fresh balancer shows the same)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from balancer.policy.base import WEIGHT_RANGES, PolicyWeights

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"


def documented_defaults() -> dict[str, str]:
    """``{field: default}`` of the table's rows (`| `name` | default | range | meaning |`)."""
    table = DOCS.read_text("utf-8").split("## Weights (`PolicyWeights`)", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", table, re.MULTILINE))


def test_every_weight_has_a_row_with_its_default() -> None:
    rows = documented_defaults()
    fields = {f.name for f in dataclasses.fields(PolicyWeights)}
    assert set(rows) == fields == set(WEIGHT_RANGES)
    defaults = PolicyWeights()
    for name, text in rows.items():
        value = getattr(defaults, name)
        assert (None if text == "null" else float(text)) == value, (name, text, value)
