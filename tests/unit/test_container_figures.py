"""``python -m loadtests.container_figures``: its parts run on the real classes, and an unknown part
gets the usage, not a traceback."""

from __future__ import annotations

import re

import pytest

from loadtests import container_figures


def test_an_unknown_part_gets_the_parts_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert container_figures.main(["nosuch"]) == 2
    assert "parts: segments, limiter" in capsys.readouterr().err


@pytest.mark.usefixtures("frozen_heap")  # its gc.collect() walks only what it made
def test_the_small_parts_print_a_size_an_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert container_figures.main(["limiter", "removed", "receipts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["limiter", "removed", "receipts"]
    for line in lines:
        found = re.search(r": (\d+) B an? ", line)
        assert found is not None and int(found.group(1)) > 0, line
