"""The emulator's TRT-LLM event JSON and V1 block-key hash."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from replicas.wire.trtllm import (
    block_key_hash,
    created,
    encode_drain,
    removed,
    stored,
    trtllm_block_hashes,
    updated,
)

# A transcription of BlockKeyHasher::hash for unsalted, non-LoRA text blocks, written with the C++ types
# of blockKey.cpp so that the compiler (not our Python masks) decides every wrap-around. Reads
# "parent count t1 .. tn" lines on stdin and prints one u64 hash per line.
_CXX_HASHER = r"""
#include <cstdint>
#include <cstdio>
#include <vector>

static std::uint64_t mix32(std::uint32_t a, std::uint64_t seed) {
    a = ((a >> 16) ^ a) * 0x45d9f3b;
    a = ((a >> 16) ^ a) * 0x45d9f3b;
    a = (a >> 16) ^ a;
    return seed ^ (a + 0x9e3779b9 + (seed << 6) + (seed >> 2));
}

int main() {
    unsigned long long parent = 0;
    std::size_t count = 0;
    while (std::scanf("%llu %zu", &parent, &count) == 2) {
        std::vector<std::int32_t> tokens(count);
        for (auto& token : tokens) std::scanf("%d", &token);
        std::uint64_t seed = count ^ static_cast<std::uint64_t>(parent) * UINT64_C(0xbf58476d1ce4e5b9);
        for (auto token : tokens) seed = mix32(static_cast<std::uint32_t>(token), seed);
        std::printf("%llu\n", static_cast<unsigned long long>(seed));
    }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_block_key_hash_matches_compiled_cxx_semantics(tmp_path: Path) -> None:
    source = tmp_path / "hasher.cpp"
    binary = tmp_path / "hasher"
    source.write_text(_CXX_HASHER)
    subprocess.run(["g++", "-O1", "-o", str(binary), str(source)], check=True, timeout=120)
    rng = random.Random(20261122)
    cases: list[tuple[int, list[int]]] = [(0, []), (0, [0]), (0, [-1]), ((1 << 64) - 1, [2**31 - 1, 1])]
    for _ in range(300):
        parent = rng.choice([0, rng.getrandbits(64)])
        tokens = [rng.randrange(0, 129_280) for _ in range(rng.choice([1, 4, 31, 32, 33]))]
        cases.append((parent, tokens))
    stdin = "".join(f"{parent} {len(tokens)} {' '.join(map(str, tokens))}\n" for parent, tokens in cases)
    result = subprocess.run(
        [str(binary)], input=stdin, capture_output=True, text=True, check=True, timeout=60
    )
    expected = [int(line) for line in result.stdout.split()]
    assert [block_key_hash(tokens, parent or None) for parent, tokens in cases] == expected


def test_mix32_wraps_the_combine_constant_at_32_bits() -> None:
    """Token 2 mixes to a u32 above 2**32 - 0x9e3779b9, so only a 32-bit wrap gives the C++ result."""
    mask = (1 << 32) - 1
    mixed = 2
    for _ in range(2):
        mixed = (((mixed >> 16) ^ mixed) * 0x45D9F3B) & mask
    mixed = (mixed >> 16) ^ mixed
    assert mixed + 0x9E3779B9 > mask  # this token exercises the wrap
    seed = 1  # len([2]) ^ (0 * multiplier)
    wrapped = seed ^ (((mixed + 0x9E3779B9) & mask) + (seed << 6) + (seed >> 2))
    unwrapped = seed ^ (mixed + 0x9E3779B9 + (seed << 6) + (seed >> 2))
    assert block_key_hash([2], None) == wrapped != unwrapped


def test_block_key_hash_chains_and_is_u64() -> None:
    first = block_key_hash([1, 2, 3, 4], None)
    assert first == block_key_hash([1, 2, 3, 4], 0)
    second = block_key_hash([5, 6, 7, 8], first)
    assert second != block_key_hash([5, 6, 7, 8], None)
    assert block_key_hash([5, 6, 7], first) != block_key_hash([5, 6, 7, 0], first)  # length is mixed in
    assert all(0 <= value < 1 << 64 for value in (first, second))


def test_trtllm_block_hashes_chain_and_keep_the_partial_block() -> None:
    blocks = trtllm_block_hashes(list(range(10)), 4)
    assert [tokens for _, tokens in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    parent = None
    for block_hash, tokens in blocks:
        assert block_hash == block_key_hash(tokens, parent)
        parent = block_hash
    with pytest.raises(ValueError):
        trtllm_block_hashes([1], 0)


def test_stored_event_shape() -> None:
    big = (1 << 64) - 2
    event = stored(3, big, [(7, [11, 12]), (8, [13])], 4096, dp_rank=1, cache_salt="t")
    assert event == {
        "event_id": 3,
        "data": {
            "type": "stored",
            "parent_hash": big,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 7,
                    "tokens": [
                        {"type": "unique_token", "token_id": 11, "token_extra_id": 0},
                        {"type": "unique_token", "token_id": 12, "token_extra_id": 0},
                    ],
                    "cache_salt": "t",
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [],
                },
                {
                    "type": "stored_block",
                    "block_hash": 8,
                    "tokens": [{"type": "unique_token", "token_id": 13, "token_extra_id": 0}],
                    "cache_salt": "t",
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [],
                },
            ],
        },
        "window_size": 4096,
        "attention_dp_rank": 1,
    }
    assert list(event) == ["event_id", "data", "window_size", "attention_dp_rank"]
    with pytest.raises(ValueError):
        stored(4, None, [], 4096)


def test_other_event_shapes_and_rank_only_with_attention_dp() -> None:
    assert created(0, [100, 0], 4096) == {
        "event_id": 0,
        "data": {"type": "created", "num_blocks_per_cache_level": [100, 0]},
        "window_size": 4096,
    }
    assert removed(5, [-1, 9], 4096, dp_rank=0) == {
        "event_id": 5,
        "data": {"type": "removed", "block_hashes": [(1 << 64) - 1, 9]},
        "window_size": 4096,
        "attention_dp_rank": 0,
    }
    assert updated(6, 9, 4096, cache_level=(0, 1)) == {
        "event_id": 6,
        "data": {
            "type": "updated",
            "block_hash": 9,
            "cache_level": {"type": "event_diff", "new_value": 1, "old_value": 0},
            "priority": None,
        },
        "window_size": 4096,
    }


def test_drain_body_is_compact_json_with_exact_u64() -> None:
    big = (1 << 64) - 1
    body = encode_drain([created(0, [8, 0], 64), removed(1, [big], 64)])
    assert b" " not in body
    assert json.loads(body)[1]["data"]["block_hashes"] == [big]
    assert body.startswith(b'[{"event_id":0,"data":{"type":"created"')
    assert encode_drain([]) == b"[]"
