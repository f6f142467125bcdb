"""The soak's report: flat-line verdicts (pure) and ``report.json``, ``report.md`` and a PNG (I/O).

**Flat line.** For RSS, open file descriptors and asyncio tasks, the median of the samples in the
first quarter of the run is compared with the median in the last quarter (the sample taken after the
load stopped is left out); the growth must stay within :class:`GrowthLimits`. Medians, so that a fault
in progress at one sample (requests piling up on a hung replica) does not decide it. No request may be
lost and every fault must have been injected.

The plot ``soak_over_time.png`` needs matplotlib (``pip install 'kvlb[report]'``); without it the
report says so. ``python -m loadtests.faults.soak_report report.json`` redraws it and the markdown.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.atomic_files import save_figure_atomic, write_text_atomic

NO_MATPLOTLIB = "Plot skipped: matplotlib is not installed (pip install 'kvlb[report]')."
MAX_ROWS = 60
"""Rows of the over-time table in ``report.md`` (every sample is in ``report.json``)."""
PLOT = "soak_over_time.png"


@dataclass(frozen=True)
class GrowthLimits:
    rss_mb: float = 50.0
    """Allowed RSS growth (MB), median of the first quarter to median of the last."""
    fds: float = 20.0
    """Allowed growth of kvlb's open file descriptors."""
    tasks: float = 20.0
    """Allowed growth of the asyncio tasks on kvlb's loop (``kvlb_process_asyncio_tasks``)."""


def quarters(samples: Sequence[Mapping[str, Any]], key: str) -> tuple[float | None, float | None]:
    """Medians of ``key`` over the first and the last quarter of the run (by sample time; the first
    and the last sample always count); ``None`` where no sample there has a value."""
    kept = [s for s in samples if not s.get("drained")]
    if not kept:
        return None, None
    span = kept[-1]["t_s"] - kept[0]["t_s"]
    first = [s for i, s in enumerate(kept) if i == 0 or s["t_s"] - kept[0]["t_s"] <= span / 4]
    last = [s for i, s in enumerate(kept) if i == len(kept) - 1 or kept[-1]["t_s"] - s["t_s"] <= span / 4]

    def median(group: Sequence[Mapping[str, Any]]) -> float | None:
        values = [float(s[key]) for s in group if s.get(key) is not None]
        return round(statistics.median(values), 1) if values else None

    return median(first), median(last)


def judge(figures: Mapping[str, Any], limits: GrowthLimits) -> dict[str, Any]:
    """The verdicts: growth of RSS, fds and tasks within ``limits``, no lost request, every fault
    injected. ``passed`` is their conjunction."""
    checks: dict[str, dict[str, Any]] = {}
    for key, limit in (("rss_mb", limits.rss_mb), ("fds", limits.fds), ("tasks", limits.tasks)):
        first, last = quarters(figures["samples"], key)
        growth = None if first is None or last is None else round(last - first, 1)
        checks[key] = {
            "first_quarter": first,
            "last_quarter": last,
            "growth": growth,
            "limit": limit,
            "ok": growth is not None and growth <= limit,
        }
    lost = int(figures["requests"]["outcomes"].get("lost", 0))
    checks["lost"] = {"value": lost, "limit": 0, "ok": lost == 0}
    failed = sum(1 for fault in figures["faults"] if "error" in fault)
    checks["fault_errors"] = {"value": failed, "limit": 0, "ok": failed == 0}
    return {"passed": all(c["ok"] for c in checks.values()), "checks": checks}


# ------------------------------------------------------------------------------------------ files


def write_report(report: Mapping[str, Any], out: Path, plots: bool = True) -> None:
    note = "Plot skipped (--no-plots)." if not plots else write_plot(report, out / PLOT)
    write_text_atomic(out / "report.json", json.dumps(report, indent=1) + "\n")
    write_text_atomic(out / "report.md", markdown(report, note))


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _v(value: Any) -> str:
    return "—" if value is None else str(value)


def markdown(report: Mapping[str, Any], plot_note: str | None) -> str:
    meta, requests, verdict = report["meta"], report["requests"], report["verdict"]
    options = meta["options"]
    outcomes = ", ".join(f"{name} {count}" for name, count in sorted(requests["outcomes"].items()))
    lines = [
        f"# kvlb soak: {'PASSED' if verdict['passed'] else 'FAILED'}",
        "",
        f"`{meta['command']}`, started {meta['started']} (load average {meta['load_average']}).",
        f"{report['elapsed_s']} s under {options['rate']} requests/s, "
        + (f"a fault every {options['fault_every_s']} s" if options["fault_every_s"] else "no faults")
        + f" ({len(report['faults'])} injected), a sample every "
        f"{options['sample_every_s']} s. kvlb pid {report['kvlb']['pid']}, replicas "
        f"{', '.join(report['kvlb']['engines'])}.",
        "",
        "## Verdicts",
        "",
        "| figure | first quarter (median) | last quarter (median) | growth | limit | ok |",
        "|---|---|---|---|---|---|",
    ]
    checks = verdict["checks"]
    for key in ("rss_mb", "fds", "tasks"):
        c = checks[key]
        lines.append(
            f"| {key} | {_v(c['first_quarter'])} | {_v(c['last_quarter'])} | {_v(c['growth'])} "
            f"| {c['limit']} | {'yes' if c['ok'] else '**no**'} |"
        )
    for key in ("lost", "fault_errors"):
        c = checks[key]
        lines.append(f"| {key} | | | {c['value']} | {c['limit']} | {'yes' if c['ok'] else '**no**'} |")
    lines += [
        "",
        "## Requests",
        "",
        f"{requests['sent']} sent: {outcomes}. Error rate (not ok) {requests['error_rate']:.2%}; "
        f"successful requests p50 {requests['p50_ok_s']} s, p99 {requests['p99_ok_s']} s.",
        *(f"- lost: {detail}" for detail in requests["lost_details"]),
        "",
        "## Faults",
        "",
        "| at | fault | index within engines after | matches engines after | what happened |",
        "|---|---|---|---|---|",
    ]
    for fault in report["faults"]:
        lines.append(
            f"| {fault['at_s']} s | {fault['fault']} | {_s(fault.get('within_s'))} "
            f"| {_s(fault.get('equal_s'))} | {fault.get('note') or fault.get('error', '')} |"
        )
    lines += ["", "## Over time", "", f"![over time]({PLOT})" if plot_note is None else plot_note, ""]
    lines += _sample_rows(report["samples"])
    return "\n".join(lines) + "\n"


def _sample_rows(samples: Sequence[Mapping[str, Any]]) -> list[str]:
    step = max(1, -(-len(samples) // MAX_ROWS))
    shown = [s for i, s in enumerate(samples) if i % step == 0 or i == len(samples) - 1]
    lines = [
        f"{len(shown)} of {len(samples)} samples (all of them in report.json); requests and errors are "
        "those that completed in the interval before the sample.",
        "",
        "| t (s) | RSS (MB) | fds | tasks | index held blocks | engine blocks | in flight | completed "
        "| errors | error rate | fault on |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shown:
        fault = s["fault"] + (" (load stopped)" if s.get("drained") else "")
        lines.append(
            f"| {s['t_s']} | {s['rss_mb']} | {s['fds']} | {_v(s['tasks'])} | {_v(s['index_held_blocks'])} "
            f"| {_v(s['engine_blocks'])} | {_v(s['inflight'])} | {s['completed']} | {s['errors']} "
            f"| {s['error_rate']:.2%} | {fault} |"
        )
    return lines


def write_plot(report: Mapping[str, Any], path: Path) -> str | None:
    """``soak_over_time.png``: RSS, fds, tasks, index vs engines, error rate, faults as lines."""
    if importlib.util.find_spec("matplotlib") is None:
        return NO_MATPLOTLIB
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    t = [s["t_s"] for s in samples]
    panels: list[tuple[str, list[tuple[str, str]]]] = [
        ("RSS (MB)", [("rss_mb", "RSS")]),
        ("open fds", [("fds", "fds")]),
        ("asyncio tasks", [("tasks", "tasks")]),
        ("blocks", [("index_held_blocks", "index (held)"), ("engine_blocks", "engines")]),
        ("error rate", [("error_rate", "not ok / completed")]),
    ]
    figure, grid = plt.subplots(len(panels), 1, figsize=(9, 2.1 * len(panels)), sharex=True)
    for axes, (label, keys) in zip(grid, panels, strict=True):
        top = 0.05 if keys[0][0] == "error_rate" else 1.0
        for key, name in keys:
            values = [math.nan if s[key] is None else float(s[key]) for s in samples]
            top = max([top, *(1.25 * v for v in values if not math.isnan(v))])
            axes.plot(t, values, linewidth=1.0, label=name)
        for fault in report["faults"]:
            axes.axvline(fault["at_s"], color="tab:red", alpha=0.25, linewidth=0.8)
        axes.set_ylim(0, top)  # from zero, so that a flat line looks flat
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        if len(keys) > 1:
            axes.legend(fontsize=8, loc="lower right")
    grid[-1].set_xlabel("s since start (red lines: faults)")
    figure.suptitle("kvlb soak: resources over time")
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=100)
    plt.close(figure)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m loadtests.faults.soak_report report.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    report = json.loads(path.read_text(encoding="utf-8"))
    write_report(report, path.parent)
    print(path.parent / "report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
