"""``kvlb serve --workers 2`` in front of a ``kvlb emulate --api-key`` replica whose key rotates: the
key file is updated (the kubelet's ``..data`` symlink swap, then a rename), then the emulator is
restarted on the same ports with the new key. Requests succeed again within a bounded time on both
workers (each polls the file itself), without a restart of kvlb, and the key is in no log line.

Its time is the processes' starts (a supervisor and two workers, three emulator starts: the whole
pytest run took 6.5-9 s of CPU), not its waits: each recovery took 0.06-0.32 s (2026-12-01). The key
poll stays at 1 s: the engine restarts within it, so a worker may not have polled yet when the new
engine refuses its old key and re-reads the file then (a path a shorter poll would make rare). The
workers load a word-level tokenizer of two words (the prompts are token ids) rather than the default
DeepSeek-V3 one (0.4 s of CPU each to load), and the emulator runs 20 times faster than the
modelled GPU. One worker is covered in process by ``tests/integration/test_engine_key_rotation.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import tokenizers
import yaml
from key_dir import KeyDir
from serve_harness import MODEL, Child, _spawn, start_serve, stop, wait_ready

KEYS = ("sk-rot-first-11aa", "sk-rot-second-22bb", "sk-rot-third-33cc")
RECOVERY_BOUND_S = 10.0
"""Poll period (1 s) plus the health probe period (0.2 s) plus an emulator start, with room for a
loaded machine."""
CONFIRM_REQUESTS = 12
BODY = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 2, "temperature": 0}


async def start_engine(tmp: Path, key: str, ports: tuple[int, int] | None) -> Child:
    """``kvlb emulate`` with ``--api-key key``; ``ports``: (HTTP, events) of a previous start."""
    args = [
        "emulate", "--replicas", "1", "--engine", "sglang", "--profile", "cpu-test",
        "--time-scale", "20", "--api-key", key, "--tokenizer", "none",
    ]  # fmt: skip
    if ports is not None:
        args += ["--base-port", str(ports[0]), "--event-port-base", str(ports[1])]
    for attempt in range(20):  # the previous engine's ports free within moments
        try:
            child = await _spawn(f"engine-{key[-4:]}-{attempt}", args, tmp, '"replicas"')
        except AssertionError:
            if ports is None or attempt == 19:
                raise
            await asyncio.sleep(0.25)
            continue
        child.info = child.info["replicas"][0]
        return child
    raise AssertionError("unreachable")


def small_tokenizer(tmp: Path) -> Path:
    """A word-level ``tokenizer.json`` of two words: a worker loads it at once (the requests' prompts
    are token ids, which no tokenizer reads)."""
    path = tmp / "tokenizer.json"
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.save(str(path))
    return path


def ports_of(engine: Child) -> tuple[int, int]:
    return int(engine.info["url"].rsplit(":", 1)[1]), int(engine.info["events"][0].rsplit(":", 1)[1])


async def fresh_status(url: str) -> int:
    """One completion on a new connection (the kernel hands it to either worker)."""
    completions = url + "/v1/completions"
    async with aiohttp.ClientSession() as session, session.post(completions, json=BODY) as response:
        await response.read()
        return response.status


async def seconds_until_every_request_succeeds(url: str) -> float:
    """Seconds until the first of ``CONFIRM_REQUESTS`` successes in a row on fresh connections
    (both workers' keys rotated, the replica back in both), all within ``RECOVERY_BOUND_S``. The
    workers recover apart: one that read the new key while the old engine ran left it as refusing
    its key until a probe after the restart, so its requests are 503 for a moment after the
    other's first success (seen in .ci/run on 2026-12-01: ``[200, 200, 503, 200, 503, 200, ...]``)."""
    start = time.monotonic()
    streak_start = start
    streak = 0
    statuses: list[int] = []
    try:
        async with asyncio.timeout(RECOVERY_BOUND_S):
            while streak < CONFIRM_REQUESTS:
                status = await fresh_status(url)
                statuses = [*statuses[-31:], status]
                if status != 200:
                    streak = 0
                    await asyncio.sleep(0.05)
                    continue
                if streak == 0:
                    streak_start = time.monotonic()
                streak += 1
    except TimeoutError:
        raise AssertionError(f"no {CONFIRM_REQUESTS} successes in a row: {statuses}") from None
    return streak_start - start


async def test_a_rotated_key_reaches_every_worker_without_a_restart(tmp_path: Path) -> None:
    workers = 2
    (tmp_path / "keys").mkdir()
    keys = KeyDir(tmp_path / "keys", KEYS[0])
    engine = await start_engine(tmp_path, KEYS[0], None)
    serve: Child | None = None
    try:
        replica = {
            "id": engine.info["name"],
            "url": engine.info["url"],
            "engine": "sglang",
            "block_size": engine.info["block_size"],
            "events": engine.info["events"][0],
            "replay": engine.info["replay"][0],
            "api_key_file": str(keys.path),
        }
        config = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": [{"model": MODEL, "tokenizer": str(small_tokenizer(tmp_path)), "replicas": [replica]}],
            "health_interval_s": 0.2,
            "upstream": {"api_key_poll_s": 1.0},
        }
        path = tmp_path / "kvlb.yaml"
        path.write_text(yaml.safe_dump(config))
        extra = ["--workers", str(workers)] if workers > 1 else []
        serve = await start_serve(tmp_path, path, *extra)
        url = serve.info["url"]
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, url)
        assert await seconds_until_every_request_succeeds(url) < RECOVERY_BOUND_S
        ports = ports_of(engine)
        for key, how in ((KEYS[1], keys.swap), (KEYS[2], keys.rename)):
            how(key)  # the file first (the Secret), then the engine restarted with the new key
            await stop(engine)
            engine = await start_engine(tmp_path, key, ports)
            took = await seconds_until_every_request_succeeds(url)
            assert took < RECOVERY_BOUND_S, took
    finally:
        if serve is not None:
            await stop(serve)
        await stop(engine)
    log = serve.stderr.read_text(errors="replace") if serve is not None else ""
    assert "engine key from api_key_file" in log
    assert not any(key in log for key in KEYS)
