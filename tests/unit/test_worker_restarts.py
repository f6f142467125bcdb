"""The supervisor's restart pacing and crash-loop rule (pure), the record the workers read it from,
and the ``workers`` settings section."""

from __future__ import annotations

from pathlib import Path

import pytest

from balancer.config import WorkersConfig, load
from balancer.errors import ConfigError
from balancer.worker_record import WorkerRecord, crash_loop_reasons, read_record, write_record
from balancer.worker_restarts import crash_looping, exits_kept, recent_exits, restart_delay_s

CONFIG = WorkersConfig(
    restart_backoff_s=0.5, max_restart_backoff_s=30.0, restart_window_s=60.0, crash_loop_exits=3
)


def test_the_delay_doubles_with_each_exit_within_the_window_up_to_its_cap() -> None:
    assert [restart_delay_s(n, CONFIG) for n in range(1, 9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert restart_delay_s(10_000, CONFIG) == 30.0


def test_exits_age_out_of_the_window() -> None:
    exits = [100.0, 130.0, 150.0]
    assert recent_exits(exits, 150.0, 60.0) == 3
    assert recent_exits(exits, 170.0, 60.0) == 2  # the first is 70 s old
    assert recent_exits(exits, 210.0, 60.0) == 0  # a quiet window: back to the first delay


def test_a_crash_loop_is_k_exits_within_the_window_or_k_failed_starts_in_a_row() -> None:
    assert not crash_looping(2, 0, CONFIG)
    assert crash_looping(3, 0, CONFIG)  # served in between: still a loop
    assert crash_looping(1, 3, CONFIG)  # never served, however slowly it failed
    assert exits_kept(CONFIG) == 64 and exits_kept(WorkersConfig(crash_loop_exits=100)) == 100


def test_the_record_says_which_worker_loops_at_the_time_of_asking(tmp_path: Path) -> None:
    record = WorkerRecord((4, 0), (0, 0), 3, ((10.0, 20.0, 30.0), ()), 60.0)
    write_record(str(tmp_path), record)
    read = read_record(str(tmp_path))
    assert read == record
    assert read is not None and read.crash_looping(35.0) == [0]
    assert crash_loop_reasons(read, 35.0) == [
        "worker 0 is in a crash loop: it exited 3 times in the last 60 s (4 restarts); the other "
        "workers serve"
    ]
    assert read.crash_looping(75.0) == []  # the first exit left the window
    failing = WorkerRecord((5, 0), (5, 0), 3, ((), ()), 60.0)
    assert crash_loop_reasons(failing, 0.0) == [
        "worker 0 is in a crash loop: it exited 5 times in a row before serving (5 restarts); the other "
        "workers serve"
    ]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("workers.restart_window_s=0", "workers.restart_window_s must be in (0, 86400]"),
        ("workers.crash_loop_exits=0", "workers.crash_loop_exits must be in [1, 1000]"),
        ("workers.max_restart_backoff_s=0.1", "workers.max_restart_backoff_s must be in"),
        ("workers.restart_backoff_s=-1", "workers.restart_backoff_s must be in [0, 60]"),
    ],
)
def test_bad_workers_settings_are_refused_naming_the_field(setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load(None, [setting], env={})


def test_a_settings_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    config = tmp_path / "kvlb.yaml"
    config.write_bytes(b"log_level: \xff\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load(str(config), [], env={})
