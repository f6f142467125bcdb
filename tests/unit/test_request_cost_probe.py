"""The instruction probe's pure parts (``loadtests/bench/request_cost.py``): the scaled settings and
the callgrind dump's totals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from balancer.config.loader import SettingsSource, parse_settings
from loadtests.bench.overhead.servers import kvlb_config
from loadtests.bench.request_cost import dumped_events, scaled_config


def test_scaled_config_multiplies_kvlbs_timer_periods_and_loads() -> None:
    config = scaled_config(kvlb_config(["http://127.0.0.1:9"], 2), 100.0)
    settings = parse_settings(SettingsSource("kvlb.yaml", yaml.safe_dump(config).encode()), [], {})
    assert settings.limits.speculative_ttl_s == 200.0
    assert settings.health_interval_s == 500.0
    assert settings.timeouts.connect_s == 200.0
    assert settings.upstream.idle_ttl_s == 1500.0
    assert scaled_config(kvlb_config(["http://127.0.0.1:9"], 1), 1000.0)["upstream"]["idle_ttl_s"] == 3600.0


def test_dumped_events_reads_every_events_total(tmp_path: Path) -> None:
    (tmp_path / "cg.7.1").write_bytes(
        b"version: 1\ncreator: callgrind-3.19.0\nevents: Ir Dr D1mr\nfn=(1) main\n3 10 2 1\n"
        b"summary: 1200 300 7\ntotals: 1200 300 7\n"
    )
    assert dumped_events(tmp_path, 7) == {"Ir": 1200, "Dr": 300, "D1mr": 7}
    (tmp_path / "cg.8.1").write_bytes(b"events: Ir\n")
    with pytest.raises(RuntimeError, match="no totals"):
        dumped_events(tmp_path, 8)
