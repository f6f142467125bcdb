"""The configuration reference's rules (pure): each setting's shape and partner rules, the section
"Rules across settings" and the section "Policy weights" of ``docs/configuration.md``.

Read off the tables the loader checks: :data:`~balancer.config.rules.SHAPES`,
:data:`~balancer.config.rules.TOGETHER` and :data:`~balancer.config.rules.ACROSS`, and for the
weights the policy's own :class:`~balancer.policy.base.PolicyWeights` (defaults),
:data:`~balancer.policy.base.WEIGHT_RANGES`, :data:`~balancer.policy.base.OPTIONAL_WEIGHTS` and
:data:`~balancer.policy.registry.POLICY_WEIGHTS` (which policies read each).
"""

from __future__ import annotations

import dataclasses

from balancer.config.across import ACROSS
from balancer.config.rules import SHAPES, TOGETHER
from balancer.policy.base import OPTIONAL_WEIGHTS, WEIGHT_RANGES, PolicyWeights
from balancer.policy.registry import POLICY_NAMES, POLICY_WEIGHTS

RULES_TITLE = "Rules across settings"
RULES_ANCHOR = "rules-across-settings"
WEIGHTS_TITLE = "Policy weights"
WEIGHTS_RULE = "each key a weight of [Policy weights](#policy-weights), in its range"
"""The rule of ``policy.weights`` as its entry shows it."""


def field_rule(path: str) -> str | None:
    """The rules of setting ``path`` beyond its range and choices: its shape, the settings it goes
    with, and for ``policy.weights`` its keys; ``None`` when it has none."""
    parts = []
    shape = SHAPES.get(path)
    if shape is not None:
        parts.append(f"shape `{shape.name}`: {shape.text}")
    parts.extend(rule.text() for rule in TOGETHER if path in (rule.first.path, rule.second.path))
    parts.extend(
        f"across entries: {rule.name} ([{RULES_TITLE}](#{RULES_ANCHOR}))"
        for rule in ACROSS
        if path in rule.paths
    )
    if path == "policy.weights":
        parts.append(WEIGHTS_RULE)
    return "; ".join(parts) or None


def rules_markdown() -> str:
    """The section listing every rule that is not a range: shapes, pairs, checks across entries."""
    lines = [
        f"## {RULES_TITLE}\n",
        "Besides its range and choices, a setting may have a shape, a partner or a rule across list",
        "entries; the loader refuses a value that breaks one, with a message naming the setting",
        "(`balancer/config/rules.py`).\n",
        "### Shapes\n",
        "| Setting | Shape | Asks for |",
        "| --- | --- | --- |",
    ]
    lines.extend(f"| `{path}` | `{shape.name}` | {shape.text} |" for path, shape in SHAPES.items())
    lines += ["", "### Settings that go together\n"]
    lines.extend(f"- {_capital(rule.text())}." for rule in TOGETHER)
    lines += ["", "### Across list entries\n"]
    lines.extend(f"- {rule.text}" for rule in ACROSS)
    return "\n".join(lines) + "\n"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def weights_markdown() -> str:
    """The section listing every policy weight ``policy.weights`` may set: default, range, whether
    ``null`` is allowed, and the policies that read it."""
    readers: dict[str, list[str]] = {}
    for policy in POLICY_NAMES:
        for weight in POLICY_WEIGHTS[policy]:
            readers.setdefault(weight, []).append(f"`{policy}`")
    lines = [
        f"## {WEIGHTS_TITLE}\n",
        "The keys of `policy.weights` (and of `/admin/policy`, `x-kvlb-weights` and the gRPC admin),",
        "each checked against its range wherever it comes from; what each does: docs/policies.md,",
        '"Weights". A policy reads only the weights listed for it; the others change nothing it decides.\n',
        "| Weight | Default | Range | Read by |",
        "| --- | --- | --- | --- |",
    ]
    for field in dataclasses.fields(PolicyWeights):
        default = field.default
        shown = "null" if default is None else _number(float(default))  # type: ignore[arg-type]
        span = str(WEIGHT_RANGES[field.name]) + (" or null" if field.name in OPTIONAL_WEIGHTS else "")
        read_by = ", ".join(readers.get(field.name, ())) or "none"
        lines.append(f"| `{field.name}` | `{shown}` | {span} | {read_by} |")
    return "\n".join(lines) + "\n"
