"""The numeric flag checks the capacity tools share (pure): one line naming the flag, as a ``ValueError``.

``kvlb capacity``, ``kvlb simulate``, ``kvlb tune`` and ``kvlb loadtest`` refuse a count below 1 or a
rate that is not a finite positive number with the same words, before any work (exit 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def refuse_below_one(counts: Mapping[str, int | None]) -> None:
    """``ValueError`` naming the first flag of ``counts`` (flag → value; ``None``: not given) below 1."""
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def refuse_not_above(flag: str, value: float | None, bound: float, unit: str = "") -> None:
    """``ValueError`` naming ``flag`` when ``value`` (``None``: not given) is not a finite number above
    ``bound``; ``unit`` (e.g. ``"req/s"``) is said in parentheses."""
    if value is not None and not (math.isfinite(value) and value > bound):
        said = f" ({unit})" if unit else ""
        raise ValueError(f"{flag} must be a finite number > {bound:g}{said}, got {value}")
