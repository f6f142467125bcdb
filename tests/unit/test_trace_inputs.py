"""Mooncake trace files as a capacity planner gets them: odd but valid records replay, invalid ones are
refused with one line naming the file and line (``read_trace``, ``parse_trace_line``,
``trace_requests``)."""

from __future__ import annotations

import gzip
import itertools
import json
import re
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from loadtests.simulate import trace_requests
from loadtests.workloads.mooncake import MooncakeWorkload, TraceError, parse_trace_line, read_trace

ROWS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 5]},
    {"timestamp": 2000, "input_length": 100, "output_length": 9, "hash_ids": [7]},
]


def _write(tmp_path: Path, rows: list[Any], name: str = "t.jsonl", newline: str = "\n") -> Path:
    path = tmp_path / name
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_bytes(newline.join(lines).encode("utf-8") + newline.encode())
    return path


def _requests(path: Path, **kwargs: Any) -> list[Any]:
    options: dict[str, Any] = {
        "requests": None,
        "rate_per_s": None,
        "seed": 0,
        "max_input_tokens": None,
        "max_tokens_cap": None,
    }
    _, stream = trace_requests(path, **(options | kwargs))
    return list(stream)


def test_gzip_bom_and_crlf_files_read_as_the_plain_file(tmp_path: Path) -> None:
    # before: a gzip file and a BOM were "'utf-8' codec can't decode byte 0x8b" and "Unexpected UTF-8 BOM"
    plain = list(read_trace(_write(tmp_path, ROWS)))
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(_write(tmp_path, ROWS, "g.jsonl").read_bytes()))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + _write(tmp_path, ROWS, "b.jsonl").read_bytes())
    crlf = _write(tmp_path, ROWS, "crlf.jsonl", newline="\r\n")
    assert len(plain) == 3
    for other in (packed, bom, crlf):
        assert list(read_trace(other)) == plain
    assert [len(r.token_ids) for r in _requests(packed)] == [1200, 1100, 100]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"timestamp": 1e400, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
            "timestamp must be a finite",
        ),
        (
            '{"timestamp": true, "input_length": 5, "output_length": 1, "hash_ids": [0]}',
            "timestamp must be a finite",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "input_length must be >= 1",
        ),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "ab"}',
            "hash_ids must be a list",
        ),
        ('{"timestamp": 0, "input_length": 5}', "missing field(s) output_length, hash_ids"),
        ('[{"prompt": "hi"}]', "not a Mooncake record"),
        ("timestamp,input_length", "not JSON"),
    ],
)
def test_a_bad_record_names_the_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    # before: 1e400 raised OverflowError (a traceback out of kvlb simulate and kvlb capacity), true was
    # read as 1, an empty prompt replayed as a 400 at every rate (kvlb capacity: "no rate met the SLO")
    path = _write(tmp_path, [ROWS[0], line])
    with pytest.raises(TraceError) as caught:
        list(read_trace(path))
    assert str(caught.value).startswith(f"{path} line 2: ")
    assert message in str(caught.value)
    with pytest.raises(TraceError):
        parse_trace_line(line)


def test_binary_and_broken_gzip_files_are_one_trace_error(tmp_path: Path) -> None:
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match=f"^{re.escape(str(binary))} line 1: not UTF-8 JSON lines text"):
        list(read_trace(binary))
    broken = tmp_path / "broken.jsonl.gz"
    whole = gzip.compress(_write(tmp_path, ROWS * 400, "many.jsonl").read_bytes())
    broken.write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(
        TraceError, match=f"^{re.escape(str(broken))} line [0-9]+: not UTF-8 JSON lines gzip data"
    ):
        list(read_trace(broken))


def test_unsorted_timestamps_are_refused_by_the_simulator_and_the_replay(tmp_path: Path) -> None:
    # before: the simulator replayed rows at negative virtual times (all at once, the trace's rate "inf")
    path = _write(tmp_path, [ROWS[1], ROWS[0], ROWS[2]])
    with pytest.raises(TraceError, match=r"row 2 .* earlier than the row before it"):
        _requests(path)
    with pytest.raises(TraceError, match="trace row 2: timestamp 0 ms is earlier"):
        list(MooncakeWorkload(path=str(path)).generate(__import__("random").Random(0)))


def test_huge_hash_ids_tile_like_small_ones(tmp_path: Path) -> None:
    # before: one id of 2^32 made any run "too many requests (3) for a tiled trace of 3 rows"
    # ids numbered densely in order of first use replay as they are; huge ids are renumbered so
    dense_rows = [dict(r, hash_ids=ids) for r, ids in zip(ROWS, ([0, 1, 2], [0, 1, 3], [4]), strict=True)]
    small = _requests(_write(tmp_path, dense_rows, "small.jsonl"), requests=9)
    huge_rows = [dict(r, hash_ids=[h * 2**40 + 2**64 for h in r["hash_ids"]]) for r in dense_rows]
    huge = _requests(_write(tmp_path, huge_rows, "huge.jsonl"), requests=9)
    assert [(list(r.token_ids), r.arrival_s) for r in huge] == [
        (list(r.token_ids), r.arrival_s) for r in small
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate_per_s": 0.0}, "rate must be a finite number > 0"),
        ({"rate_per_s": -1.0}, "rate must be a finite number > 0"),
        ({"rate_per_s": float("nan")}, "rate must be a finite number > 0"),
        ({"requests": 0}, "requests must be >= 1"),
        ({"max_tokens_cap": 0}, "max_tokens_cap must be >= 1"),
    ],
)
def test_unusable_numbers_are_refused(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    # before: rate 0 was a ZeroDivisionError, -1 and nan replayed everything at t=0, requests 0 ran nothing
    with pytest.raises(ValueError, match=message):
        _requests(_write(tmp_path, ROWS), **kwargs)


def test_a_rate_for_a_trace_without_a_span_is_refused(tmp_path: Path) -> None:
    # before: --rate was silently ignored and every row arrived at 0
    path = _write(tmp_path, [ROWS[0], dict(ROWS[1], timestamp=0)])
    with pytest.raises(ValueError, match="same timestamp"):
        _requests(path, rate_per_s=5.0)
    assert len(_requests(path)) == 2  # without --rate it replays as it is


def test_a_long_trace_is_streamed_not_held(tmp_path: Path) -> None:
    # before: every row was parsed into a list first: a 1M-line trace held 1.49 GB to simulate 2,000
    # requests. Here: 60k rows, 10 requests drawn; the rows alone would be ~15 MB of TraceRows
    path = tmp_path / "long.jsonl"
    row = '{"timestamp": %d, "input_length": 700, "output_length": 3, "hash_ids": [%d, %d]}\n'
    path.write_text("".join(row % (10 * n, n % 50, 10_000 + n) for n in range(60_000)), "utf-8")
    tracemalloc.start()
    try:
        shape, stream = trace_requests(
            path, requests=None, rate_per_s=20.0, seed=0, max_input_tokens=None, max_tokens_cap=None
        )
        drawn = list(itertools.islice(stream, 10))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert shape.rows == 60_000 and len(drawn) == 10
    assert peak < 3_000_000, peak
