"""Named, calibrated engine profiles for the emulator (pure data).

A profile fixes what a replica models: the KV pool size, the batch cap, the chunked-prefill budget
and the coefficients of the step-time model in :mod:`replicas.sim.timing`. The numbers and where they
come from are documented in ``docs/emulator.md``; in short:

* ``h100-llama3-8b``: Llama-3-8B (BF16) on one H100, SGLang-style defaults. About 12k prefill tok/s and
  an inter-token latency of ~7 ms at batch 1, rising to ~15 ms at batch 64 and ~35 ms at batch 128 with
  4k contexts.
* ``h100-qwen3-32b``: Qwen3-32B (FP8 weights) on one H100, as in Dynamo's KV-router A/B benchmark.
  About 5k prefill tok/s; ITL ~22 ms at batch 1 to ~40 ms at batch 32 with 4k contexts.
* ``cpu-small-llama``: the 157M-parameter random Llama measured with vLLM on this 2-core machine.
* ``cpu-test``: a tiny, fast profile for tests (small pages, small pool, millisecond steps).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Profile:
    """What one emulated engine models. Times are in model seconds (before time scaling)."""

    name: str
    """Profile name as given to ``--profile``."""

    model: str
    """Served model name (``/v1/models``, ``model`` in responses)."""

    page_size: int
    """Tokens per KV page (SGLang ``--page-size``); TRT-LLM replicas use ``tokens_per_block`` instead."""

    kv_capacity_tokens: int
    """KV pool size in tokens; the pool holds ``kv_capacity_tokens // page_size`` pages. A full pool
    evicts unreferenced cached pages (LRU); when none are left, new requests wait in the queue."""

    max_running_requests: int
    """Batch cap: requests in prefill or decode at once. More wait in the queue."""

    chunk_prefill_tokens: int
    """Prefill budget per step (chunked prefill): uncached prompt tokens computed in one step."""

    step_overhead_s: float
    """Fixed cost of one forward step (kernel launches, sampling, scheduling): the batch-1 ITL floor."""

    prefill_s_per_token: float
    """Cost of one uncached prompt token (1 / prefill throughput). Cached prefix tokens cost nothing."""

    decode_s_per_seq: float
    """Cost of one more sequence in the decode batch (per-sequence compute)."""

    context_s_per_token: float
    """Cost of one token of KV read by a decoding sequence per step (memory bandwidth bound)."""

    max_context_tokens: int
    """Context length: prompt plus ``max_tokens`` above this is rejected with HTTP 400."""

    vocab_size: int
    """Vocabulary size used for generated ids when no tokenizer gives one."""

    def with_overrides(self, **changes: object) -> Profile:
        """A copy with some fields changed (e.g. a smaller pool for a test)."""
        return replace(self, **changes)  # type: ignore[arg-type]


PROFILES: dict[str, Profile] = {
    profile.name: profile
    for profile in (
        Profile(
            name="h100-llama3-8b",
            model="meta-llama/Meta-Llama-3-8B-Instruct",
            page_size=16,
            kv_capacity_tokens=400_000,
            max_running_requests=256,
            chunk_prefill_tokens=8192,
            step_overhead_s=0.007,
            prefill_s_per_token=1.0 / 12_000,
            decode_s_per_seq=0.00005,
            context_s_per_token=4.0e-8,
            max_context_tokens=8192,
            vocab_size=128_256,
        ),
        Profile(
            name="h100-qwen3-32b",
            model="Qwen/Qwen3-32B-FP8",
            page_size=16,
            kv_capacity_tokens=130_000,
            max_running_requests=128,
            chunk_prefill_tokens=8192,
            step_overhead_s=0.022,
            prefill_s_per_token=1.0 / 5_000,
            decode_s_per_seq=0.0001,
            context_s_per_token=8.0e-8,
            max_context_tokens=32_768,
            vocab_size=151_936,
        ),
        Profile(
            name="cpu-small-llama",
            model="small-llama",
            page_size=16,
            kv_capacity_tokens=65_536,
            max_running_requests=32,
            chunk_prefill_tokens=2048,
            step_overhead_s=0.019,
            prefill_s_per_token=1.0 / 10_700,
            decode_s_per_seq=0.0006,
            context_s_per_token=0.0,
            max_context_tokens=4096,
            vocab_size=129_280,
        ),
        Profile(
            name="cpu-test",
            model="sim-test",
            page_size=4,
            kv_capacity_tokens=256,
            max_running_requests=4,
            chunk_prefill_tokens=32,
            step_overhead_s=0.002,
            prefill_s_per_token=0.00005,
            decode_s_per_seq=0.0005,
            context_s_per_token=0.0,
            max_context_tokens=512,
            vocab_size=1000,
        ),
    )
}


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ``KeyError`` lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
