"""In-process micro-benchmark of the console's series at its widest window, one and two workers.

Not part of ``kvlb bench``: a probe of ``SeriesSampler`` and ``merge_series`` alone, for comparing
two revisions (run it with ``PYTHONPATH`` at each one's tree: it also runs on a tree from before
2026-12-01, whose sampler kept a sample of 256 TTFTs per interval and had no ``ttft_histograms``).

Each worker's ring: 180 intervals of 5 s (15 minutes, the console's widest window), ``--requests``
requests per interval (default 1,000) over 8 replicas, TTFTs lognormal (median 0.2 s, σ 1).
Figures, each the median of ``--repeats`` calls after a first read (which computes the closed rows):

* ``public``: ``GET /admin/series?minutes=15`` of one worker (all that ``--workers 1`` answers):
  the answer's bytes and the ms to build and encode it;
* ``sibling``: what a worker sends the gathering one (with ``ttft_histograms=1`` where the tree
  has it): bytes and ms to build and encode;
* ``gather``: the gathering worker's work with two workers: build its own answer, parse the
  sibling's, merge the two (``merge_series``) and encode the result: ms, and the result's bytes.

    PYTHONPATH=$PWD python loadtests/bench/series_micro.py [--requests 1000] [--repeats 30]
"""

from __future__ import annotations

import argparse
import inspect
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from balancer import strict_json
from balancer.service.series import SeriesSampler, merge_series

INTERVAL_S = 5.0
INTERVALS = 180
REPLICAS = 8
START = 1_000_000.0


def filled(seed: int, requests: int) -> SeriesSampler:
    """A ring of :data:`INTERVALS` intervals with ``requests`` requests each."""
    taken = inspect.signature(SeriesSampler.__init__).parameters
    args: tuple[Any, ...] = (INTERVAL_S, INTERVALS, 256, REPLICAS) if "ttft_samples" in taken else (
        INTERVAL_S, INTERVALS, REPLICAS)  # fmt: skip
    sampler = SeriesSampler(*args)
    rng = random.Random(seed)
    for k in range(INTERVALS):
        for j in range(requests):
            wall = START + INTERVAL_S * (k + j / requests)
            sampler.on_commit(f"r{rng.randrange(REPLICAS)}", 4000, rng.choice([0, 2000, 3900]), wall)
            sampler.on_ttft(rng.lognormvariate(-1.6, 1.0), wall)
            sampler.on_usage(4000, rng.choice([0, 2000]), wall)
    return sampler


def median_ms(call: Callable[[], bytes], repeats: int) -> tuple[float, bytes]:
    """The median time of ``repeats`` calls (ms) and the last call's bytes."""
    times = []
    out = b""
    for _ in range(repeats):
        started = time.perf_counter()
        out = call()
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per interval and worker")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    histograms = "ttft_histograms" in inspect.signature(SeriesSampler.series).parameters
    asked: dict[str, Any] = {"ttft_histograms": True} if histograms else {}
    own, other = filled(0, args.requests), filled(1, args.requests)
    wall = START + INTERVAL_S * INTERVALS - 0.1
    minutes = INTERVALS * INTERVAL_S / 60.0

    def public() -> bytes:
        return strict_json.dumps(own.series(minutes, wall)).encode()

    def sibling() -> bytes:
        return strict_json.dumps(other.series(minutes, wall, **asked)).encode()

    started = time.perf_counter()
    public()
    first_ms = (time.perf_counter() - started) * 1000.0
    sibling()
    public_ms, public_body = median_ms(public, args.repeats)
    sibling_ms, sibling_body = median_ms(sibling, args.repeats)

    def gather() -> bytes:
        answers = [own.series(minutes, wall, **asked), strict_json.loads(sibling_body)]
        return strict_json.dumps(merge_series(answers)).encode()

    gather_ms, merged = median_ms(gather, args.repeats)
    print(
        f"histograms={histograms} requests/interval={args.requests} first_read_ms={first_ms:.1f} "
        f"public_bytes={len(public_body)} public_ms={public_ms:.2f} "
        f"sibling_bytes={len(sibling_body)} sibling_ms={sibling_ms:.2f} "
        f"gather_ms={gather_ms:.2f} merged_bytes={len(merged)}"
    )


if __name__ == "__main__":
    main()
