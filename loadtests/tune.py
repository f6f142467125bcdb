"""``kvlb tune``'s core: sweep policy weights in the simulator, find the frontier, recommend (pure,
except :func:`write_plot`, which writes a PNG).

Every grid point runs the *same* request list (same prompts, same arrival times) through
:func:`loadtests.simulate.simulate` with the base weights plus that point's values, so points differ
only by their weights. A point is on the **frontier** when no other point is at least as good on all
of TTFT p90 (lower), output tokens/s (higher) and hit rate (higher) and better on one. The
**recommendation** is the point with the lowest objective among those meeting the SLO (imbalance
≤ ``max_imbalance``, no errors, hit rate ≥ ``min_hit_rate``); points within 1 % of that objective
count as tied and the higher hit rate wins. It is printed as a ``kvlb admin policy set`` line.

Default grid (:data:`DEFAULT_GRID`, 36 points): ``overlap_credit`` 0 / 1 / 2, ``duplication_weight``
0 / 1, ``decode_weight`` 0 / 0.1 / 1, ``imbalance_threshold_blocks`` off / 256. ``prefill_weight`` is
not swept: the argmin is unchanged when every weight is scaled by the same factor, so it only moves
prefill against decode and queue, which ``decode_weight`` covers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from balancer.policy.registry import POLICY_WEIGHTS, weights_read
from loadtests.atomic_files import save_figure_atomic
from loadtests.simulate import SimConfig, SimRequest, simulate
from loadtests.simulate.report import format_value
from loadtests.stats import Summary

Grid = Mapping[str, Sequence[float | None]]

DEFAULT_GRID: Grid = {
    "overlap_credit": (0.0, 1.0, 2.0),
    "duplication_weight": (0.0, 1.0),
    "decode_weight": (0.0, 0.1, 1.0),
    "imbalance_threshold_blocks": (None, 256.0),
}
"""The sweep when no ``--grid`` is given (module docstring)."""

SMOKE_GRID: Grid = {"overlap_credit": (0.0, 1.0), "imbalance_threshold_blocks": (None, 64.0)}

OBJECTIVES: Mapping[str, str] = {
    "ttft_p90": "ttft_p90_s",
    "ttft_p50": "ttft_p50_s",
    "e2e_p90": "e2e_p90_s",
}
"""``--objective`` name → the Summary field minimised."""


def parse_grid(items: Sequence[str]) -> dict[str, tuple[float | None, ...]]:
    """``["overlap_credit=0,0.5,1", "imbalance_threshold_blocks=null,64"]`` → a grid."""
    grid: dict[str, tuple[float | None, ...]] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.strip() or not raw.strip():
            raise ValueError(f"expected NAME=V1,V2,..., got {item!r}")
        values = tuple(_value(v.strip()) for v in raw.split(","))
        grid[name.strip()] = values
    return grid


def _value(text: str) -> float | None:
    if text.lower() in ("null", "none", "off"):
        return None
    return float(text)


def grid_for_policy(policy: str, given: Grid | None, default: Grid) -> Grid:
    """The grid ``kvlb tune`` sweeps for ``policy``: ``given`` (``--grid``) when the policy reads
    every weight in it, else ``ValueError`` naming those it does not read; without ``--grid``,
    ``default`` narrowed to the weights the policy reads (``POLICY_WEIGHTS``), and ``ValueError``
    when none is left. Before 2026-12-01 ``--policy round_robin`` swept the 36 points of the
    default grid, every one routing alike, and recommended a weight line for it."""
    read = weights_read(policy)
    if not read:
        movable = ", ".join(name for name, names in POLICY_WEIGHTS.items() if names)
        raise ValueError(f"policy {policy} reads no weight: nothing to tune (weights move {movable})")
    if given is not None:
        unread = [name for name in given if name not in read]
        if unread:
            raise ValueError(
                f"--grid {', '.join(unread)}: policy {policy} does not read "
                f"{'it' if len(unread) == 1 else 'them'} (it reads {', '.join(sorted(read))})"
            )
        return given
    narrowed = {name: values for name, values in default.items() if name in read}
    if not narrowed:
        raise ValueError(
            f"policy {policy} reads none of the default grid's weights ({', '.join(default)}): "
            f"pass --grid with {' / '.join(sorted(read))}"
        )
    return narrowed


def grid_points(grid: Grid) -> list[dict[str, float | None]]:
    """Every combination, in a stable order (the first name varies slowest)."""
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(grid[n] for n in names))]


@dataclass(frozen=True, slots=True)
class Point:
    """One grid point's weights (only the swept ones) and the run's summary."""

    weights: dict[str, float | None]
    summary: Summary
    frontier: bool = False
    meets_slo: bool = False


@dataclass(frozen=True, slots=True)
class Slo:
    """What a recommendation must meet, and what it minimises."""

    max_imbalance: float = 1.5
    """Max/mean per-replica request count; 1.0 is perfectly even."""
    min_hit_rate: float = 0.0
    objective: str = "ttft_p90"

    def met_by(self, summary: Summary) -> bool:
        imbalance = summary.imbalance if summary.imbalance is not None else math.inf
        hit_rate = summary.hit_rate or 0.0
        return summary.errors == 0 and imbalance <= self.max_imbalance and hit_rate >= self.min_hit_rate

    def score(self, summary: Summary) -> float:
        value = getattr(summary, OBJECTIVES[self.objective])
        return math.inf if value is None else float(value)


def sweep(
    base: SimConfig,
    requests: Sequence[SimRequest],
    grid: Grid,
    progress: Callable[[int, int, dict[str, float | None]], None] | None = None,
) -> list[Point]:
    """Run every grid point over the same requests; invalid weight combinations raise ``ConfigError``."""
    points = grid_points(grid)
    results: list[Point] = []
    for n, values in enumerate(points):
        if progress is not None:
            progress(n, len(points), values)
        config = replace(base, weights=base.weights.replace(**values))
        results.append(Point(values, simulate(config, requests).summary))
    return results


TIE_FRACTION = 0.01
"""Objective values within 1 % of the best count as tied (run-to-run noise is larger)."""


def _key(summary: Summary) -> tuple[float, float, float]:
    """Lower is better on each axis."""
    ttft = summary.ttft_p90_s if summary.ttft_p90_s is not None else math.inf
    return ttft, -(summary.output_tok_per_s or 0.0), -(summary.hit_rate or 0.0)


def _no_worse(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """``a`` is at least as good as ``b`` on every axis, output tokens/s within :data:`TIE_FRACTION`
    counting as equal: every point serves the same requests and tokens, so its tokens/s differ only
    by when the last request ends (0.04 % on the smoke grid), which is no trade-off."""
    return a[0] <= b[0] and a[1] <= b[1] + TIE_FRACTION * abs(b[1]) and a[2] <= b[2]


def mark(points: Sequence[Point], slo: Slo) -> list[Point]:
    """The points with ``frontier`` and ``meets_slo`` set."""
    keys = [_key(p.summary) for p in points]

    def dominated(i: int) -> bool:
        return any(
            j != i and _no_worse(keys[j], keys[i]) and not _no_worse(keys[i], keys[j])
            for j in range(len(points))
        )

    return [
        replace(p, frontier=not dominated(i), meets_slo=slo.met_by(p.summary)) for i, p in enumerate(points)
    ]


def recommend(points: Sequence[Point], slo: Slo) -> Point | None:
    """The SLO-meeting point with the lowest objective; among those within :data:`TIE_FRACTION` of it,
    the highest hit rate, then the lowest imbalance. ``None`` when no point meets the SLO."""
    eligible = [p for p in points if slo.met_by(p.summary)]
    if not eligible:
        return None
    best = min(slo.score(p.summary) for p in eligible)
    tied = [p for p in eligible if slo.score(p.summary) <= best + TIE_FRACTION * abs(best)]
    return min(tied, key=lambda p: (-(p.summary.hit_rate or 0.0), p.summary.imbalance or 0.0))


def admin_command(policy: str, weights: Mapping[str, float | None]) -> str:
    """The ``kvlb admin policy set`` line that applies ``weights``."""
    pairs = " ".join(f"{name}={'null' if value is None else f'{value:g}'}" for name, value in weights.items())
    return f"kvlb admin policy set name={policy} {pairs}".rstrip()


def table(points: Sequence[Point], names: Sequence[str]) -> str:
    """A markdown table: swept weights, the four figures, frontier and SLO flags."""
    head = [*names, "ttft_p90_s", "out_tok_s", "hit_rate", "imbalance", "frontier", "slo"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        s = p.summary
        cells = [format_value(p.weights.get(n)) for n in names]
        cells += [format_value(s.ttft_p90_s), format_value(s.output_tok_per_s), format_value(s.hit_rate)]
        cells += [format_value(s.imbalance), "*" if p.frontier else "", "ok" if p.meets_slo else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(points: Sequence[Point], best: Point | None, slo: Slo, policy: str) -> dict[str, Any]:
    """The JSON form of a sweep."""
    return {
        "kind": "kvlb-tune",
        "policy": policy,
        "slo": {
            "max_imbalance": slo.max_imbalance,
            "min_hit_rate": slo.min_hit_rate,
            "objective": slo.objective,
        },
        "points": [
            {
                "weights": p.weights,
                "frontier": p.frontier,
                "meets_slo": p.meets_slo,
                "summary": p.summary.to_dict(),
            }
            for p in points
        ],
        "recommendation": None
        if best is None
        else {"weights": best.weights, "command": admin_command(policy, best.weights)},
    }


def write_plot(points: Sequence[Point], best: Point | None, path: Path) -> bool:
    """TTFT p90 against hit rate, coloured by output tokens/s (I/O). ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [p.summary.ttft_p90_s or 0.0 for p in points]
    ys = [p.summary.hit_rate or 0.0 for p in points]
    colours = [p.summary.output_tok_per_s or 0.0 for p in points]
    dots = ax.scatter(xs, ys, c=colours, cmap="viridis", s=36, zorder=2)
    fig.colorbar(dots, ax=ax, label="output tokens/s")
    front = sorted((x, y) for x, y, p in zip(xs, ys, points, strict=True) if p.frontier)
    if front:
        ax.plot(*zip(*front, strict=True), color="tab:red", lw=1, zorder=1, label="frontier")
    for x, y, p in zip(xs, ys, points, strict=True):
        if not p.meets_slo:
            ax.scatter([x], [y], marker="x", color="grey", s=60, zorder=3)
    if best is not None:
        ax.scatter([best.summary.ttft_p90_s or 0.0], [best.summary.hit_rate or 0.0], marker="*", s=260,
                   facecolors="none", edgecolors="tab:red", zorder=4, label="recommended")  # fmt: skip
    ax.set_xlabel("TTFT p90 (s)")
    ax.set_ylabel("hit rate")
    ax.set_title("kvlb tune: policy weights (x = misses the SLO)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110, format="png")  # the path as given, whatever its suffix
    plt.close(fig)
    return True
