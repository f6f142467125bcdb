"""The configuration reference: ``docs/configuration.md`` is up to date with the settings, every
setting is documented with a unit, the default file ``kvlb config defaults`` prints loads back to the
defaults, the environment names and ranges it shows are the ones the loader uses, and ``kvlb config
check`` prints no secret."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.cli.config_command import settings_source
from balancer.config import Settings, load, merge_overrides
from balancer.config.bounds import BOUNDS, CHOICES, resolve
from balancer.config.loader import SERVICE_LINK
from balancer.config.reference import effective_tree, render_markdown, sections
from balancer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"

FIELDS = [item for section in sections(settings_source()) for item in section.fields]
DOCUMENTED = {item.path: item for item in FIELDS}

UNIT_WORDS = re.compile(
    r"\b(seconds?|bytes?|KiB|MiB|GiB|requests?|tokens?|blocks?|entries|connections?|port|ranks?|"
    r"replicas?|tenants?|origins?|characters?|intervals?|attempts?|decisions?|sequences?|chunks?|"
    r"slots?|marks?|runs?|batches|changes|fields?|events?|keys?|probes?|ids?|share)\b",
    re.IGNORECASE,
)
"""What a count is of, for a quantity whose name carries no unit (``max_inflight``: requests)."""

NOT_QUANTITIES = {"policy.seed"}
"""Integer settings that are identifiers, not amounts."""


def kvlb(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "balancer", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        check=False,
    )


def test_the_committed_reference_is_up_to_date() -> None:
    expected = render_markdown(settings_source())
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/configuration.md is out of date with balancer/config/settings.py or bounds.py: "
        "regenerate it with `make docs-config` (kvlb config reference > docs/configuration.md)"
    )


def test_kvlb_config_reference_prints_the_committed_doc() -> None:
    printed = kvlb("config", "reference")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout == DOC.read_text(encoding="utf-8")


def test_the_reference_is_deterministic() -> None:
    source = settings_source()
    assert render_markdown(source) == render_markdown(source)


def test_every_setting_is_documented_with_a_unit() -> None:
    assert len(FIELDS) > 100
    missing = [item.path for item in FIELDS if not item.doc.strip()]
    assert missing == [], f"settings without a docstring: {missing}"
    quantities = [
        item
        for item in FIELDS
        if item.type_text.split(" or ")[0] in ("integer", "number") and item.path not in NOT_QUANTITIES
    ]
    no_unit = [item.path for item in quantities if item.unit is None and not UNIT_WORDS.search(item.doc)]
    assert no_unit == [], f"quantities whose name (_s, _bytes, ...) and docstring give no unit: {no_unit}"


def test_every_duration_and_size_is_a_number() -> None:
    for item in FIELDS:
        if item.unit in ("seconds", "bytes"):
            assert item.type_text.split(" or ")[0] in ("integer", "number"), item.path


def test_the_reference_lists_every_range_and_choice_the_loader_checks() -> None:
    documented = DOCUMENTED
    for path, bound in BOUNDS.items():
        assert path in documented, f"BOUNDS names {path}, which is no setting"
        allowed = documented[path].allowed
        assert allowed is not None and bound.text() in allowed
    for path, choices in CHOICES.items():
        allowed = documented[path].allowed
        assert allowed is not None and all(f"`{c}`" in allowed for c in choices)
    engine = documented["pools[].replicas[].engine"].allowed
    assert engine == "one of `sglang`, `vllm`, `trtllm`"


@pytest.mark.parametrize("path", sorted(p for p in BOUNDS if "[]" not in p))
def test_the_loader_refuses_a_value_just_outside_the_documented_range(path: str) -> None:
    bound = BOUNDS[path]
    defaults = Settings()
    is_int = DOCUMENTED[path].type_text.startswith("integer")
    step = 1 if is_int else 0.001
    outside = []
    low = resolve(defaults, bound.low) if isinstance(bound.low, str) else bound.low
    high = resolve(defaults, bound.high) if isinstance(bound.high, str) else bound.high
    if low is not None:
        outside.append(low if bound.low_open else low - step)
    if high is not None:
        high *= bound.high_factor
        outside.append(high if bound.high_open else high + step)
    if bound.finite and not is_int:
        outside.append(math.inf)
    if not is_int:  # until 2026-12-01 19 settings of 30 (timeouts, redis, discovery) took nan
        outside.append(math.nan)
    assert outside
    for value in outside:
        with pytest.raises(ConfigError, match=re.escape(f"{path} must be {bound.text()}")):
            load(None, [f"{path}={value}"], env={})


@pytest.mark.parametrize(
    ("entry", "where"),
    [
        ("{model: m, approx_ttl_s: 0}", "pools[m].approx_ttl_s must be > 0, got 0"),
        ("{model: m, approx_ttl_s: .nan}", "pools[m].approx_ttl_s must be > 0, got nan"),
        (
            "{model: m, replicas: [{id: a, url: 'http://h:1', block_size: 4097}]}",
            "replica a: block_size must be in",
        ),
        (
            "{model: m, replicas: [{id: a, url: 'http://h:1', dp_size: 0}]}",
            "replica a: dp_size must be in [1, 64]",
        ),
    ],
)
def test_the_loader_checks_the_ranges_of_list_entries(entry: str, where: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(where)):
        load(None, [f"pools=[{entry}]"], env={})


def test_every_environment_name_sets_its_setting() -> None:
    for item in FIELDS:
        if item.environment is None:
            assert "[]" in item.path
            continue
        assert not SERVICE_LINK.fullmatch(item.environment), item.environment
        tree = merge_overrides({}, {item.environment: "7"}, ())
        assert resolve_tree(tree, item.path) == 7, item.path


def resolve_tree(tree: dict[str, object], dotted: str) -> object:
    node: object = tree
    for part in dotted.split("."):
        assert isinstance(node, dict)
        node = node[part]
    return node


def test_the_default_file_loads_back_to_the_defaults(tmp_path: Path) -> None:
    printed = kvlb("config", "defaults")
    assert printed.returncode == 0, printed.stderr
    path = tmp_path / "defaults.yaml"
    path.write_text(printed.stdout, encoding="utf-8")
    assert load(path, env={}) == Settings()
    checked = kvlb("config", "check", str(path))
    assert checked.returncode == 0, checked.stderr
    body = [line for line in printed.stdout.splitlines() if not line.startswith("#")]
    assert checked.stdout.splitlines() == body


def test_check_prints_the_effective_settings_without_secrets(tmp_path: Path) -> None:
    key_file = tmp_path / "engine-key"
    key_file.write_text("engine-secret-1\n", encoding="utf-8")
    config = tmp_path / "kvlb.yaml"
    config.write_text(
        "auth: {api_keys: [client-secret-1, client-secret-2], admin_token: admin-secret}\n"
        "redis: {url: 'redis://user:redis-secret@127.0.0.1:6390/0'}\n"
        f"pools: [{{model: m, api_key_file: '{key_file}', replicas: [{{id: a, url: 'http://127.0.0.1:1'}}]}}]\n",
        encoding="utf-8",
    )
    settings = load(config, ["limits.max_inflight=64"], env={})
    tree = effective_tree(settings)
    assert tree["limits"]["max_inflight"] == 64
    assert tree["auth"] == {"api_keys": ["<redacted>", "<redacted>"], "admin_token": "<redacted>",
                            "allow_weight_override": False}  # fmt: skip
    assert tree["redis"]["url"] == "redis://user:<redacted>@127.0.0.1:6390/0"
    assert tree["pools"][0]["replicas"][0]["api_key"] == f"<secret from api_key_file {key_file}>"
    checked = kvlb("config", "check", str(config), "--set", "limits.max_inflight=64")
    assert checked.returncode == 0, checked.stderr
    assert "max_inflight: 64" in checked.stdout
    for secret in ("client-secret", "admin-secret", "redis-secret", "engine-secret"):
        assert secret not in checked.stdout + checked.stderr
    refused = kvlb("config", "check", str(config), "--set", "limits.max_n=0")
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr == "kvlb config check: limits.max_n must be in [1, 65536], got 0\n"
