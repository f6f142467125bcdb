"""Engines started with an API key (vLLM's and SGLang's ``--api-key``), on real sockets: the emulated
engines refuse every guarded call without ``Authorization: Bearer <key>`` (401), as the engines do,
and a real balancer reads the key from a file or an environment variable named in its config.

* with the right key every call kvlb makes passes: requests, health probes, the load scrape
  (SGLang's ``/get_load`` is guarded), TRT-LLM's ``/kv_cache_events`` drain (its blocks reach the
  index); ``/admin/replicas`` says where the key came from, never the key;
* with a wrong key the replica is out of routing (its ``/v1/models`` refuses the key) and the client
  gets a 503 naming the key's source, the replica's scrape ``last_error`` names it too, and the key
  is in no answer;
* the loader refuses a key written in the config, a missing variable, an empty file, both sources.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
import zmq.asyncio
from emulated_replica import started
from kvlb_harness import MODEL, replica_entry, wait_ready

from balancer.app import Balancer
from balancer.config import load
from balancer.errors import ConfigError
from balancer.tokenizer.tokenizer import TokenIdTokenizer
from replicas.sim.config import ReplicaConfig
from replicas.sim.profiles import get_profile

KEY = "sk-engine-4f1c2b9e"
WRONG = "sk-not-the-engines-77aa"
BODY = {"model": MODEL, "prompt": list(range(1, 65)), "max_tokens": 2, "temperature": 0}


def engine(name: str, kind: str, api_key: str | None) -> ReplicaConfig:
    return ReplicaConfig(
        name=name,
        engine=kind,  # type: ignore[arg-type]
        profile=get_profile("cpu-test"),
        time_scale=20.0,
        page_size=16 if kind == "vllm" else None,  # the prompt's blocks: vLLM's default of 128 is more
        api_key=api_key,
    )


@asynccontextmanager
async def balancer_for(
    tmp_path: Path, entries: list[dict[str, Any]], pool: dict[str, Any], env: dict[str, str]
) -> AsyncIterator[Balancer]:
    tree = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": [{"model": MODEL, "replicas": entries, **pool}],
        "health_interval_s": 0.1,
        "scrape_interval_s": 0.1,
        "policy": {"name": "round_robin"},
    }
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    balancer = Balancer(load(path, env=env), tokenizers={MODEL: TokenIdTokenizer()})
    await balancer.start()
    try:
        yield balancer
    finally:
        await balancer.stop()


async def admin_replicas(session: aiohttp.ClientSession, url: str) -> tuple[str, dict[str, Any]]:
    async with session.get(url + "/admin/replicas") as response:
        assert response.status == 200
        text = await response.text()
    return text, {r["id"]: r for r in (await response.json())["replicas"]}


@pytest.mark.parametrize("kind", ["sglang", "vllm", "trtllm"])
async def test_every_call_to_a_keyed_engine_carries_its_key(tmp_path: Path, kind: str) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n", encoding="utf-8")
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("keyed", kind, KEY), zctx) as replica, aiohttp.ClientSession() as session:
            async with session.post(replica.url + "/v1/completions", json=BODY) as response:
                assert response.status == 401  # the emulator refuses a call without the key
                assert await response.json() == {"error": "Unauthorized"}
            # SGLang: the replica's own file; vLLM: a variable; TRT-LLM: the pool's default
            entry = replica_entry(replica)
            pool: dict[str, Any] = {}
            if kind == "sglang":
                entry["api_key_file"] = str(key_file)
            elif kind == "vllm":
                entry["api_key_env"] = "ENGINE_KEY"
            else:
                pool["api_key_file"] = str(key_file)
            async with balancer_for(tmp_path, [entry], pool, {"ENGINE_KEY": KEY}) as balancer:
                await wait_ready(session, balancer.url)
                for _ in range(3):
                    async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
                        assert response.status == 200, await response.text()
                async with asyncio.timeout(10):
                    while True:
                        text, replicas = await admin_replicas(session, balancer.url)
                        view = replicas["keyed"]
                        scrape = view["scrape"]
                        blocks = view["index"]["blocks"]
                        if scrape["scrapes"] >= 2 and scrape["last_ok_wall_ts"] and blocks > 0:
                            break
                        await asyncio.sleep(0.05)
                assert scrape["errors"] == 0, scrape
                assert view["health"]["probe_ok"] and view["health"]["last_error"] is None
                assert KEY not in text
                source = "api_key_env ENGINE_KEY" if kind == "vllm" else f"api_key_file {key_file}"
                assert view["api_key"] == source
    finally:
        zctx.destroy(linger=0)


async def key_refused(session: aiohttp.ClientSession, url: str) -> bool:
    return (await admin_replicas(session, url))[1]["keyed"]["health"]["key_refused"] is not None


@pytest.mark.parametrize("kind", ["sglang", "trtllm"])
async def test_a_wrong_key_is_a_clear_502_and_the_replicas_last_error_names_it(
    tmp_path: Path, kind: str
) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(WRONG, encoding="utf-8")
    zctx = zmq.asyncio.Context()
    try:
        async with started(engine("keyed", kind, KEY), zctx) as replica, aiohttp.ClientSession() as session:
            entry = {**replica_entry(replica), "api_key_file": str(key_file)}
            async with balancer_for(tmp_path, [entry], {}, {}) as balancer:
                # its /health passes, its /v1/models refuses the key: out of routing, saying why
                # (before 2026-12-01, h-usage: routable, and each request a 502 naming the key file)
                async with asyncio.timeout(10):
                    while not await key_refused(session, balancer.url):  # noqa: ASYNC110 - another server
                        await asyncio.sleep(0.05)
                async with session.post(balancer.url + "/v1/completions", json=BODY) as response:
                    assert response.status == 503, await response.text()
                    message = (await response.json())["error"]["message"]
                assert f"engine refuses kvlb's key (api_key_file {key_file})" in message
                assert WRONG not in message
                async with asyncio.timeout(10):
                    while True:
                        text, replicas = await admin_replicas(session, balancer.url)
                        scrape = replicas["keyed"]["scrape"]
                        if scrape["last_error"] is not None:
                            break
                        await asyncio.sleep(0.05)
                assert "refusing kvlb's API key (from api_key_file" in scrape["last_error"]
                assert WRONG not in text
    finally:
        zctx.destroy(linger=0)


def write_config(tmp_path: Path, entry: dict[str, Any], pool: dict[str, Any] | None = None) -> Path:
    base = {"id": "r0", "url": "http://127.0.0.1:9"}
    tree = {"pools": [{"model": MODEL, "replicas": [{**base, **entry}], **(pool or {})}]}
    path = tmp_path / "kvlb.yaml"
    path.write_text(yaml.safe_dump(tree), encoding="utf-8")
    return path


def test_the_loader_reads_the_key_and_never_shows_it(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text(f"  {KEY}\n", encoding="utf-8")
    settings = load(write_config(tmp_path, {"api_key_file": str(key_file)}), env={})
    replica = settings.pools[0].replicas[0]
    assert replica.api_key is not None and replica.api_key.value == KEY
    assert KEY not in repr(settings) and KEY not in str(replica.api_key)
    by_env = load(write_config(tmp_path, {}, {"api_key_env": "K"}), env={"K": KEY})
    assert by_env.pools[0].replicas[0].api_key == by_env.pools[0].api_key  # the pool's default
    assert by_env.pools[0].api_key is not None and by_env.pools[0].api_key.value == KEY


@pytest.mark.parametrize(
    ("entry", "env", "said"),
    [
        ({"api_key": KEY}, {}, "never written in the config"),
        ({"api_key_env": "K"}, {}, "api_key_env K: the environment variable is not set"),
        ({"api_key_env": "K"}, {"K": "  "}, "api_key_env K is empty"),
        ({"api_key_env": "K"}, {"K": KEY + "\r\nX-Evil: 1"}, "other than printable ASCII"),
        ({"api_key_env": "K", "api_key_file": "/nonexistent"}, {"K": KEY}, "not both"),
        ({"api_key_file": "/nonexistent/key"}, {}, "cannot read api_key_file /nonexistent/key"),
    ],
)
def test_the_loader_refuses_a_bad_key_setting_without_showing_the_key(
    tmp_path: Path, entry: dict[str, Any], env: dict[str, str], said: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load(write_config(tmp_path, entry), env=env)
    assert said in str(caught.value)
    assert KEY not in str(caught.value)
