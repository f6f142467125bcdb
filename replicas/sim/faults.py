"""Fault injection settings and state of one emulated replica (pure; the replica applies them).

Standing faults (flags at start-up, or ``POST /admin/faults``):

* ``drop_events``: fraction of event batches lost after their sequence number (SGLang ``seq``) or
  ``event_id`` (TRT-LLM) was assigned, as a PUB high-water mark or a full TRT-LLM queue loses them. SGLang
  keeps dropped batches in its replay buffer, so a subscriber can fill the gap by replay.
* ``replay_dropped``: ``false`` keeps those lost batches out of the replay buffer too (lost for good,
  as when the buffer rotated past them): only a receipt or a later gap can tell kvlb.
* ``slowdown``: step-time multiplier (1 = nominal, 3 = three times slower).
* ``fail_health``: ``/health`` and ``/health_generate`` answer 503.
* ``crash_after_chunks``: streaming responses are cut (connection aborted) after this many chunks.
* ``served_model``: the engine serves under another model name (a vLLM replica then refuses the
  profile's name, 404, as vLLM refuses every name it does not serve).

One-shot actions (admin endpoint only): ``stall_s`` (the engine computes nothing for that long; requests
queue), ``refuse_s`` (the HTTP listener is closed for that long) and ``restart`` (in-flight requests are
aborted, the cache is emptied, the event sequence or ``event_id`` restarts at 0 under a new epoch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class FaultSettings:
    """Standing faults; the defaults mean "healthy"."""

    drop_events: float = 0.0
    """Fraction in [0, 1] of event batches silently lost (0: none, 1: every batch)."""

    replay_dropped: bool = True
    """Whether a batch ``drop_events`` lost is still kept in the SGLang/vLLM replay buffer (as after
    a PUB high-water-mark loss); ``False``: lost for good, as when the buffer rotated past it."""

    slowdown: float = 1.0
    """Step-time multiplier, > 0 (1: nominal speed)."""

    fail_health: bool = False
    """Health endpoints answer 503 while set."""

    crash_after_chunks: int | None = None
    """Abort every streaming response after this many SSE chunks (``None``: never)."""

    served_model: str | None = None
    """Serve under this model name instead of the profile's (``None``: the profile's), as an engine
    started with another ``--served-model-name``: ``GET /v1/models`` and the answers name it, and a
    vLLM replica answers a request for any other name 404 (SGLang and TRT-LLM serve any name)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.drop_events <= 1.0:
            raise ValueError(f"drop_events must be in [0, 1], got {self.drop_events}")
        if not self.slowdown > 0 or math.isinf(self.slowdown):
            raise ValueError(f"slowdown must be a finite number > 0, got {self.slowdown}")
        if self.crash_after_chunks is not None and self.crash_after_chunks < 0:
            raise ValueError(f"crash_after_chunks must be >= 0, got {self.crash_after_chunks}")
        if self.served_model is not None and not (isinstance(self.served_model, str) and self.served_model):
            raise ValueError(f"served_model must be a non-empty string or null, got {self.served_model!r}")


@dataclass(frozen=True, slots=True)
class FaultActions:
    """One-shot actions requested through the admin endpoint."""

    stall_s: float = 0.0
    refuse_s: float = 0.0
    restart: bool = False


_SETTING_KEYS = frozenset(FaultSettings.__dataclass_fields__)
_ACTION_KEYS = frozenset(FaultActions.__dataclass_fields__)


def parse_fault_request(
    current: FaultSettings, body: Mapping[str, Any]
) -> tuple[FaultSettings, FaultActions]:
    """New settings (``current`` with the body's keys applied) and the requested actions.

    Raises ``ValueError`` for unknown keys or out-of-range values, so a typo never passes silently.
    """
    unknown = set(body) - _SETTING_KEYS - _ACTION_KEYS
    if unknown:
        raise ValueError(f"unknown fault keys: {', '.join(sorted(unknown))}")
    try:
        settings = replace(current, **{k: v for k, v in body.items() if k in _SETTING_KEYS})
        actions = FaultActions(**{k: v for k, v in body.items() if k in _ACTION_KEYS})
    except TypeError as exc:
        raise ValueError(str(exc)) from exc
    if actions.stall_s < 0 or actions.refuse_s < 0:
        raise ValueError("stall_s and refuse_s must be >= 0")
    return settings, actions


class FaultState:
    """The live faults of one replica plus the seeded randomness that decides which batches drop."""

    def __init__(self, settings: FaultSettings, rng: random.Random) -> None:
        self.settings = settings
        self._rng = rng
        self.dropped_batches = 0

    def drop_batch(self) -> bool:
        """Whether the next event batch is lost (counted)."""
        fraction = self.settings.drop_events
        if fraction <= 0.0:
            return False
        lost = fraction >= 1.0 or self._rng.random() < fraction
        self.dropped_batches += int(lost)
        return lost

    def describe(self) -> dict[str, Any]:
        return {**asdict(self.settings), "dropped_batches": self.dropped_batches}
