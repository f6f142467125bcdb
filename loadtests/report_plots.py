"""PNG plots of a load-test report with matplotlib, when it is installed (I/O: writes files).

``pip install 'kvlb[report]'`` brings matplotlib; without it :func:`write_plots` writes nothing and
returns a note saying so. The plots read only the JSON report, so they can be redrawn from a saved
``report.json`` with ``python -m loadtests.report_plots report.json``.

* ``ttft_cdf.png``: the TTFT CDF of every router (log time axis).
* ``hit_rate.png``: the replica-side hit rate per router, with the oracle bound and the
  infinite-cache bound as lines.
* ``load_over_time.png``: per router, ``running + waiting`` of every replica over the run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtests.atomic_files import save_figure_atomic

NO_MATPLOTLIB = "Plots skipped: matplotlib is not installed (pip install 'kvlb[report]')."


def write_plots(report: Mapping[str, Any], out: Path) -> tuple[list[str], str | None]:
    """Write the plots next to the report; returns (paths written, a note or ``None``)."""
    if importlib.util.find_spec("matplotlib") is None:
        return [], NO_MATPLOTLIB
    import matplotlib

    matplotlib.use("Agg")
    entries = [e for e in report["routers"] if e["status"] == "ok"]
    if not entries:
        return [], "Plots skipped: no router completed."
    paths = [
        _ttft_cdf(entries, out / "ttft_cdf.png"),
        _hit_rate(entries, report.get("oracle"), out / "hit_rate.png"),
        _load_over_time(entries, out / "load_over_time.png"),
    ]
    return [str(p) for p in paths], None


def _ttft_cdf(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for entry in entries:
        values = entry["ttft_s"]
        if values:
            fractions = [(i + 1) / len(values) for i in range(len(values))]
            axes.step(values, fractions, where="post", label=entry["name"])
    axes.set_xscale("log")
    axes.set_xlabel("TTFT (s, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title("TTFT CDF per router")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=110)
    plt.close(figure)
    return path


def _hit_rate(entries: Sequence[Mapping[str, Any]], oracle: Mapping[str, Any] | None, path: Path) -> Path:
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    names = [e["name"] for e in entries]
    rates = [e["hit_rate"] or 0.0 for e in entries]
    axes.bar(names, rates, color="tab:blue")
    if oracle and oracle.get("hit_rate") is not None:
        axes.axhline(oracle["hit_rate"], color="tab:red", label="oracle (fleet KV capacity)")
    if oracle and oracle.get("unbounded_hit_rate") is not None:
        axes.axhline(oracle["unbounded_hit_rate"], color="tab:gray", linestyle="--", label="infinite cache")
    axes.set_ylim(0, 1)
    axes.set_ylabel("cached / prompt tokens (replica counters)")
    axes.set_title("Prefix-cache hit rate per router")
    axes.tick_params(axis="x", labelrotation=20)
    axes.legend(loc="lower right", framealpha=0.9)
    figure.tight_layout()
    save_figure_atomic(figure, path, dpi=110)
    plt.close(figure)
    return path


def _load_over_time(entries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    columns = 2 if len(entries) > 1 else 1
    rows = math.ceil(len(entries) / columns)
    figure, grid = plt.subplots(rows, columns, figsize=(6 * columns, 2.8 * rows), squeeze=False)
    peak = max(
        (s[1] + s[2] for e in entries for series in e["load_series"].values() for s in series), default=1.0
    )
    for index, entry in enumerate(entries):
        axes = grid[index // columns][index % columns]
        for name, samples in sorted(entry["load_series"].items()):
            axes.plot([s[0] for s in samples], [s[1] + s[2] for s in samples], linewidth=0.9, label=name)
        axes.set_title(entry["name"], fontsize=10)
        axes.set_ylim(0, max(1.0, peak) * 1.05)
        axes.set_xlabel("s since start")
        axes.set_ylabel("running + waiting")
        axes.grid(True, alpha=0.3)
    for index in range(len(entries), rows * columns):
        grid[index // columns][index % columns].axis("off")
    handles, labels = grid[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(8, len(labels)), fontsize=8)
    figure.suptitle("Per-replica load over time")
    figure.tight_layout(rect=(0, 0.05, 1, 0.97))
    save_figure_atomic(figure, path, dpi=100)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m loadtests.report_plots REPORT.json", file=sys.stderr)
        return 2
    path = Path(args[0])
    paths, note = write_plots(json.loads(path.read_text(encoding="utf-8")), path.parent)
    print("\n".join(paths) if paths else note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
