"""The engine registry: one :class:`EngineSpec` per engine, and what each spec says."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import get_args

import pytest

from balancer.config import EngineKind
from balancer.engines.registry import ENGINE_SPECS, engine_spec
from balancer.engines.sglang import SglangDecoder
from balancer.engines.spec import EngineSpec
from balancer.engines.trtllm import TrtllmDecoder
from balancer.errors import ConfigError
from balancer.load.scrape import ScrapeError, with_metrics_path

METRICS = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def test_every_engine_kind_has_a_spec_under_its_own_name() -> None:
    assert set(ENGINE_SPECS) == set(get_args(EngineKind))
    for name, spec in ENGINE_SPECS.items():
        assert spec.name == name
        assert engine_spec(name) is spec


def test_unknown_engine_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown engine 'tgi'; known engines: sglang, vllm, trtllm"):
        engine_spec("tgi")
    with pytest.raises(ConfigError):
        engine_spec("")


def test_registry_and_specs_are_read_only() -> None:
    with pytest.raises(TypeError):
        ENGINE_SPECS["tgi"] = ENGINE_SPECS["sglang"]  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ENGINE_SPECS["sglang"].default_block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("engine", "decoder_type", "block_size_attribute"),
    [
        ("sglang", SglangDecoder, "block_size"),
        ("vllm", SglangDecoder, "block_size"),
        ("trtllm", TrtllmDecoder, "tokens_per_block"),
    ],
)
def test_decoder_factory_builds_a_new_decoder_for_the_block_size_given(
    engine: str, decoder_type: type, block_size_attribute: str
) -> None:
    spec = engine_spec(engine)
    first, second = spec.decoder(64), spec.decoder(64)
    assert isinstance(first, decoder_type)
    assert getattr(first, block_size_attribute) == 64
    assert getattr(spec.decoder(8), block_size_attribute) == 8
    assert first is not second  # decoders keep per-stream state: one per stream


def test_decoder_factory_rejects_a_block_size_of_zero() -> None:
    for spec in ENGINE_SPECS.values():
        with pytest.raises(ValueError):  # ConfigError is a ValueError too
            spec.decoder(0)


def test_hash_alignment_with_and_without_eagle_bigram_pages() -> None:
    assert engine_spec("trtllm").alignment() == "trtllm"
    assert engine_spec("trtllm").alignment(bigram=True) == "trtllm"
    assert engine_spec("sglang").alignment() == "plain"
    assert engine_spec("sglang").alignment(bigram=True) == "bigram"
    assert engine_spec("vllm").alignment() == "plain"
    assert engine_spec("vllm").alignment(bigram=True) == "bigram"


def test_default_block_sizes_transports_and_lease_takeover() -> None:
    summary = {
        name: (spec.default_block_size, spec.transport, spec.resync_on_unclean_takeover)
        for name, spec in ENGINE_SPECS.items()
    }
    assert summary == {
        "sglang": (16, "zmq", False),
        "vllm": (16, "zmq", False),
        "trtllm": (32, "http_drain", True),
    }


def test_scrape_targets_in_order_and_the_metrics_path_override() -> None:
    def paths(engine: str, metrics_path: str | None) -> list[str]:
        return [t.path for t in with_metrics_path(engine_spec(engine).scrape_targets, metrics_path)]

    assert paths("sglang", None) == ["/v1/loads?include=core,memory", "/metrics", "/get_load"]
    assert paths("sglang", "/m") == ["/v1/loads?include=core,memory", "/m", "/get_load"]
    assert paths("vllm", None) == ["/metrics"]
    assert paths("vllm", "/m") == ["/m"]
    assert paths("trtllm", None) == ["/metrics", "/prometheus/metrics"]
    assert paths("trtllm", "/m") == ["/metrics", "/m"]
    assert paths("trtllm", "") == ["/metrics", "/prometheus/metrics"]  # empty: the default


def test_scrape_targets_parse_their_engines_reports() -> None:
    sglang_v1, sglang_prometheus, sglang_get_load = engine_spec("sglang").scrape_targets
    body = b'{"loads": [{"num_running_reqs": 2, "num_waiting_reqs": 1}]}'
    load = sglang_v1.parse(body)
    assert load is not None and (load.running_reqs, load.waiting_reqs) == (2, 1)
    load = sglang_get_load.parse(b'{"load": 3}')
    assert load is not None and load.used_tokens == 3
    load = sglang_prometheus.parse((METRICS / "sglang-0.5.23-cpu.txt").read_bytes())
    assert load is not None and load.running_reqs is not None
    (vllm_prometheus,) = engine_spec("vllm").scrape_targets
    load = vllm_prometheus.parse((METRICS / "vllm-0.32.0-cpu.txt").read_bytes())
    assert load is not None and load.running_reqs is not None
    trtllm_stats, _ = engine_spec("trtllm").scrape_targets
    assert trtllm_stats.parse(b"[]") is None  # an empty drain: idle
    with pytest.raises(ScrapeError, match="not JSON"):
        trtllm_stats.parse(b"trtllm_num_requests_running 1")


def test_a_spec_checks_its_own_fields() -> None:
    sglang = engine_spec("sglang")
    with pytest.raises(ConfigError, match="default_block_size"):
        dataclasses.replace(sglang, default_block_size=0)
    with pytest.raises(ConfigError, match="no scrape targets"):
        dataclasses.replace(sglang, scrape_targets=())
    assert isinstance(dataclasses.replace(sglang, default_block_size=8), EngineSpec)


def test_the_drain_path_goes_with_the_http_drain_transport() -> None:
    trtllm = engine_spec("trtllm")
    assert (trtllm.transport, trtllm.drain_path) == ("http_drain", "/kv_cache_events")
    for name in ("sglang", "vllm"):
        assert (engine_spec(name).transport, engine_spec(name).drain_path) == ("zmq", None)
    with pytest.raises(ConfigError, match="drain_path"):
        dataclasses.replace(trtllm, drain_path=None)
    with pytest.raises(ConfigError, match="drain_path"):
        dataclasses.replace(engine_spec("sglang"), drain_path="/kv_cache_events")
