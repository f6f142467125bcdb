"""``kvlb serve`` encodes in the calling thread: ``tokenizers``' thread pool is off unless the
environment turns it on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from balancer.config import TOKENIZERS_PARALLELISM, one_thread_per_encode

ROOT = Path(__file__).resolve().parents[2]

COUNT_THREADS = """
import os, sys
from balancer.config import one_thread_per_encode
from balancer.tokenizer.default import default_tokenizer
if sys.argv[1] == "serve":
    one_thread_per_encode(os.environ)
tokenizer = default_tokenizer()
for n in range(20):
    tokenizer.encode_prompt(f"Question {n}: " + "the quick brown fox " * 40)
print(len(os.listdir("/proc/self/task")))
"""


def test_the_pool_is_off_unless_the_environment_says_otherwise() -> None:
    environ: dict[str, str] = {}
    one_thread_per_encode(environ)
    assert environ == {TOKENIZERS_PARALLELISM: "false"}
    chosen = {TOKENIZERS_PARALLELISM: "true"}
    one_thread_per_encode(chosen)
    assert chosen == {TOKENIZERS_PARALLELISM: "true"}


def threads_after_encoding(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != TOKENIZERS_PARALLELISM}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", COUNT_THREADS, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(done.stdout.strip())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_encoding_starts_no_pool_threads_in_serve() -> None:
    """With the switch, the process encodes on its one thread; without it, ``tokenizers`` starts its
    pool at the first encode (so the check can tell the two apart)."""
    assert threads_after_encoding("serve") == 1
    assert threads_after_encoding("library default") > 1
