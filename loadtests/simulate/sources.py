"""Request streams for the simulator: workloads by name, and Mooncake traces tiled to any length (pure,
but :func:`trace_requests` streams its file: one pass, then one per tile).

A :class:`SimRequest` is a prompt as token ids (an ``array('I')``: the router and the replicas pack
it into bytes for hashing, which is a copy for an array and a conversion per token for a tuple),
``max_tokens``, an arrival time and an optional session key. Workloads come from
:func:`loadtests.workloads.make_workload`, as in ``kvlb loadtest``: token-id prompts are used as
they are and chat prompts are rendered once per distinct chat with the default tokenizer
(DeepSeek-V3 and its template, what the balancer and the emulator use). Workloads without a
schedule get Poisson arrivals at ``rate``.

``trace_requests`` replays a Mooncake trace for any number of requests by *tiling* it: request ``n``
is row ``n mod rows`` of tile ``n div rows``, shifted by whole trace lengths, so the arrival pattern,
lengths and prefix sharing of the trace repeat. Tiles share nothing: every 512-token block starts
with a token unique to its (tile, hash id) and continues with a fixed filler, so two prompts share a
prefix exactly when their hash ids do (the token values themselves do not matter to a cache).
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any

from loadtests.workloads import WORKLOADS, make_workload, poisson_arrivals, read_trace
from loadtests.workloads.base import RequestSpec
from loadtests.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError

ChatEncoder = Callable[[Sequence[Mapping[str, str]]], list[int]]

_MARKER_BASE = 1 << 20
"""First id of the per-block unique tokens of a tiled trace (above every filler id)."""
_TAIL_BASE = 1 << 31
"""First id of the per-request unique tokens that open a trace row's unshared tail."""
_CHAT_CACHE_MAX = 4096


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One simulated request."""

    token_ids: Sequence[int]
    max_tokens: int
    arrival_s: float
    """Offset from the run's start, virtual seconds."""
    session_id: str | None = None


def _field_names(name: str) -> set[str]:
    factory = WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return {f.name for f in fields(factory)}  # type: ignore[arg-type]


def workload_requests(
    name: str,
    params: Mapping[str, Any],
    *,
    requests: int | None,
    rate_per_s: float,
    seed: int,
    encode_chat: ChatEncoder | None = None,
) -> Iterator[SimRequest]:
    """The requests of workload ``name`` with ``params``, at most ``requests`` of them."""
    params = dict(params)
    if requests is not None:
        size_field = "limit" if name == "mooncake" else "num_requests"
        if size_field in _field_names(name):
            params.setdefault(size_field, requests)
    specs = make_workload(name, **params).generate(random.Random(seed))
    arrivals = poisson_arrivals(rate_per_s, random.Random(seed + 1))
    chats: dict[tuple[tuple[str, str], ...], tuple[int, ...]] = {}
    encoder = encode_chat
    for spec in islice(specs, requests):
        if spec.prompt_token_ids is None and encoder is None:
            encoder = default_chat_encoder()
        arrival_s = spec.arrival_s if spec.arrival_s is not None else next(arrivals)
        prompt = array("I", _tokens(spec, chats, encoder))
        yield SimRequest(prompt, spec.max_tokens, arrival_s, spec.session_id)


def _tokens(
    spec: RequestSpec, chats: dict[tuple[tuple[str, str], ...], tuple[int, ...]], encoder: ChatEncoder | None
) -> Sequence[int]:
    if spec.prompt_token_ids is not None:
        return spec.prompt_token_ids
    assert spec.messages is not None and encoder is not None
    key = tuple((m.role, m.content) for m in spec.messages)
    found = chats.get(key)
    if found is None:
        if len(chats) >= _CHAT_CACHE_MAX:
            chats.clear()
        found = chats[key] = tuple(encoder([m.to_json() for m in spec.messages]))
    return found


def default_chat_encoder() -> ChatEncoder:
    """Chat → token ids with the default tokenizer and template (loads it once; blocking)."""
    from balancer.tokenizer.default import default_tokenizer

    tokenizer = default_tokenizer()
    return lambda messages: tokenizer.encode_chat(messages)


@dataclass(frozen=True, slots=True)
class TraceShape:
    """The time base of a trace file: its rows, span and mean rate."""

    rows: int
    span_s: float
    """Last timestamp − first, seconds."""

    @property
    def rate_per_s(self) -> float:
        return self.rows / self.span_s if self.span_s > 0 else math.inf

    @property
    def period_s(self) -> float:
        """Offset between tiles: the span plus one mean gap, so tiles do not overlap."""
        return self.span_s + (self.span_s / self.rows if self.rows else 0.0)


def _scan(path: str | Path) -> tuple[int, int, int, int]:
    """One streaming pass over a trace: its rows, first and last timestamps (ms) and largest hash id.

    Every record is parsed (a bad one raises :class:`TraceError` naming its line) and timestamps must
    not go back; nothing is kept, so a trace of any length costs O(1) memory here.
    """
    rows = 0
    first_ms = last_ms = max_id = 0
    for row in read_trace(path):
        if rows and row.timestamp_ms < last_ms:
            raise TraceError(
                f"{path}: row {rows + 1} (timestamp {row.timestamp_ms} ms) is earlier than the row "
                f"before it ({last_ms} ms); a trace must be in arrival order "
                "(sort it by timestamp)"
            )
        if not rows:
            first_ms = row.timestamp_ms
        last_ms = row.timestamp_ms
        max_id = max(max_id, *row.hash_ids) if row.hash_ids else max_id
        rows += 1
    if not rows:
        raise ValueError(f"{path}: empty trace")
    return rows, first_ms, last_ms, max_id


def trace_requests(
    path: str | Path,
    *,
    requests: int | None,
    rate_per_s: float | None,
    seed: int,
    max_input_tokens: int | None,
    max_tokens_cap: int | None,
) -> tuple[TraceShape, Iterator[SimRequest]]:
    """The trace's shape and ``requests`` requests replaying it (all rows once when ``None``).

    ``rate_per_s`` rescales time so the mean arrival rate is that (``None``: the trace's own rate);
    it must be finite and > 0, and needs a trace whose timestamps span more than 0. Timestamps must
    not go back (a row earlier than the one before it is refused, with its line). Hash ids are
    renumbered densely in order of first use (only their equality matters), so ids of any size tile.
    """
    if requests is not None and requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    if rate_per_s is not None and not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate_per_s}")
    for name, value in (("max_input_tokens", max_input_tokens), ("max_tokens_cap", max_tokens_cap)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rows, first_ms, last_ms, max_id = _scan(path)
    shape = TraceShape(rows, (last_ms - first_ms) / 1000.0)
    if rate_per_s is not None and shape.span_s <= 0:
        raise ValueError(
            f"{path}: every row has the same timestamp, so --rate cannot rescale it "
            "(its arrivals are all at 0)"
        )
    scale = 1.0 if rate_per_s is None else shape.rate_per_s / rate_per_s
    total = rows if requests is None else requests
    tiles = total // rows + 1
    dense: dict[int, int] | None = None
    hash_span = max_id + 1
    if _MARKER_BASE + tiles * hash_span >= _TAIL_BASE:  # sparse or huge ids: number them densely
        dense = {}
        for row in read_trace(path):
            for hash_id in row.hash_ids:
                dense.setdefault(hash_id, len(dense))
        hash_span = max(1, len(dense))
    if _MARKER_BASE + tiles * hash_span >= _TAIL_BASE or total >= _TAIL_BASE:
        raise ValueError(
            f"too many requests ({total}) for a tiled trace of {rows} rows and {hash_span} distinct "
            "hash ids: the tiles' block tokens would not fit below 2^31"
        )
    rng = random.Random(seed)
    filler = array("I", [rng.randrange(1000, 100_000) for _ in range(MOONCAKE_BLOCK_TOKENS - 1)])

    def generate() -> Iterator[SimRequest]:
        n = 0
        for tile in range(tiles):
            for row in read_trace(path, limit=min(rows, total - n)):
                ids = row.hash_ids if dense is None else [dense[h] for h in row.hash_ids]
                length = (
                    row.input_length if max_input_tokens is None else min(row.input_length, max_input_tokens)
                )
                prompt = array("I")
                for hash_id in ids:
                    if len(prompt) >= length:
                        break
                    prompt.append(_MARKER_BASE + tile * hash_span + hash_id)
                    prompt.extend(filler)
                if len(prompt) < length:
                    prompt.append(_TAIL_BASE + n)
                    while len(prompt) < length:
                        prompt.extend(filler)
                del prompt[max(1, length) :]
                max_tokens = max(1, row.output_length)
                if max_tokens_cap is not None:
                    max_tokens = min(max_tokens, max_tokens_cap)
                arrival_s = (tile * shape.period_s + (row.timestamp_ms - first_ms) / 1000.0) * scale
                yield SimRequest(prompt, max_tokens, arrival_s)
                n += 1

    return shape, generate()
