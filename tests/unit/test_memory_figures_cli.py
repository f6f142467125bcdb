"""``python -m loadtests.memory_figures``'s arguments: a clear usage error, not a traceback."""

from __future__ import annotations

import pytest

from loadtests import memory_figures


@pytest.mark.parametrize(
    "argv",
    [
        ["nosuch"],
        ["ids", "nosuch"],
        ["tokenizer", "x"],
        ["tokenizer-one", "text"],
        ["tokenizer-one", "text", "bogus", "10"],
    ],
)
def test_arguments_it_does_not_take_get_the_usage_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert memory_figures.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("memory_figures: ") and "usage: python -m loadtests.memory_figures" in err


def test_help_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert memory_figures.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: ")
