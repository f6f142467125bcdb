"""kvlb's reproduction of TRT-LLM's ``v1_block_key`` hash against the emulator's transcription."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from balancer.engines.trtllm import SPEC, v1_block_hashes
from replicas.wire.trtllm import trtllm_block_hashes


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.sampled_from([1, 4, 32]))
def test_v1_block_hashes_are_the_emulators_for_every_full_block(tokens: list[int], per_block: int) -> None:
    expected = [h for h, block in trtllm_block_hashes(tokens, per_block) if len(block) == per_block]
    assert v1_block_hashes(tokens, per_block) == expected


def test_only_full_blocks_are_hashed_and_the_spec_offers_the_hash() -> None:
    assert v1_block_hashes(list(range(7)), 4) == v1_block_hashes(list(range(4)), 4)
    assert SPEC.block_hashes is v1_block_hashes
    with pytest.raises(ValueError):
        v1_block_hashes([1], 0)
