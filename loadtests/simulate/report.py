"""Records, summary and comparison of a simulated run (pure).

A simulation yields the same :class:`~loadtests.stats.RequestRecord` s and
:class:`~loadtests.stats.Summary` as ``kvlb loadtest``, so the two compare field by field:

* :class:`RecordColumns` stores a run's records as columns of machine numbers (a million requests
  take tens of megabytes) and is a ``Sequence[RequestRecord]`` that builds each record on access,
  so :func:`loadtests.stats.summarize` runs on it unchanged.
* Inter-token gaps are pooled in a :class:`GapHistogram` (0.2 % wide log buckets) instead of one
  tuple per record; the summary's ``itl_p50_s`` and ``itl_p90_s`` come from it, within 0.1 %.
* :func:`compare` checks a simulated summary against a ``loadtest`` report: each checked field must
  agree within a relative tolerance, or an absolute slack for near-zero values.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

from loadtests.stats import SUMMARY_FIELDS, Outcome, RequestRecord, Summary, summarize

OUTCOMES: tuple[Outcome, ...] = ("ok", "http_error", "error", "timeout", "cancelled")
_CANCELLED = OUTCOMES.index("cancelled")


class RecordColumns(Sequence[RequestRecord]):
    """A run's records, column-wise. Index ``i`` is the ``i``-th request to arrive."""

    def __init__(self, replicas: Sequence[str], id_prefix: str = "sim") -> None:
        self.replicas = tuple(replicas)
        self.id_prefix = id_prefix
        self.start_s = array("d")
        self.ttft_s = array("d")
        self.e2e_s = array("d")
        self.prompt_tokens = array("q")
        self.cached_tokens = array("q")
        self.completion_tokens = array("q")
        self.replica = array("i")
        self.outcome = array("b")
        self.status = array("h")

    def add(self, start_s: float, prompt_tokens: int) -> int:
        """A new request, in flight until :meth:`finish` or :meth:`refuse`; returns its index."""
        self.start_s.append(start_s)
        self.ttft_s.append(math.nan)
        self.e2e_s.append(math.nan)
        self.prompt_tokens.append(prompt_tokens)
        self.cached_tokens.append(0)
        self.completion_tokens.append(0)
        self.replica.append(-1)
        self.outcome.append(_CANCELLED)
        self.status.append(0)
        return len(self.start_s) - 1

    def route(self, index: int, replica: int) -> None:
        self.replica[index] = replica

    def first_token(self, index: int, now: float) -> None:
        self.ttft_s[index] = now - self.start_s[index]

    def finish(self, index: int, now: float, cached_tokens: int, completion_tokens: int) -> None:
        self.e2e_s[index] = now - self.start_s[index]
        self.cached_tokens[index] = cached_tokens
        self.completion_tokens[index] = completion_tokens
        self.outcome[index] = 0
        self.status[index] = 200

    def refuse(self, index: int, now: float, status: int) -> None:
        """An HTTP error answer (400 too long, 429 no capacity, 503 queue full)."""
        self.e2e_s[index] = now - self.start_s[index]
        self.outcome[index] = OUTCOMES.index("http_error")
        self.status[index] = status

    def __len__(self) -> int:
        return len(self.start_s)

    def span_s(self) -> float:
        """From the first arrival to the last request's end (finished or refused), seconds: the load
        test's "first send to last byte". 0 without records."""
        if not self.start_s:
            return 0.0
        pairs = zip(self.start_s, self.e2e_s, strict=True)
        ends = [start + e2e for start, e2e in pairs if not math.isnan(e2e)]
        return max(0.0, max(ends, default=self.start_s[-1]) - min(self.start_s))

    @overload
    def __getitem__(self, index: int) -> RequestRecord: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RequestRecord]: ...

    def __getitem__(self, index: int | slice) -> RequestRecord | Sequence[RequestRecord]:
        if isinstance(index, slice):
            return [self._record(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        return self._record(index)

    def __iter__(self) -> Iterator[RequestRecord]:
        return (self._record(i) for i in range(len(self)))

    def _record(self, i: int) -> RequestRecord:
        outcome = OUTCOMES[self.outcome[i]]
        ok = outcome == "ok"
        ttft, e2e, replica = self.ttft_s[i], self.e2e_s[i], self.replica[i]
        return RequestRecord(
            request_id=f"{self.id_prefix}-{i}",
            outcome=outcome,
            start_s=self.start_s[i],
            scheduled_s=self.start_s[i],
            status=self.status[i] or None,
            ttft_s=None if math.isnan(ttft) else ttft,
            e2e_s=None if math.isnan(e2e) else e2e,
            prompt_tokens=self.prompt_tokens[i] if ok else None,
            completion_tokens=self.completion_tokens[i] if ok else None,
            cached_tokens=self.cached_tokens[i] if ok else None,
            replica=self.replicas[replica] if replica >= 0 else None,
        )


class GapHistogram:
    """Counts of positive durations in log buckets ``RATIO`` wide (percentiles within ±0.1 %)."""

    RATIO = 1.002
    LOW_S = 1e-7

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0
        self._log_ratio = math.log(self.RATIO)

    def add(self, value_s: float, count: int = 1) -> None:
        if count <= 0:
            return
        bucket = int(math.log(max(value_s, self.LOW_S) / self.LOW_S) / self._log_ratio)
        self.counts[bucket] = self.counts.get(bucket, 0) + count
        self.total += count

    def percentile(self, p: float) -> float | None:
        """The ``p``-th percentile (rank ``p/100 · (n − 1)``, as ``loadtests.stats.percentile``)."""
        if not 0 <= p <= 100:
            raise ValueError(f"percentile must be in [0, 100], got {p}")
        if not self.total:
            return None
        rank = p / 100 * (self.total - 1)
        seen = 0
        for bucket in sorted(self.counts):
            seen += self.counts[bucket]
            if seen > rank:
                return float(self.LOW_S * self.RATIO ** (bucket + 0.5))
        return None  # pragma: no cover - unreachable: the last bucket holds rank n - 1


def run_summary(records: RecordColumns, gaps: GapHistogram, duration_s: float) -> Summary:
    """``summarize`` over the records, with the ITL percentiles taken from ``gaps``."""
    listed = list(records)  # summarize reads the records five times: build each once
    summary = summarize(listed, duration_s, replicas=records.replicas)
    return dataclasses.replace(summary, itl_p50_s=gaps.percentile(50), itl_p90_s=gaps.percentile(90))


# ---------------------------------------------------------------------------------------- compare

DEFAULT_CHECKS: Mapping[str, float] = {"ttft_p90_s": 0.005, "hit_rate": 0.01}
"""Fields :func:`compare` checks by default → their absolute slack (seconds, fraction)."""


@dataclass(frozen=True, slots=True)
class FieldCheck:
    """One field of a simulated summary against a measured one."""

    name: str
    simulated: float | None
    measured: float | None
    relative_error: float | None
    ok: bool


def summary_of(report: Mapping[str, Any], router: str | None = None, policy: str | None = None) -> Summary:
    """The :class:`Summary` in a report: a ``kvlb loadtest`` report's ``routers`` entry named
    ``router`` (default: the first kvlb entry with ``policy``, else the first entry with a summary),
    ``report["summary"]``, or the report itself."""
    data: Any = report
    entries = report.get("routers")
    if isinstance(entries, list):
        usable = [e for e in entries if isinstance(e, Mapping) and e.get("summary")]
        if router is not None:
            usable = [e for e in usable if e.get("name") == router]
        elif policy is not None:
            usable = sorted(usable, key=lambda e: e.get("kind") != "kvlb" or e.get("policy") != policy)
        if not usable:
            raise ValueError(
                f"the report has no router entry {router or ''} with a summary".replace("  ", " ")
            )
        data = usable[0]
    data = data.get("summary", data)
    if not isinstance(data, Mapping):
        raise ValueError("the report has no summary object")
    missing = [name for name in SUMMARY_FIELDS if name not in data]
    if missing:
        raise ValueError(f"the report's summary lacks {', '.join(missing)}")
    return Summary.from_dict(data)


def compare(
    simulated: Summary,
    measured: Summary,
    tolerance: float = 0.10,
    checks: Mapping[str, float] = DEFAULT_CHECKS,
) -> list[FieldCheck]:
    """Each checked field: ok when ``|sim − real| ≤ max(tolerance · |real|, slack)``; a field
    missing on either side fails."""
    results = []
    for name, slack in checks.items():
        sim, real = getattr(simulated, name), getattr(measured, name)
        if sim is None or real is None:
            results.append(FieldCheck(name, sim, real, None, False))
            continue
        error = abs(sim - real)
        relative = error / abs(real) if real else (0.0 if error == 0 else math.inf)
        results.append(FieldCheck(name, sim, real, relative, error <= max(tolerance * abs(real), slack)))
    return results


# ---------------------------------------------------------------------------------------- tables


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def summary_table(summary: Summary, top_replicas: int = 5) -> str:
    """A two-column text table of every Summary field (replica maps shortened to the busiest)."""
    rows: list[tuple[str, str]] = []
    for name, value in summary.to_dict().items():
        if isinstance(value, dict):
            busiest = sorted(value.items(), key=lambda item: (-item[1], item[0]))[:top_replicas]
            more = f" (+{len(value) - len(busiest)} more)" if len(value) > len(busiest) else ""
            text = ", ".join(f"{k}={format_value(v)}" for k, v in busiest) + more
            rows.append((name, text or "-"))
        else:
            rows.append((name, format_value(value)))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {text}" for name, text in rows)


def compare_table(checks: Sequence[FieldCheck], tolerance: float) -> str:
    lines = [f"{'field':<12} {'simulated':>10} {'measured':>10} {'rel.err':>8}  within {tolerance:.0%}"]
    for check in checks:
        rel = "-" if check.relative_error is None else f"{check.relative_error:.1%}"
        lines.append(
            f"{check.name:<12} {format_value(check.simulated):>10} {format_value(check.measured):>10} "
            f"{rel:>8}  {'yes' if check.ok else 'NO'}"
        )
    return "\n".join(lines)
