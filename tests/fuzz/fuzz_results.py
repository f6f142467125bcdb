"""For ``make faults``: fuzzing figures go to ``$KVLBTEST_RESULTS`` (then docs/reliability.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def save_result(name: str, data: dict[str, object]) -> None:
    directory = os.environ.get("KVLBTEST_RESULTS")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / f"{name}.json").write_text(json.dumps(data, indent=1))
