"""``kvlb bench ...`` subcommands (I/O: runs benchmarks, prints reports)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = subparsers.add_parser("bench", help="micro-benchmarks of kvlb's hot paths")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH")
    index = kinds.add_parser("index", help="prefix index: apply, match, memory, hashing (vs Dynamo)")
    index.add_argument("--json", action="store_true", help="print the JSON report only")
    index.add_argument("--smoke", action="store_true", help="tiny shapes (seconds), for CI")
    index.set_defaults(handler=_run_index)
    from loadtests.bench.overhead.run import add_parser as add_overhead_parser

    add_overhead_parser(kinds)
    from loadtests.bench.flood import add_parser as add_flood_parser
    from loadtests.bench.redis_bench import add_parser as add_redis_parser

    add_flood_parser(kinds)

    add_redis_parser(kinds)
    bench.set_defaults(handler=lambda _args: _usage(bench))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def print_report(
    report: dict[str, Any], format_report: Callable[[dict[str, Any]], str], *, json_only: bool
) -> int:
    """Every bench's output: with ``--json`` (``json_only``) the report as indented JSON; else
    ``format_report``'s table, a blank line and the report as one line of JSON. Returns 0 (the exit
    status)."""
    if json_only:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        print()
        print(json.dumps(report))
    return 0


def _run_index(args: argparse.Namespace) -> int:
    from loadtests.bench import index_bench

    shape = index_bench.SMOKE if args.smoke else index_bench.BenchShape()
    return print_report(index_bench.run(shape), format_index_report, json_only=args.json)


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


_ROWS = (
    ("apply, blocks/s, best run (higher: better)", "apply", "apply_blocks_per_s", 0),
    ("apply, blocks per CPU-second", "apply_cpu", None, 0),
    ("match p50, µs", "match_p50", "match_p50_us", 1),
    ("match p99, µs", "match_p99", None, 1),
    ("match p50, CPU µs", "match_cpu_p50", None, 1),
    ("memory, B/held block (tracemalloc)", "traced", "bytes_per_block", 1),
    ("memory, B/held block (RSS growth)", "rss", None, 1),
    ("hash 8k tokens bs=16, p50 ms", "hash16", "hash_8k_ms", 3),
    ("hash 8k tokens bs=32, p50 ms", "hash32", "hash_8k_ms", 3),
)


def format_index_report(report: dict[str, Any]) -> str:
    """A readable table of the ``kvlb bench index`` report."""
    shape, targets, kvlb, dynamo = report["shape"], report["targets"], report["kvlb"], report["dynamo"]
    have_dynamo = dynamo.get("available", False)
    ours, theirs = _flat(kvlb), _flat(dynamo) if have_dynamo else {}
    lines = [
        f"kvlb bench index: {shape['replicas']} replicas, {kvlb['held_blocks']:,} held blocks "
        f"({kvlb['unique_blocks']:,} unique), block size {shape['block_size']}, "
        f"{shape['prompt_blocks']}-block prompts, mix {report['mix']}",
        f"{'metric':<44}{'kvlb':>12}{'target':>11}{'dynamo':>12}{'kvlb/dynamo':>13}",
    ]
    for label, name, target_name, digits in _ROWS:
        mine, other = ours.get(name), theirs.get(name)
        target = targets.get(target_name) if target_name else None
        ratio = None if not mine or not other else mine / other
        lines.append(
            f"{label:<44}{_num(mine, digits):>12}{_num(target, digits):>11}"
            f"{_num(other, digits) if have_dynamo else '-':>12}{_num(ratio, 2):>13}"
        )
    match = kvlb["match_us"]
    lines.append(
        f"apply with evictions: {_num(kvlb['apply_evicting_blocks_per_s'], 0)} blocks/s; "
        f"match among all (no filter) p50 {_num(match['unfiltered']['p50'])} µs; "
        + "; ".join(f"{kind} p50 {_num(v['p50'])} µs" for kind, v in match["by_kind"].items())
    )
    lines.append(f"memory estimate from stats(): {_num(kvlb['bytes_per_block_estimate'])} B/held block")
    lines.append(
        "machine speed: 1M empty Python loop iterations took "
        + " then ".join(f"{_num(ms)} ms" for ms in report["calibration_loop_ms"])
        + " (start, end; a shared machine slows every figure alike)"
    )
    if have_dynamo:
        lines.append(f"dynamo: ai-dynamo-runtime {dynamo['version']} (its apply excludes token hashing)")
    else:
        lines.append(f"dynamo: {dynamo.get('reason', 'not installed')}")
    return "\n".join(lines)


def _flat(side: dict[str, Any]) -> dict[str, float | None]:
    match = side["match_us"]
    return {
        "apply": side["apply_blocks_per_s"],
        "apply_cpu": side.get("apply_blocks_per_cpu_s"),
        "match_p50": match["p50"],
        "match_p99": match["p99"],
        "match_cpu_p50": match.get("cpu", {}).get("p50"),
        "traced": side.get("bytes_per_block"),
        "rss": side.get("rss_bytes_per_block"),
        "hash16": side["hash_8k_ms"]["16"],
        "hash32": side["hash_8k_ms"]["32"],
    }
