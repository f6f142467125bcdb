"""The numeric ranges and named choices of kvlb's settings, as data (pure).

One table, two readers: the settings' ``validate`` methods check every entry of :data:`BOUNDS`
(:func:`check_section`, :func:`check_bound` for the entries of lists), and the configuration reference
(:mod:`balancer.config.reference`, ``docs/configuration.md``) prints them. A new setting with a range
gets its entry here, not an ``if`` in ``validate``: then the reference shows the range the loader
enforces. Rules that are not a range (URL shapes, files set together, CORS origins) are the tables
of :mod:`balancer.config.rules`, read the same two ways.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from balancer.errors import ConfigError
from balancer.policy import POLICY_NAMES

PORT_MAX = 65_535
"""Highest TCP port (a bound port beyond it would wrap around to another one)."""
MAX_INFLIGHT_BODY_BYTES = 2**40
"""Largest ``limits.max_inflight_body_bytes`` (1 TiB: in effect, no budget)."""
MAX_SEGMENT_CACHE_BYTES = 16 * 1024**3
"""Largest ``limits.segment_cache_bytes`` (16 GiB)."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The logging level names :attr:`Settings.log_level` takes (any case)."""

Limit = int | float | str
"""A bound: a number, or the dotted path of another setting (``limits.max_inflight``)."""


@dataclass(frozen=True, slots=True)
class Bound:
    """The range a numeric setting must lie in; ``None`` (unset optional settings) always passes."""

    low: Limit | None = None
    """Smallest value (``None``: no lower bound); a string names another setting."""
    high: Limit | None = None
    """Largest value (``None``: no upper bound); a string names another setting."""
    low_open: bool = False
    """``low`` itself is refused (``> low`` rather than ``>= low``)."""
    high_open: bool = False
    """``high`` itself is refused."""
    high_factor: float = 1.0
    """``high`` is multiplied by this (``redis.tick_s``: at most half of ``redis.lease_ttl_s``)."""
    finite: bool = False
    """Infinity and NaN are refused even without an upper bound."""

    def text(self) -> str:
        """The range as the error messages and the reference write it: ``> 0``, ``in [1, 64]``."""
        low = None if self.low is None else _limit_text(self.low)
        high = None if self.high is None else _limit_text(self.high)
        if high is not None and self.high_factor != 1.0:
            high = f"{high} × {_number(self.high_factor)}"
        finite = "a finite number " if self.finite else ""
        if low is not None and high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{finite}{'>' if self.low_open else '>='} {low}"
        if high is not None:
            return f"{'<' if self.high_open else '<='} {high}"
        return "finite" if self.finite else "any"

    def holds(self, value: float, low: float | None, high: float | None) -> bool:
        """Whether ``value`` lies in the range, with ``low``/``high`` resolved to numbers."""
        if math.isnan(value) or (self.finite and not math.isfinite(value)):
            return False
        if low is not None and (value <= low if self.low_open else value < low):
            return False
        return not (high is not None and (value >= high if self.high_open else value > high))


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _limit_text(limit: Limit) -> str:
    return limit if isinstance(limit, str) else _number(limit)


_GT0 = Bound(0, low_open=True)
_GE0 = Bound(0)
_GE1 = Bound(1)

BOUNDS: Mapping[str, Bound] = MappingProxyType(
    {
        "listen.port": Bound(0, PORT_MAX),
        "listen.grpc_port": Bound(0, PORT_MAX),
        "pools[].approx_ttl_s": _GT0,
        "pools[].replicas[].block_size": Bound(1, 4096),
        "pools[].replicas[].dp_size": Bound(1, 64),
        "timeouts.connect_s": _GT0,
        "timeouts.first_byte_s": _GT0,
        "timeouts.idle_s": _GT0,
        "timeouts.total_s": _GT0,
        "timeouts.body_read_s": _GT0,
        "timeouts.body_min_rate_bytes_per_s": _GE0,
        "timeouts.body_rate_grace_s": _GT0,
        "timeouts.client_idle_s": _GT0,
        "timeouts.client_write_stall_s": _GT0,
        "upstream.max_connections": Bound(1, 65_536),
        "upstream.max_idle_per_host": Bound(0, 65_536),
        "upstream.idle_ttl_s": Bound(0.1, 3600),
        "upstream.max_header_bytes": Bound(1024, 16 * 1024 * 1024),
        "upstream.max_headers": Bound(1, 10_000),
        "upstream.api_key_poll_s": Bound(0, 3600),
        "limits.max_body_bytes": _GT0,
        "limits.max_body_chunks": _GT0,
        "limits.max_n": Bound(1, 65_536),
        "limits.token_id_memo_runs": Bound(0, 1_048_576),
        "limits.body_memo_entries": Bound(0, 1_048_576),
        "limits.body_memo_bytes": Bound(0, 16 * 1024 * 1024 * 1024),
        "limits.prefix_memo_entries": Bound(0, 1_048_576),
        "limits.prefix_memo_bytes": Bound(0, 16 * 1024 * 1024 * 1024),
        "limits.segment_cache_bytes": Bound(0, MAX_SEGMENT_CACHE_BYTES),
        "limits.max_reserved_bytes": Bound(1, MAX_INFLIGHT_BODY_BYTES),
        "limits.max_inflight": _GT0,
        "limits.max_inflight_per_replica": _GT0,
        "limits.load_share_slots": Bound(1, 1_048_576),
        "limits.load_share_tenant_slots": Bound(1, 65_536),
        "limits.max_inflight_body_bytes": Bound("limits.max_body_bytes", MAX_INFLIGHT_BODY_BYTES),
        "limits.max_queued": _GE0,
        "limits.max_inflight_per_tenant": Bound(1, "limits.max_inflight"),
        "limits.max_inflight_prompt_tokens_per_tenant": _GE0,
        "limits.max_queued_per_tenant": Bound(0, "limits.max_queued"),
        "limits.max_tokenizing_per_tenant": Bound(1, "limits.max_inflight"),
        "limits.prefill_tokens_per_s": Bound(0, low_open=True, finite=True),
        "limits.max_tenants": Bound(1, 65_536),
        "limits.tenant_rate_per_s": Bound(0, finite=True),
        "limits.tenant_burst": Bound(1, 1_000_000),
        "limits.tenant_rate_tenants": Bound(1, 1_048_576),
        "limits.tenant_rate_new_per_s": Bound(0, low_open=True, finite=True),
        "limits.queue_timeout_s": _GT0,
        "limits.max_retries": _GE0,
        "limits.event_queue_size": _GT0,
        "limits.event_queue_bytes": _GT0,
        "limits.event_message_bytes": _GT0,
        "limits.event_ingest_cpu_share": _GT0,
        "limits.event_ingest_cpu_burst_s": Bound(0, 60, low_open=True),
        "limits.event_max_behind_s": Bound(0, 60, low_open=True),
        "limits.relay_history_bytes": _GT0,
        "limits.max_event_blocks": _GT0,
        "limits.index_capacity_blocks": _GT0,
        "limits.max_speculative_keys": _GT0,
        "limits.gap_hold_s": Bound(0, 60),
        "limits.gap_keep_s": Bound(0, 60),
        "redis.lease_ttl_s": _GT0,
        "redis.tick_s": Bound(0, "redis.lease_ttl_s", low_open=True, high_factor=0.5),
        "redis.stream_maxlen": Bound(100),
        "redis.stream_max_bytes": Bound(1 << 20, 1 << 40),
        "redis.snapshot_interval_s": _GT0,
        "redis.replica_timeout_s": _GT0,
        "redis.policy_poll_s": _GT0,
        "redis.socket_timeout_s": _GT0,
        "discovery.reload_interval_s": _GT0,
        "discovery.watch_timeout_s": _GT0,
        "discovery.request_timeout_s": _GT0,
        "discovery.backoff_max_s": _GT0,
        "discovery.max_replicas": _GE1,
        "discovery.max_object_bytes": Bound(64 * 1024, 16 * 1024**3),
        "console.decision_ring_size": Bound(0, 1_000_000),
        "console.decision_ring_bytes": _GT0,
        "console.audit_log_size": _GE1,
        "console.whatif_max_entries": _GE1,
        "console.whatif_max_cache_marks": Bound(1, 10_000_000),
        "console.series_interval_s": Bound(0.5, 3600),
        "console.series_intervals": Bound(1, 100_000),
        "console.series_ttft_samples": Bound(1, 100_000),
        "console.series_max_replicas": Bound(1, 100_000),
        "slo.ttft_s": Bound(0.001, 3600),
        "slo.ttft_target_ratio": Bound(0, 1, low_open=True, high_open=True),
        "workers.start_timeout_s": Bound(1, 3600),
        "workers.restart_backoff_s": Bound(0, 60),
        "workers.max_restart_backoff_s": Bound("workers.restart_backoff_s", 3600),
        "workers.restart_window_s": Bound(0, 86_400, low_open=True),
        "workers.crash_loop_exits": Bound(1, 1000),
        "workers.kill_after_s": Bound(0, 600),
        "health_models_recheck_s": Bound(1, 86_400),
        "health_ready_wait_s": Bound(0, 3600),
        "health_timeouts_to_drop": Bound(1, 10),
        "health_drain_keep_s": Bound(0, 2_592_000),
        "events_stalled_hint_s": Bound(0, 86_400),
    }
)
"""Every numeric setting's range, by dotted YAML path (``pools[].replicas[].dp_size`` for the
settings of each list entry). A setting absent here has no range beyond its type."""

CHOICES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "log_level": LOG_LEVELS,
        "policy.name": POLICY_NAMES,
    }
)
"""The values a string setting takes besides a ``Literal`` type (which the loader checks from the
type itself): ``log_level`` in any case; ``policy.name``, the registered policies."""


def resolve(root: Any, dotted: str) -> Any:
    """The value of setting ``dotted`` (no list entries) in ``root`` (a :class:`Settings`)."""
    node = root
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def check_bound(path: str, value: Any, where: str, section: Any, prefix: str = "") -> None:
    """Raise :class:`ConfigError` ``<where> must be <range>, got <value>`` when ``value`` is outside
    the range of ``path``; a bound naming another setting is read from ``section``, the settings
    at ``prefix`` (``""``: the whole :class:`Settings`; ``limits``: its ``limits``)."""
    bound = BOUNDS[path]
    if value is None:
        return
    low = _named(bound.low, section, prefix)
    high = _named(bound.high, section, prefix)
    if high is not None:
        high = high * bound.high_factor
    if not bound.holds(value, low, high):
        text = bound.text()
        if isinstance(bound.low, str) or isinstance(bound.high, str):
            here = Bound(low, high, bound.low_open, bound.high_open).text().removeprefix("in ")
            text += f" (here {here})"
        raise ConfigError(f"{where} must be {text}, got {value}")


def _named(limit: Limit | None, section: Any, prefix: str) -> float | None:
    if not isinstance(limit, str):
        return limit
    if prefix and not limit.startswith(f"{prefix}."):
        raise ValueError(f"bound {limit} is outside section {prefix}")  # pragma: no cover - table bug
    value: float = resolve(section, limit.removeprefix(f"{prefix}.") if prefix else limit)
    return value


def check_section(section: Any, prefix: str) -> None:
    """Check the :data:`BOUNDS` entries of the settings directly in ``section``, the dataclass at
    ``prefix`` (``"limits"``; ``""``: the top-level scalars of :class:`Settings`). A bound naming
    another setting names one of the same section."""
    for path in BOUNDS:
        parent, _, name = path.rpartition(".")
        if parent == prefix:
            check_bound(path, getattr(section, name), path, section, prefix)
