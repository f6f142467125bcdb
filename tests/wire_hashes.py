"""Engine block-hash chains for building expected events in tests (test-only, pure).

* :func:`sglang_page_hashes`: SGLang's page hashes of a whole prompt, chained with the emulator's own
  :func:`replicas.wire.sglang.page_digest` (the per-page recipe the emulator publishes with).
* :func:`vllm_block_hash`, :func:`vllm_block_hashes`: vLLM's ``sha256`` prefix-cache hash (CPU
  build): ``digest = SHA-256(pickle((parent_digest or NONE_HASH, tuple(tokens), extra_keys),
  protocol=5))``, event hash = last 8 digest bytes, **unsigned** u64; ``NONE_HASH = SHA-256(pickle(
  "vllm-none-hash", protocol=5))``. Protocols 0-4 reproduce none of the captured hashes; 5 reproduces
  all (``tests/unit/test_wire_sglang.py`` checks every captured hash).

Nothing outside the tests needs them, so they live here rather than in the emulator.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from itertools import pairwise
from typing import Final

from replicas.wire.sglang import digest_to_i64, page_digest, salt_seed

VLLM_PICKLE_PROTOCOL: Final = 5
"""The pickle protocol vLLM's ``sha256`` block hasher uses (``pickle.HIGHEST_PROTOCOL`` on 3.8+)."""
VLLM_NONE_HASH: Final[bytes] = hashlib.sha256(
    pickle.dumps("vllm-none-hash", protocol=VLLM_PICKLE_PROTOCOL)
).digest()
"""The parent digest vLLM chains the first block of a request to."""


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


def vllm_block_hash(
    parent_digest: bytes | None,
    block_tokens: Sequence[int],
    *,
    extra_keys: tuple[object, ...] | None = None,
) -> tuple[int, bytes]:
    """``(u64 event hash, digest)`` of one vLLM block (CPU build, ``sha256`` prefix-cache hash).

    ``parent_digest`` is the parent's full 32-byte digest (``None``: first block of the request).
    ``extra_keys`` is the block's key tuple (LoRA name, cache salt on block 0, ...), ``None`` when empty.
    """
    parent = VLLM_NONE_HASH if parent_digest is None else parent_digest
    payload = (parent, tuple(int(token) for token in block_tokens), extra_keys)
    digest = hashlib.sha256(pickle.dumps(payload, protocol=VLLM_PICKLE_PROTOCOL)).digest()
    return int.from_bytes(digest[-8:], "big"), digest


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
