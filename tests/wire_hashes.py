"""Engine block-hash chains for building expected events in tests (test-only, pure).

* :func:`sglang_page_hashes`: SGLang's page hashes of a whole prompt, chained with the emulator's own
  :func:`replicas.wire.sglang.page_digest` (the per-page recipe the emulator publishes with).
* :func:`vllm_block_hash`, :func:`vllm_block_hashes`: vLLM's ``sha256`` prefix-cache hash (CPU
  build), chained over a whole prompt with the emulator's per-block recipe
  (:func:`replicas.wire.vllm.block_hash`, which the vLLM personality publishes with);
  ``tests/unit/test_wire_sglang.py`` checks it on every captured hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Final

from replicas.wire.sglang import digest_to_i64, page_digest, salt_seed
from replicas.wire.vllm import NONE_HASH, PICKLE_PROTOCOL, block_hash

VLLM_PICKLE_PROTOCOL: Final = PICKLE_PROTOCOL
VLLM_NONE_HASH: Final[bytes] = NONE_HASH


def sglang_page_hashes(
    tokens: Sequence[int],
    page_size: int,
    *,
    extra_key: str | None = None,
    bigram: bool = False,
    prior_digest: bytes | None = None,
    cache_salt: str | None = None,
) -> list[tuple[int, bytes]]:
    """``(i64 event hash, digest)`` of every page of ``tokens``, chained from ``prior_digest``.

    ``page_size`` counts units (tokens, or pairs in bigram mode, where N tokens make N-1 pairs). The last
    page may be partial; SGLang hashes and publishes it too. ``cache_salt`` (a request's root pages
    only) starts the chain from SGLang 0.5.23's salt seed rather than from no prior digest.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if cache_salt is not None:
        if prior_digest is not None:
            raise ValueError("a salt seeds a root chain: give cache_salt or prior_digest, not both")
        prior_digest = salt_seed(cache_salt)
    units: list[int] | list[tuple[int, int]]
    units = list(pairwise(tokens)) if bigram else list(tokens)
    pages: list[tuple[int, bytes]] = []
    prior = prior_digest
    for start in range(0, len(units), page_size):
        prior = page_digest(prior, units[start : start + page_size], extra_key)
        pages.append((digest_to_i64(prior), prior))
    return pages


vllm_block_hash = block_hash
"""vLLM's hash of one block: the emulator's own (:func:`replicas.wire.vllm.block_hash`)."""


def vllm_block_hashes(
    tokens: Sequence[int], block_size: int, *, parent_digest: bytes | None = None
) -> list[tuple[int, bytes]]:
    """Chained vLLM hashes of the **full** blocks of ``tokens`` (vLLM never hashes a partial block)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    blocks: list[tuple[int, bytes]] = []
    prior = parent_digest
    for start in range(0, len(tokens) - block_size + 1, block_size):
        value, prior = vllm_block_hash(prior, tokens[start : start + block_size])
        blocks.append((value, prior))
    return blocks
