"""The step-time model of the emulator (pure).

One engine step runs a batch: some prefill chunks and one token for every decoding sequence. Its
duration in model seconds is::

    step_s = (overhead + prefill_tokens · prefill_s_per_token
              + decode_seqs · decode_s_per_seq + context_tokens · context_s_per_token) · slowdown

``prefill_tokens`` counts only **uncached** prompt tokens (cached prefix tokens cost nothing) and
``context_tokens`` is the KV read by the decoding sequences (their prompt plus output so far). A step
with nothing to do takes no time. ``slowdown`` is the fault-injection multiplier (1 = nominal).

A :class:`TimeScale` maps model seconds to wall seconds: with ``factor`` 10 the emulator runs ten times
faster than the modelled hardware, so tests stay quick while every ratio is preserved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from replicas.sim.profiles import Profile


def step_time_s(
    profile: Profile,
    *,
    prefill_tokens: int,
    decode_seqs: int,
    context_tokens: int,
    slowdown: float = 1.0,
) -> float:
    """Model seconds one step takes (0 when the step holds no work)."""
    if prefill_tokens < 0 or decode_seqs < 0 or context_tokens < 0:
        raise ValueError("step sizes must be >= 0")
    if prefill_tokens == 0 and decode_seqs == 0:
        return 0.0
    nominal = (
        profile.step_overhead_s
        + prefill_tokens * profile.prefill_s_per_token
        + decode_seqs * profile.decode_s_per_seq
        + context_tokens * profile.context_s_per_token
    )
    return nominal * slowdown


def isolated_ttft_s(profile: Profile, *, prompt_tokens: int, cached_tokens: int) -> float:
    """Model TTFT of one request alone on an idle replica: its prefill chunks, back to back.

    At least one token is always computed (engines never serve the whole prompt from cache), so a
    fully cached prompt still costs one step.
    """
    uncached = max(1, prompt_tokens - cached_tokens)
    steps = math.ceil(uncached / profile.chunk_prefill_tokens)
    return steps * profile.step_overhead_s + uncached * profile.prefill_s_per_token


def isolated_itl_s(profile: Profile, *, batch: int, context_tokens_per_seq: int) -> float:
    """Model inter-token latency of a decode-only batch of ``batch`` sequences of equal context."""
    return step_time_s(
        profile, prefill_tokens=0, decode_seqs=batch, context_tokens=batch * context_tokens_per_seq
    )


@dataclass(frozen=True, slots=True)
class TimeScale:
    """Model time runs ``factor`` times faster than wall time (``factor`` > 0; 1 = real time)."""

    factor: float = 1.0
    """Model seconds per wall second. 10 makes a 100 ms modelled step take 10 ms of wall time."""

    def __post_init__(self) -> None:
        if not self.factor > 0 or math.isinf(self.factor):
            raise ValueError(f"time scale must be a finite number > 0, got {self.factor}")

    def to_wall(self, model_s: float) -> float:
        return model_s / self.factor

    def to_model(self, wall_s: float) -> float:
        return wall_s * self.factor
