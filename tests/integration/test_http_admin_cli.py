"""``kvlb admin`` against a running balancer (the CLI runs in a thread; the server on the test loop)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from kvlb_harness import MODEL, running, shared_deepseek

from balancer.cli.main import main
from balancer.tokenizer.tokenizer import Tokenizer


@pytest.fixture
def tokenizer() -> Tokenizer:
    return shared_deepseek()


async def test_kvlb_admin_commands(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}))
    token_file = tmp_path / "token"
    token_file.write_text("root\n")
    async with running(tokenizer, 2, auth__admin_token="root") as h:

        async def cli(*args: str, token: tuple[str, ...] = ("--token", "root")) -> tuple[int, str, str]:
            code = await asyncio.to_thread(main, ["admin", "--url", h.url, *token, *args])
            captured = capsys.readouterr()
            return code, captured.out, captured.err

        code, out, _ = await cli("replicas")
        assert code == 0 and [r["id"] for r in json.loads(out)["replicas"]] == ["r0", "r1"]
        code, out, _ = await cli("explain", str(request))
        decision = json.loads(out)["decision"]
        assert code == 0 and {t["replica"] for t in decision["terms"]} == {"r0", "r1"}
        assert (
            decision["policy"] == "cost"
            and decision["request_blocks"] == json.loads(out)["prompt_tokens"] // 4
        )
        drain = ("drain", "r0", "--reason", "node maintenance", "--actor", "alice")
        code, out, _ = await cli(*drain, token=("--token-file", str(token_file)))
        answer = json.loads(out)
        assert code == 0 and (answer["replica"], answer["draining"]) == ("r0", True)
        health = (await h.replica_view("r0"))["health"]
        assert health["draining"] is True
        assert (health["drain"]["by"], health["drain"]["reason"]) == ("alice", "node maintenance")
        assert health["drain"]["caller"].startswith("token:") and "root" not in health["drain"]["caller"]
        code, out, _ = await cli("replicas", "--table")  # who drained it, under the table
        assert code == 0 and "r0: drained by alice (token:" in out and " s ago: node maintenance\n" in out
        code, out, _ = await cli("undrain", "r0")
        assert code == 0 and json.loads(out)["draining"] is False
        code, out, _ = await cli(
            "policy", "set", "name=least_load", "kv_usage_ceiling=null", "queue_weight=2"
        )
        policy = json.loads(out)
        assert code == 0 and policy["name"] == "least_load" and policy["version"] == 2
        assert policy["weights"]["kv_usage_ceiling"] is None and policy["weights"]["queue_weight"] == 2.0
        code, out, err = await cli("policy", "set", "overlap_credit=7")
        assert code == 1 and "HTTP 400" in err and "overlap_credit" in err
        code, out, err = await cli("policy", "get", token=())
        assert code == 1 and "HTTP 401" in err
        code, out, err = await cli("drain", "nope")
        assert code == 1 and "HTTP 404" in err

        # The call's options may follow the action too, and one given before it is kept.
        after = await asyncio.to_thread(main, ["admin", "replicas", "--url", h.url, "--token", "root"])
        assert after == 0 and [r["id"] for r in json.loads(capsys.readouterr().out)["replicas"]] == [
            "r0",
            "r1",
        ]
        code = await asyncio.to_thread(
            main,
            ["admin", "--url", h.url, "policy", "get", "--token-file", str(token_file), "--timeout-s", "5"],
        )
        assert code == 0 and json.loads(capsys.readouterr().out)["name"] == "least_load"
        code = await asyncio.to_thread(
            main, ["admin", "--url", h.url, "--token", "root", "audit", "--token-file", "x"]
        )
        assert code == 2 and capsys.readouterr().err == "kvlb admin: give --token or --token-file, not both\n"
