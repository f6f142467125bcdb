"""Test vectors for the router-owned block keys (balancer.index.hashing).

The literals below were computed once with balancer.index.hashing and are checked here twice: against the
frozen numbers (so a change of the key recipe fails loudly, since every stored index and every Redis
mirror depends on it) and against an independent re-implementation written from the recipe in the
module docstring with ``xxhash.xxh3_64_intdigest`` and ``struct.pack('<I')``.
"""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.index.hashing import (
    MEMO_CHUNK_BLOCKS,
    NAMESPACE_SEED,
    BlockHasher,
    KeyMemo,
    chain_keys,
    compact_ids,
    full_blocks,
    namespace_seed,
    pack_tokens,
)
from balancer.types import BlockKey

T32 = list(range(1, 33))  # 32 tokens: two full blocks of 16
T33 = list(range(1, 34))  # 33 tokens: the 33rd makes the trtllm and bigram second block complete

# The vLLM/SGLang captures' first chat prompt: "<BOS><User>Count to a thousand.<Assistant>".
DEEPSEEK_CHAT = [0, 128803, 8420, 304, 260, 3717, 16, 128804]

SEED_M = 8281153687786225367
SEEDS = {
    ("m", None, None): SEED_M,
    ("m", "lora-a", None): 8936507722156471083,
    ("m", None, "salt-1"): 18151381292924010638,
    ("m", "lora-a", "salt-1"): 16270161809147844927,
    ("deepseek-v3", None, None): 17772453794769345851,
}

# (tokens, block_size, mode, lora, salt) -> keys
VECTORS = [
    (T32, 16, "plain", None, None, [8385535721418533862, 12773786161662662735]),
    (T32, 16, "trtllm", None, None, [8385535721418533862]),
    (T32, 16, "bigram", None, None, [2844299332002546025]),
    (T33, 16, "plain", None, None, [8385535721418533862, 12773786161662662735]),
    (T33, 16, "trtllm", None, None, [8385535721418533862, 12773786161662662735]),
    (T33, 16, "bigram", None, None, [2844299332002546025, 14200981057984937391]),
    (T32, 16, "plain", "lora-a", None, [17816093322339552821, 6183146811305257643]),
    (T32, 16, "plain", None, "salt-1", [2098698865987906409, 910157773705358136]),
    (
        T32,
        8,
        "plain",
        None,
        None,
        [1155163652128196146, 10292264871867792763, 5873245412351823872, 3397955285106422360],
    ),
    (T32, 32, "plain", None, None, [18371598209882544570]),
    ([0xFFFFFFFF, 0, 2**31, 129279], 4, "plain", None, None, [3335419583347888118]),
]


def ref_namespace_seed(model: str, lora: str | None = None, salt: str | None = None) -> int:
    text = model + "\0" + (lora or "") + "\0" + (salt or "")
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"), seed=0x6B766C62)


def ref_keys(
    tokens: list[int],
    block_size: int,
    mode: str,
    lora: str | None = None,
    salt: str | None = None,
    model: str = "m",
) -> list[int]:
    """The key recipe, written out block by block without balancer.index.hashing."""
    cached = tokens if mode == "plain" else tokens[:-1]  # trtllm drops the last token
    count = len(cached) // block_size  # bigram: len(tokens) - 1 pair units, same count
    extra = 1 if mode == "bigram" else 0
    key = ref_namespace_seed(model, lora, salt)
    keys = []
    for i in range(count):
        window = tokens[i * block_size : (i + 1) * block_size + extra]
        key = xxhash.xxh3_64_intdigest(b"".join(struct.pack("<I", t) for t in window), seed=key)
        keys.append(key)
    return keys


def test_xxhash_library_matches_engine_events_goldens() -> None:
    # docs/reference/engine-events.md §5.2: raw XXH3-64 with seed 1337 over little-endian u32 tokens.
    assert xxhash.xxh3_64_intdigest(struct.pack("<4I", 1, 2, 3, 4), seed=1337) == 14643705804678351452
    assert xxhash.xxh3_64_intdigest(struct.pack("<4I", 5, 6, 7, 8), seed=1337) == 16777012769546811212


def test_namespace_seed_constant_spells_kvlb() -> None:
    assert NAMESPACE_SEED.to_bytes(4, "big") == b"kvlb"


@pytest.mark.parametrize(("model", "lora", "salt"), list(SEEDS))
def test_namespace_seed_vectors(model: str, lora: str | None, salt: str | None) -> None:
    assert namespace_seed(model, lora, salt) == SEEDS[(model, lora, salt)]
    assert ref_namespace_seed(model, lora, salt) == SEEDS[(model, lora, salt)]


def test_namespaces_all_differ_and_empty_means_absent() -> None:
    assert len(set(SEEDS.values())) == len(SEEDS)
    assert namespace_seed("m", "", "") == namespace_seed("m") == SEED_M
    # NUL separators: moving text between fields changes the namespace.
    assert namespace_seed("ab") != namespace_seed("a", "b") != namespace_seed("a", None, "b")


@pytest.mark.parametrize(("tokens", "block_size", "mode", "lora", "salt", "expected"), VECTORS)
def test_request_key_vectors(
    tokens: list[int], block_size: int, mode: str, lora: str | None, salt: str | None, expected: list[int]
) -> None:
    keys = BlockHasher("m", block_size, mode).request_keys(tokens, lora, salt)  # type: ignore[arg-type]
    assert keys == expected
    assert ref_keys(tokens, block_size, mode, lora, salt) == expected


def test_deepseek_chat_prompt_vector() -> None:
    keys = BlockHasher("deepseek-v3", 4).request_keys(DEEPSEEK_CHAT)
    assert keys == [15786505326721218939, 11781544756106938853]
    assert ref_keys(DEEPSEEK_CHAT, 4, "plain", model="deepseek-v3") == keys


def test_modes_share_plain_prefix_except_bigram() -> None:
    plain = BlockHasher("m", 16).request_keys(T33)
    assert BlockHasher("m", 16, "trtllm").request_keys(T33) == plain  # same blocks once N-1 is full
    assert BlockHasher("m", 16, "bigram").request_keys(T33)[0] != plain[0]  # 17-token windows


@pytest.mark.parametrize("mode", ["plain", "trtllm", "bigram"])
def test_partial_block_is_ignored(mode: str) -> None:
    hasher = BlockHasher("m", 16, mode)  # type: ignore[arg-type]
    base = hasher.request_keys(T33 + [7] * 10)
    assert hasher.request_keys(T33 + [9] * 10) == base
    assert len(base) == 2


def test_last_token_matters_only_where_the_engine_caches_it() -> None:
    changed = [*T32[:-1], 999]
    assert BlockHasher("m", 16).request_keys(changed)[1] != BlockHasher("m", 16).request_keys(T32)[1]
    # trtllm caches prompt[:-1]: the last token never enters a key.
    trt = BlockHasher("m", 16, "trtllm")
    assert trt.request_keys([*T33[:-1], 999]) == trt.request_keys(T33)
    # bigram page j spans tokens [j*bs, j*bs + bs + 1): token 32 is the lookahead of page 1.
    big = BlockHasher("m", 16, "bigram")
    assert big.request_keys([*T33[:-1], 999])[1] != big.request_keys(T33)[1]
    assert big.request_keys([*T33[:-1], 999])[0] == big.request_keys(T33)[0]


@pytest.mark.parametrize("count", [0, 1, 15])
def test_fewer_tokens_than_a_block_give_no_keys(count: int) -> None:
    assert BlockHasher("m", 16).request_keys(list(range(count))) == []
    assert BlockHasher("m", 16, "trtllm").request_keys(list(range(count + 1))) == []


def test_full_blocks_counts() -> None:
    assert [full_blocks(n, 16, "plain") for n in (0, 15, 16, 17, 32, 33)] == [0, 0, 1, 1, 2, 2]
    assert [full_blocks(n, 16, "trtllm") for n in (0, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
    assert [full_blocks(n, 16, "bigram") for n in (0, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]


def test_chain_keys_continues_from_a_parent_key() -> None:
    """An event's blocks are keyed from their parent: the same chain as the whole prompt."""
    keys = BlockHasher("m", 8).request_keys(T32)
    tail = chain_keys(keys[1], pack_tokens(T32[16:]), 8, 2)
    assert tail == keys[2:]
    assert chain_keys(SEED_M, memoryview(pack_tokens(T32)), 8, 4) == keys
    assert chain_keys(SEED_M, pack_tokens(T32), 8, 0) == []


def test_pack_tokens_is_little_endian_u32() -> None:
    assert pack_tokens([1, 0xFFFFFFFF]) == struct.pack("<2I", 1, 0xFFFFFFFF)
    with pytest.raises(OverflowError):
        pack_tokens([-1])
    with pytest.raises(OverflowError):
        pack_tokens([1 << 32])
    with pytest.raises(TypeError):
        pack_tokens([1.5])  # type: ignore[list-item]


@pytest.mark.parametrize(("tokens", "block_size", "mode", "lora", "salt", "expected"), VECTORS)
def test_compact_ids_hash_as_the_list_does(
    tokens: list[int], block_size: int, mode: str, lora: str | None, salt: str | None, expected: list[int]
) -> None:
    """The request path carries ids as ``array('I')``: same bytes, same keys (memo or not)."""
    compact = compact_ids(tokens)
    assert type(compact) is array and compact.typecode == "I" and compact.tolist() == tokens
    assert compact_ids(compact) is compact  # already compact: no copy
    assert pack_tokens(compact) == pack_tokens(tokens)
    hasher = BlockHasher("m", block_size, mode)  # type: ignore[arg-type]
    assert hasher.request_keys(compact, lora, salt) == expected
    assert hasher.request_keys(compact, lora, salt, KeyMemo()) == expected
    with pytest.raises(OverflowError):
        compact_ids([*tokens, -1])


def test_invalid_ids_are_rejected_even_in_the_partial_tail() -> None:
    with pytest.raises(OverflowError):
        BlockHasher("m", 4).request_keys([1, 2, 3, 4, -1])


@pytest.mark.parametrize(("block_size", "mode"), [(0, "plain"), (-4, "plain"), (16, "eagle")])
def test_bad_hasher_settings_are_rejected(block_size: int, mode: str) -> None:
    with pytest.raises(ValueError):
        BlockHasher("m", block_size, mode)  # type: ignore[arg-type]


def test_hasher_namespace_is_its_model() -> None:
    assert BlockHasher("m", 16).root_seed() == SEED_M
    assert BlockHasher("other", 16).request_keys(T32) != BlockHasher("m", 16).request_keys(T32)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    cut=st.integers(0, 70),
    block_size=st.sampled_from([1, 3, 4, 16]),
    mode=st.sampled_from(["plain", "trtllm", "bigram"]),
)
def test_prefix_property_and_reference(tokens: list[int], cut: int, block_size: int, mode: str) -> None:
    hasher = BlockHasher("m", block_size, mode)  # type: ignore[arg-type]
    keys = hasher.request_keys(tokens)
    assert keys == ref_keys(tokens, block_size, mode)
    prefix_keys = hasher.request_keys(tokens[:cut])
    assert keys[: len(prefix_keys)] == prefix_keys


# ------------------------------------------------------------------------ the key memo


@settings(max_examples=60, deadline=None)
@given(
    heads=st.lists(
        st.lists(st.integers(0, 2**32 - 1), max_size=3 * MEMO_CHUNK_BLOCKS), min_size=1, max_size=3
    ),
    tails=st.lists(st.lists(st.integers(0, 9), max_size=2 * MEMO_CHUNK_BLOCKS), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 2]),
    mode=st.sampled_from(["plain", "trtllm", "bigram"]),
    max_runs=st.sampled_from([0, 1, 2, 64]),
)
def test_the_memo_gives_the_keys_hashing_gives(
    heads: list[list[int]], tails: list[list[int]], block_size: int, mode: str, max_runs: int
) -> None:
    """Prompts sharing prefixes (and tiny memos that evict) hash through the memo to the same keys,
    the fourth time and later as whole prompts."""
    hasher = BlockHasher("m", block_size, mode)  # type: ignore[arg-type]
    memo = KeyMemo(max_runs)
    for round_ in range(5):
        for head in heads:
            for tail in tails:
                prompt = head + tail
                assert hasher.request_keys(prompt, memo=memo) == ref_keys(prompt, block_size, mode)
                salted = hasher.request_keys(prompt, cache_salt="s", memo=memo)
                assert salted == hasher.request_keys(prompt, cache_salt="s"), round_
                compact = compact_ids(prompt)  # read in place through the memo (no packed copy)
                assert hasher.request_keys(compact, memo=memo) == ref_keys(prompt, block_size, mode)
                compact.append(7)  # and no view of it outlives the call (else BufferError)
    assert len(memo) <= max_runs
    assert (
        memo._prompt_keys
        == sum(len(keys) for _, keys in memo._prompts.values())
        <= max_runs * MEMO_CHUNK_BLOCKS
    )
    assert sum(memo._heads.values()) == len(memo._prompts)
    if max_runs == 0:
        assert memo.hits + memo.misses == 0  # off: nothing looked up


@pytest.mark.parametrize("mode", ["plain", "trtllm", "bigram"])
def test_a_prompt_kept_whole_gives_way_to_any_change(mode: str) -> None:
    """A prompt kept whole, then the same prompt with one id changed anywhere its keys read (a
    whole run, the tail, the last token, the bigram's lookahead), one block more or fewer, or
    another seed: always the keys hashing gives, never the kept ones; the same prompt again finds
    them (and a list handed out is the caller's own)."""
    block_size = 4
    hasher = BlockHasher("m", block_size, mode)  # type: ignore[arg-type]
    memo = KeyMemo(64)
    prompt = [(i * 2_654_435_761) % 2**32 for i in range(2 * MEMO_CHUNK_BLOCKS * block_size + 11)]
    for _ in range(4):  # missed, found by runs (noted), found by runs (kept whole), found whole
        keys = hasher.request_keys(compact_ids(prompt), memo=memo)
        assert keys == ref_keys(prompt, block_size, mode)
    assert memo._prompts
    keys.append(BlockKey(0))  # the caller's own list: the kept keys do not change
    assert hasher.request_keys(prompt, memo=memo) == ref_keys(prompt, block_size, mode)
    variants = [prompt[:-1], prompt[:-block_size], [*prompt, 1], [*prompt, *range(block_size)]]
    read = full_blocks(len(prompt), block_size, mode) * block_size  # the first id past the full blocks
    for at in (0, 5, MEMO_CHUNK_BLOCKS * block_size, read - 1, read, read + 1, len(prompt) - 1):
        changed = list(prompt)
        changed[at] ^= 1
        variants.append(changed)
    for variant in variants:
        for _ in range(4):
            assert hasher.request_keys(compact_ids(variant), memo=memo) == ref_keys(variant, block_size, mode)
    for _ in range(4):
        salted = hasher.request_keys(prompt, cache_salt="s", memo=memo)
        assert salted == hasher.request_keys(prompt, cache_salt="s") != ref_keys(prompt, block_size, mode)
    assert hasher.request_keys(prompt, memo=memo) == ref_keys(prompt, block_size, mode)


def test_whole_prompts_are_bounded_in_keys() -> None:
    hasher = BlockHasher("m", 1)
    memo = KeyMemo(3)  # 3 runs, so at most 96 keys listed whole
    for n in range(20):
        prompt = list(range(n * 1000, n * 1000 + 2 * MEMO_CHUNK_BLOCKS))
        for _ in range(4):
            assert hasher.request_keys(prompt, memo=memo) == hasher.request_keys(prompt)
        assert (
            memo._prompt_keys == sum(len(keys) for _, keys in memo._prompts.values()) <= 3 * MEMO_CHUNK_BLOCKS
        )
        heads = {h for h, _ in memo._prompts.values()}
        assert sum(memo._heads.values()) == len(memo._prompts) and set(memo._heads) == heads
    assert memo.prompt_evictions > 0 and memo._prompts


@pytest.mark.parametrize("mode", ["plain", "trtllm", "bigram"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_a_compact_prompt_is_read_in_place_through_the_memo(block_size: int, mode: str) -> None:
    """``array('I')`` ids reach the memo as a byte view of the array: whole runs, a partial last
    run and a tail give the keys hashing gives, hit or miss, and the array is free afterwards."""
    hasher = BlockHasher("m", block_size, mode)  # type: ignore[arg-type]
    memo = KeyMemo()
    head = [(i * 2_654_435_761) % 2**32 for i in range(2 * MEMO_CHUNK_BLOCKS * block_size + 5)]
    for tail in ([], [1, 2, 3], list(range(40, 40 + MEMO_CHUNK_BLOCKS * block_size + 1))):
        prompt = head + tail
        compact = compact_ids(prompt)
        for _ in range(2):  # misses, then hits
            assert hasher.request_keys(compact, memo=memo) == ref_keys(prompt, block_size, mode)
        compact.append(7)  # no view of it outlives the call (else BufferError)
    assert memo.hits > 0


def test_a_shared_prefix_is_hashed_once_and_the_memo_is_bounded() -> None:
    hasher = BlockHasher("m", 16)
    memo = KeyMemo(max_runs=40)
    shared = list(range(16 * MEMO_CHUNK_BLOCKS * 16))  # 16 whole runs: an 8k-token system prompt
    first = hasher.request_keys([*shared, *range(900, 1200)], memo=memo)
    assert (memo.hits, memo.misses) == (0, 16)
    second = hasher.request_keys([*shared, *range(2000, 2300)], memo=memo)
    assert (memo.hits, memo.misses) == (16, 16)
    assert first[: 16 * MEMO_CHUNK_BLOCKS] == second[: 16 * MEMO_CHUNK_BLOCKS]
    assert first[16 * MEMO_CHUNK_BLOCKS :] != second[16 * MEMO_CHUNK_BLOCKS :]
    for start in range(0, 40 * 512, 512):  # one run each, 40 new ones: 16 + 40 runs for 40 places
        hasher.request_keys(list(range(start + 10**6, start + 10**6 + 16 * MEMO_CHUNK_BLOCKS)), memo=memo)
    assert len(memo) == 40 and memo.evictions == 16
    with pytest.raises(ValueError):
        KeyMemo(-1)


def test_a_run_after_another_prefix_is_not_taken_from_the_memo() -> None:
    """The same run of tokens after two different prefixes has different keys (the chain): the memo
    must look a run up by its tokens and the key before it, never by its tokens alone."""
    hasher = BlockHasher("m", 16)
    memo = KeyMemo()
    run = list(range(7, 7 + 16 * MEMO_CHUNK_BLOCKS))
    for head in (
        list(range(100, 100 + 16 * MEMO_CHUNK_BLOCKS)),
        list(range(900, 900 + 16 * MEMO_CHUNK_BLOCKS)),
    ):
        assert hasher.request_keys(head + run, memo=memo) == hasher.request_keys(head + run)
    assert hasher.request_keys(run, memo=memo) == hasher.request_keys(run)  # the run as a root too
    assert (memo.hits, memo.misses) == (0, 5)
