"""The settings' rules that are not a range (``balancer/config/rules.py``, ``across.py``): every
shape, pair and check across entries is enforced by the loader, with a message naming the setting,
and is printed in ``docs/configuration.md``; the policy weights are listed there from the policy's
own tables."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from balancer.config import Settings, from_mapping, load, merge_overrides
from balancer.config.across import ACROSS
from balancer.config.rules import SHAPES, TOGETHER, Together
from balancer.errors import ConfigError
from balancer.policy.base import OPTIONAL_WEIGHTS, WEIGHT_RANGES, PolicyWeights
from balancer.policy.registry import POLICY_WEIGHTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

REPLICA = {"id": "a", "url": "http://h:1"}

BAD_SHAPES: dict[str, list[Any]] = {
    "listen.cors_allow_origins": [
        ["https://app.example.com/"],
        ["app.example.com"],
        ["ftp://app.example.com"],
        ["https://" + "a" * 300],
        [f"https://h{i}.example.com" for i in range(65)],
    ],
    "pools[].replicas[].url": ["ftp://x", "http://", "https://h:port", "h:8000"],
    "pools[].replicas[].events": ["udp://h:5557", "tcp://h", "tcp://:5557", "ipc://", "h:5557"],
    "pools[].replicas[].replay": ["udp://h:5558", "tcp://h", "tcp://h:x", "ipc://"],
    "redis.url": ["http://x", "redis://:pa/ss@h:6379/0", "redis://:secret@/0", "redis://h:6379/kvlb"],
    "redis.key_prefix": ["", "a{b}"],
    "discovery.api_url": ["kubernetes.default.svc", "ftp://k", "https://"],
    "tenant_header": ["", "a b", "x:y", "x-tenánt"],
    "jemalloc_library": ["", "lib jemalloc.so", "a.so:b.so", "x" * 4097],
}
"""Values of each shaped setting that do not fit its shape."""

GOOD_SHAPES: dict[str, list[Any]] = {
    "listen.cors_allow_origins": [["*"], ["https://app.example.com", "http://127.0.0.1:3000"]],
    "pools[].replicas[].url": ["http://h:1", "https://h", "http://[::1]:8000/v"],
    "pools[].replicas[].events": ["tcp://h:5557", "tcp://[::1]:5557", "ipc:///run/kv"],
    "pools[].replicas[].replay": ["tcp://h:5558", "ipc:///run/kv-replay"],
    "redis.url": ["redis://h", "redis://u:p%2F@h:6379/", "rediss://h:6380/3"],
    "redis.key_prefix": ["kvlb", "fleet-a:"],
    "discovery.api_url": ["https://kubernetes.default.svc", "http://127.0.0.1:8001"],
    "tenant_header": ["x-kvlb-tenant", "X_Tenant_2"],
    "jemalloc_library": ["libjemalloc.so.2", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"],
}

BAD_PAIRS: dict[str, dict[str, Any]] = {
    "listen.tls_cert_file/listen.tls_key_file": {"listen.tls_cert_file": "/c.pem"},
    "listen.cors_allow_origins/listen.cors_allow_credentials": {
        "listen.cors_allow_origins": ["*"],
        "listen.cors_allow_credentials": True,
    },
    "redis.tls_ca_file/redis.url": {"redis.tls_ca_file": "/ca.crt", "redis.url": "redis://h:6379/0"},
    "redis.cluster/redis.url": {"redis.cluster": True},
    "redis.cluster/redis.url/database": {"redis.cluster": True, "redis.url": "redis://h:7000/2"},
    "discovery.kind/discovery.file": {"discovery.kind": "file"},
    "pools[].api_key_file/pools[].api_key_env": {"pools[].api_key_file": "/k", "pools[].api_key_env": "K"},
    "pools[].replicas[].api_key_file/pools[].replicas[].api_key_env": {
        "pools[].replicas[].api_key_file": "/k",
        "pools[].replicas[].api_key_env": "K",
    },
}
"""For each rule of ``TOGETHER`` (by :func:`pair_key`), settings that break it."""

BAD_ACROSS: dict[str, tuple[list[dict[str, Any]], str]] = {
    "unique model": (
        [{"model": "m", "replicas": [REPLICA]}, {"model": "m"}],
        "pools: model 'm' appears twice",
    ),
    "unique replica id": (
        [{"model": "m", "replicas": [REPLICA]}, {"model": "n", "replicas": [REPLICA]}],
        "pools[n].replicas: id 'a' appears twice",
    ),
    "one replica per event endpoint": (
        [
            {
                "model": "m",
                "replicas": [
                    {**REPLICA, "events": "tcp://h:5557", "dp_size": 2},
                    {"id": "b", "url": "http://h:2", "events": "tcp://h:5558"},
                ],
            }
        ],
        "replica b rank 0 events endpoint tcp://h:5558 is also replica a rank 1 events's",
    ),
}
"""For each check of ``ACROSS`` (by name), pools that break it and the message."""


def pair_key(rule: Together) -> str:
    key = f"{rule.first.path}/{rule.second.path}"
    return key + "/database" if "database" in rule.message else key


def flow(value: Any) -> str:
    """``value`` as flow YAML on one line, as ``--set`` takes it."""
    text: str = yaml.safe_dump(value, default_flow_style=True, width=100_000)
    return text.strip().removesuffix("...").strip()


def settings_for(values: dict[str, Any]) -> list[str]:
    """``--set`` arguments giving each dotted setting its value; a list entry's setting
    (``pools[].x``, ``pools[].replicas[].x``) goes into one pool ``m`` with one replica ``a``."""
    sets, pool, replica = [], {"model": "m"}, dict(REPLICA)
    for path, value in values.items():
        if path.startswith("pools[].replicas[]."):
            replica[path.removeprefix("pools[].replicas[].")] = value
        elif path.startswith("pools[]."):
            pool[path.removeprefix("pools[].")] = value
        else:
            sets.append(f"{path}={flow(value)}")
    if any(path.startswith("pools[]") for path in values):
        sets.append(f"pools={flow([{**pool, 'replicas': [replica]}])}")
    return sets


def accepted(values: dict[str, Any]) -> Settings:
    """The settings with ``values``, validated as the loader does (no key file or variable read)."""
    settings: Settings = from_mapping(Settings, merge_overrides({}, {}, settings_for(values)))
    return settings.validate()


def refusal(values: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as raised:
        load(None, settings_for(values), env={})
    return str(raised.value)


def entry_of(path: str) -> str:
    """How messages name the list entry ``settings_for`` builds, for a setting at ``path``."""
    if path.startswith("pools[].replicas[]."):
        return "replica a: "
    return "pools[m]: " if path.startswith("pools[].") else ""


def test_every_rule_of_the_tables_has_cases_here() -> None:
    """A rule added to a table without cases here fails: then the tests below check it too."""
    assert set(BAD_SHAPES) == set(SHAPES) == set(GOOD_SHAPES)
    for rule in TOGETHER:  # check_rules runs a pair with its section: both must be in it
        assert rule.first.path.rpartition(".")[0] == rule.second.path.rpartition(".")[0], rule
    assert set(BAD_PAIRS) == {pair_key(rule) for rule in TOGETHER}
    assert set(BAD_ACROSS) == {rule.name for rule in ACROSS}


@pytest.mark.parametrize("path", sorted(SHAPES))
def test_every_shape_is_enforced_with_a_message_naming_the_setting(path: str) -> None:
    name = path.rpartition(".")[2]
    where = f"{entry_of(path)}{name}" if "[]" in path else path
    for value in BAD_SHAPES[path]:
        message = refusal({path: value})
        assert message.startswith(where), (value, message)
        assert message.removeprefix(where) == SHAPES[path].problem(value), value
    for value in GOOD_SHAPES[path]:
        accepted({path: value})


@pytest.mark.parametrize("rule", TOGETHER, ids=pair_key)
def test_every_pair_is_enforced_with_its_message(rule: Together) -> None:
    bad = BAD_PAIRS[pair_key(rule)]
    assert refusal(bad) == entry_of(rule.first.path) + rule.message
    assert rule.first.path.rpartition(".")[2] in rule.message or "[]" in rule.first.path
    # the same settings with the first side not holding are accepted
    accepted({k: v for k, v in bad.items() if k != rule.first.path})


@pytest.mark.parametrize("name", sorted(BAD_ACROSS))
def test_every_check_across_entries_is_enforced(name: str) -> None:
    pools, message = BAD_ACROSS[name]
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(None, [f"pools={flow(pools)}"], env={})


def field_entry(path: str) -> str:
    """The entry of setting ``path`` in the committed reference, up to the next heading."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n### `{path}`\n")
    return text[start : text.index("\n#", start + 1)]


def rules_section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## Rules across settings\n")
    return text[start : text.index("\n## ", start + 1)]


def test_the_reference_prints_every_rule() -> None:
    section = rules_section()
    for path, shape in SHAPES.items():
        assert f"rule: shape `{shape.name}`: {shape.text}" in field_entry(path), path
        assert f"| `{path}` | `{shape.name}` | {shape.text} |" in section
    for rule in TOGETHER:
        for path in (rule.first.path, rule.second.path):
            assert rule.text() in field_entry(path), (path, rule.text())
        assert rule.text()[1:] in section
    for check in ACROSS:
        assert f"- {check.text}" in section
        for path in check.paths:
            assert f"across entries: {check.name}" in field_entry(path), path


def test_the_reference_lists_every_policy_weight_from_the_policy() -> None:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("\n## Policy weights\n")
    table = text[start:]
    assert "(#policy-weights)" in field_entry("policy.weights")
    for field in dataclasses.fields(PolicyWeights):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{field.name}` |"))
        assert f"| {WEIGHT_RANGES[field.name]}" in row
        assert ("or null" in row) == (field.name in OPTIONAL_WEIGHTS)
        readers = [policy for policy, read in POLICY_WEIGHTS.items() if field.name in read]
        assert readers and all(f"`{policy}`" in row for policy in readers), row
        default = field.default
        assert f"| `{'null' if default is None else f'{default:g}'}` |" in row
