"""vLLM's prefix-cache block hash, for the emulator's vLLM personality (pure: no I/O, no clock).

vLLM's KV events share SGLang's ZMQ framing and msgspec event schema, so their bytes come from
:class:`replicas.wire.sglang.KvEventEncoder` with ``flavor="vllm"``; this module adds only the hash the
vLLM 0.32 CPU build publishes (``prefix_caching_hash_algo="sha256"``, tests/golden/real/README.md):
``digest = SHA-256(pickle((parent_digest or NONE_HASH, tuple(tokens), extra_keys), protocol=5))``, the
event hash is the digest's **last** 8 bytes as an **unsigned** u64, and ``NONE_HASH = SHA-256(pickle(
"vllm-none-hash", protocol=5))``. Protocols 0-4 reproduce none of the captured hashes; 5 reproduces all
of them (``tests/unit/test_wire_sglang.py``). vLLM never hashes a partial block.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Final

PICKLE_PROTOCOL: Final = 5
"""The pickle protocol vLLM's ``sha256`` block hasher uses (``pickle.HIGHEST_PROTOCOL`` on 3.8+)."""
NONE_HASH: Final[bytes] = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=PICKLE_PROTOCOL)).digest()
"""The parent digest vLLM chains the first block of a request to."""


def block_hash(
    parent_digest: bytes | None, block_tokens: Sequence[int], *, extra_keys: tuple[object, ...] | None = None
) -> tuple[int, bytes]:
    """``(u64 event hash, digest)`` of one vLLM block.

    ``parent_digest`` is the parent's full 32-byte digest (``None``: first block of the request).
    ``extra_keys`` is the block's key tuple (LoRA name, cache salt on block 0, ...), ``None`` when empty.
    """
    parent = NONE_HASH if parent_digest is None else parent_digest
    payload = (parent, tuple(int(token) for token in block_tokens), extra_keys)
    digest = hashlib.sha256(pickle.dumps(payload, protocol=PICKLE_PROTOCOL)).digest()
    return int.from_bytes(digest[-8:], "big"), digest
