"""kvlb's reproduction of SGLang's page hash against the emulator's (the real captures: golden tests)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_hashes import sglang_page_hashes

from balancer.engines.sglang import SPEC, page_hashes
from balancer.types import to_u64


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.sampled_from([1, 4, 16]))
def test_page_hashes_are_the_emulators_for_every_full_page(tokens: list[int], per_page: int) -> None:
    full = len(tokens) // per_page
    expected = [to_u64(value) for value, _ in sglang_page_hashes(tokens, per_page)[:full]]
    assert page_hashes(tokens, per_page) == expected
    assert page_hashes(array("I", tokens), per_page) == expected  # token ids in flight are arrays


def test_only_full_pages_are_hashed_and_the_spec_offers_the_hash() -> None:
    assert page_hashes(list(range(7)), 4) == page_hashes(list(range(4)), 4)
    assert page_hashes([1, 2, 3], 4) == []
    assert SPEC.block_hashes is page_hashes
    with pytest.raises(ValueError):
        page_hashes([1], 0)
