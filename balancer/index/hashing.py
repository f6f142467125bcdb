"""Router-owned block keys (pure).

A block key is XXH3-64 over the block's token ids as little-endian u32, **seeded with the parent's
key**; the root block is seeded with the namespace seed, itself an XXH3-64 of the pool's model name,
LoRA name and cache salt. So a key identifies the whole prefix up to and including its block, and two
namespaces never share keys.

Only full blocks are hashed. Three alignment modes match what the engines cache:

* ``plain``: blocks of ``block_size`` tokens (SGLang, vLLM).
* ``trtllm``: TRT-LLM caches over ``prompt[:-1]``, so the last prompt token is left out.
* ``bigram``: SGLang EAGLE pages hold ``block_size`` token pairs; page ``j`` spans tokens
  ``[j*bs, j*bs + bs + 1)``, so a prompt of N tokens has ``(N - 1) // bs`` full pages.

Requests share long prefixes (a system prompt, earlier turns), so the request path hashes through a
:class:`KeyMemo`: the keys of each run of :data:`MEMO_CHUNK_BLOCKS` blocks, looked up by an XXH3-128
of the run's bytes seeded with the key before the run. A key is a function of exactly those two, so
a memoised run gives the keys hashing would give; a shared 8k-token prefix then costs 16 lookups
instead of 512 block hashes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import xxhash

from balancer.types import BlockKey

_xxh3 = xxhash.xxh3_64_intdigest
_xxh3_128 = xxhash.xxh3_128_intdigest

MEMO_CHUNK_BLOCKS = 32
"""Blocks per memoised run of keys (:class:`KeyMemo`): 512 tokens at block size 16. A prefix is reused
in whole runs, so up to this many blocks past the last full shared run are hashed again."""

NAMESPACE_SEED = 0x6B766C62  # "kvlb": the seed of the namespace hash itself
"""Fixed seed for namespace hashing, so keys are stable across processes and releases."""

AlignMode = Literal["plain", "trtllm", "bigram"]
_ALIGN_MODES: frozenset[str] = frozenset(get_args(AlignMode))


def namespace_seed(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """Root seed for a (model, LoRA, salt) namespace; fields are NUL-separated so they cannot alias."""
    text = f"{model}\x00{lora_name or ''}\x00{cache_salt or ''}"
    return _xxh3(text.encode("utf-8"), seed=NAMESPACE_SEED)


TOKEN_ID_BYTES = 4
"""Bytes one token id takes in flight, as :func:`compact_ids` keeps it (``array('I')``)."""


def compact_ids(token_ids: Sequence[int]) -> array[int]:
    """Token ids as one ``array('I')`` (4 bytes an id, no int object each, not tracked by the
    garbage collector); raises ``OverflowError``/``TypeError`` on bad ids. :func:`pack_tokens` of the
    result is one copy of its bytes."""
    if type(token_ids) is array and token_ids.typecode == "I":
        return token_ids
    return array("I", token_ids)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32 bytes; raises ``OverflowError``/``TypeError`` on bad ids."""
    if type(token_ids) is array and token_ids.typecode == "I" and _LITTLE_ENDIAN:
        return token_ids.tobytes()  # already packed (compact_ids)
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        raise RuntimeError("array('I') is not 32-bit on this platform")
    return packed.tobytes() if _LITTLE_ENDIAN else _byteswapped(packed)


def _byteswapped(packed: array[int]) -> bytes:  # pragma: no cover - big-endian hosts only
    packed.byteswap()
    return packed.tobytes()


_LITTLE_ENDIAN = array("I", [1]).tobytes()[0] == 1


def chain_keys(
    seed: int, tokens: bytes | memoryview, block_size: int, count: int, lookahead_tokens: int = 0
) -> list[BlockKey]:
    """Keys of ``count`` consecutive blocks in packed ``tokens``, chained from ``seed``.

    ``seed`` is the parent's key, or the namespace seed for a root block. Block ``i`` covers bytes
    ``[4*i*bs, 4*((i+1)*bs + lookahead))``. The caller guarantees ``tokens`` is long enough.
    """
    # Hot path (a 8k-token prompt is 512 blocks of 16): slicing ``bytes`` is cheaper than slicing a
    # memoryview, the seed is passed positionally, and BlockKey (a NewType, identity at run time) is
    # applied once to the list instead of once per key.
    data = tokens if isinstance(tokens, bytes) else bytes(tokens)
    step = 4 * block_size
    span = step + 4 * lookahead_tokens
    end = count * step
    keys: list[int] = []
    append = keys.append
    key = seed
    for start, stop in zip(range(0, end, step), range(span, end + span, step), strict=True):
        key = _xxh3(data[start:stop], key)
        append(key)
    return cast("list[BlockKey]", keys)


def full_blocks(token_count: int, block_size: int, mode: AlignMode) -> int:
    """How many full blocks a prompt of ``token_count`` tokens has in ``mode``."""
    if mode == "plain":
        return token_count // block_size
    # trtllm drops the last token; bigram has token_count - 1 pair units: same count
    return max(token_count - 1, 0) // block_size


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes the block keys of one pool: model namespace, block size and alignment mode."""

    model: str
    block_size: int
    mode: AlignMode = "plain"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.mode not in _ALIGN_MODES:
            raise ValueError(f"mode must be one of {sorted(_ALIGN_MODES)}, got {self.mode!r}")

    def root_seed(self, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """The seed of a root block in this pool's namespace (plus an optional LoRA and salt)."""
        return namespace_seed(self.model, lora_name, cache_salt)

    @property
    def lookahead_tokens(self) -> int:
        return 1 if self.mode == "bigram" else 0

    def request_keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        memo: KeyMemo | None = None,
    ) -> list[BlockKey]:
        """Keys of every full block of a prompt, as the engine of this pool would cache it.

        When at least one block is full, every id is validated (``OverflowError`` outside
        ``[0, 2**32)``, ``TypeError`` if not an int), including those of the unhashed partial tail.
        With ``memo``, runs of blocks hashed before are looked up instead (the same keys).
        """
        count = full_blocks(len(token_ids), self.block_size, self.mode)
        if count == 0:
            return []
        # Packing the whole prompt is cheaper than slicing it first; chain_keys reads only the
        # ``count`` full blocks (plus the bigram lookahead token).
        seed = self.root_seed(lora_name, cache_salt)
        if memo is None:
            return chain_keys(seed, pack_tokens(token_ids), self.block_size, count, self.lookahead_tokens)
        packed: bytes | memoryview
        if type(token_ids) is array and token_ids.typecode == "I" and _LITTLE_ENDIAN:
            # Already packed (compact_ids): the memo reads the array's own bytes, no 32 kB copy of
            # an 8k-token prompt (its misses copy only the runs they hash).
            packed = memoryview(token_ids).cast("B")
        else:
            packed = pack_tokens(token_ids)
        return memo.keys(seed, packed, self.block_size, count, self.lookahead_tokens)


class KeyMemo:
    """The keys of recently hashed runs of :data:`MEMO_CHUNK_BLOCKS` blocks (pure, bounded).

    An entry is looked up by the XXH3-128 of the run's packed tokens seeded with the key before the
    run (one int: no pair to build and hash on each lookup), and holds the run's keys. The key chain
    makes that key and those tokens determine the keys, so a hit gives exactly what hashing gives
    (barring a 128-bit digest collision, far rarer than the 64-bit key collisions the index already
    accepts). At most ``max_runs`` entries, least recently used out first (about 1.5 kB each: 32
    keys and the digest); ``evictions`` counts them.

    A prompt whose whole runs were all found twice is also kept whole: every key of it, looked up by
    the XXH3-128 of all the bytes its keys read, seeded with the root seed, and its block count,
    which a prompt starting with the first run of a kept one is looked up by. The same prompt again
    is then two digests and one copy of the list (8k tokens: 5-6 µs instead of 18-31), whose keys
    are the chain's for the same reason; a prompt missing a run (a new message) costs what it did,
    and one whose runs are all found computes the whole digest (about 1.4 µs for 8k tokens) to note
    it. At most ``max_runs * MEMO_CHUNK_BLOCKS`` keys listed whole in all, least recently used out
    first (``prompt_evictions``): 8 bytes a key (the runs' key ints are shared), plus the ints of the
    up to 31 keys past a prompt's last whole run and about 200 bytes a prompt (tracemalloc: 6.2 kB
    for a prompt of 509 keys; at the default at most about 1.6 MB for 8k-token prompts, 4 MB for
    the shortest), and two generations of at most ``max_runs`` prompts noted once (about 130 bytes
    each).
    """

    __slots__ = (
        "_heads",
        "_noted",
        "_noted_before",
        "_prompt_keys",
        "_prompts",
        "_runs",
        "evictions",
        "hits",
        "max_runs",
        "misses",
        "prompt_evictions",
    )

    def __init__(self, max_runs: int = 4096) -> None:
        if max_runs < 0:
            raise ValueError(f"max_runs must be >= 0, got {max_runs}")
        self.max_runs = max_runs
        self._runs: dict[int, tuple[BlockKey, ...]] = {}
        self._prompts: dict[tuple[int, int], tuple[int, tuple[BlockKey, ...]]] = {}
        """Prompts kept whole: (digest of the bytes their keys read, block count) -> (the digest of
        their first run, every key)."""
        self._heads: dict[int, int] = {}
        """First runs' digests of the prompts kept whole -> how many of them start with it."""
        self._noted: set[tuple[int, int]] = set()
        self._noted_before: set[tuple[int, int]] = set()
        """Prompts whose runs were all found once (two generations of at most ``max_runs``)."""
        self._prompt_keys = 0
        """Keys listed by ``_prompts`` in all."""
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.prompt_evictions = 0

    def __len__(self) -> int:
        return len(self._runs)

    def keys(
        self, seed: int, packed: bytes | memoryview, block_size: int, count: int, lookahead_tokens: int = 0
    ) -> list[BlockKey]:
        """:func:`chain_keys` of ``count`` blocks of ``packed`` from ``seed``, whole runs from the memo
        (``packed``: bytes, or a byte view of them that stays unchanged during the call)."""
        run_bytes = 4 * block_size * MEMO_CHUNK_BLOCKS
        extra = 4 * lookahead_tokens
        whole_runs = count // MEMO_CHUNK_BLOCKS if self.max_runs else 0
        view = memoryview(packed)
        read = count * 4 * block_size + extra  # every byte the keys read
        head = _xxh3_128(view[: run_bytes + extra], seed) if whole_runs else 0
        prompt = None
        if whole_runs and head in self._heads:  # a prompt kept whole starts with this run
            # the same bytes from the same seed give the same keys
            prompt = (_xxh3_128(view[:read], seed), count)
            known = self._prompts.pop(prompt, None)
            if known is not None:
                self._prompts[prompt] = known  # re-inserted: the dict's order is the LRU order
                self.hits += whole_runs
                return list(known[1])
        runs = self._runs
        pop = runs.pop
        keys: list[BlockKey] = []
        extend = keys.extend
        key = seed
        missed = 0
        for start in range(0, whole_runs * run_bytes, run_bytes):
            span = view[start : start + run_bytes + extra]
            ident = _xxh3_128(span, key)  # the run's digest seeded with the key before it
            found = pop(ident, None)  # re-inserted below: the dict's order is the LRU order
            if found is None:
                missed += 1
                found = tuple(chain_keys(key, bytes(span), block_size, MEMO_CHUNK_BLOCKS, lookahead_tokens))
                if len(runs) >= self.max_runs:
                    del runs[next(iter(runs))]
                    self.evictions += 1
            runs[ident] = found
            extend(found)
            key = found[-1]
        self.misses += missed
        self.hits += whole_runs - missed
        rest = count - whole_runs * MEMO_CHUNK_BLOCKS
        if rest:
            tail = packed[whole_runs * run_bytes :]
            extend(chain_keys(key, tail, block_size, rest, lookahead_tokens))
        if whole_runs and not missed:  # every run found: kept whole at the second time
            if prompt is None:
                prompt = (_xxh3_128(view[:read], seed), count)
            if self._noted_again(prompt):
                self._keep_prompt(prompt, head, tuple(keys))
        return keys

    def _noted_again(self, prompt: tuple[int, int]) -> bool:
        """Whether ``prompt`` was noted before; notes it."""
        if prompt in self._noted or prompt in self._noted_before:
            return True
        self._noted.add(prompt)
        if len(self._noted) >= self.max_runs:
            self._noted_before, self._noted = self._noted, set()
        return False

    def _keep_prompt(self, prompt: tuple[int, int], head: int, keys: tuple[BlockKey, ...]) -> None:
        limit = self.max_runs * MEMO_CHUNK_BLOCKS
        prompts = self._prompts
        if len(keys) > limit or prompt in prompts:
            return
        prompts[prompt] = (head, keys)
        heads = self._heads
        heads[head] = heads.get(head, 0) + 1
        self._prompt_keys += len(keys)
        while self._prompt_keys > limit:
            dropped_head, dropped = prompts.pop(next(iter(prompts)))
            self._prompt_keys -= len(dropped)
            self.prompt_evictions += 1
            if heads[dropped_head] == 1:
                del heads[dropped_head]
            else:
                heads[dropped_head] -= 1
