"""Frames captured from real SGLang 0.5.23 and vLLM 0.32.0 engines (``tests/golden/real/``).

Every frame must decode with no error; every engine hash must be explained by the engine's own hash
function recomputed from the decoded tokens; router keys must chain parent → child exactly as if
computed from the whole prefix; and replaying a folder into the in-memory index must leave it
holding exactly the blocks the stream says are live.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sglang_encoder import sglang_page_digests

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder, page_hashes
from balancer.events import Cleared, KvEvent, Removed, Stored
from balancer.index.hashing import BlockHasher, chain_keys
from balancer.types import BlockKey, ReplicaId, to_u64

REAL_DIR = Path(__file__).parent / "real"
SGLANG_DIR = REAL_DIR / "sglang-0.5.23-cpu"
VLLM_DIR = REAL_DIR / "vllm-0.32.0-cpu"
FOLDERS = [SGLANG_DIR, VLLM_DIR]
FRAME_FILES = sorted(path for folder in FOLDERS for path in folder.glob("*.hex"))
MODEL = "capture-model"


def read_frames(path: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in path.read_text().split()]


def decode_folder(folder: Path) -> Iterator[tuple[Path, DecodedBatch]]:
    decoder = SglangDecoder()
    for path in sorted(folder.glob("*.hex")):
        yield path, decoder.decode(read_frames(path))


def stored_events(folder: Path) -> Iterator[Stored]:
    for _, batch in decode_folder(folder):
        yield from (event for event in batch.events if isinstance(event, Stored))


def block_tokens(event: Stored, index: int) -> list[int]:
    values = array("I")
    start = 4 * index * event.block_size
    values.frombytes(event.tokens[start : start + 4 * (event.block_size + event.lookahead_tokens)])
    return values.tolist()


def test_captures_are_present() -> None:
    assert len(list(SGLANG_DIR.glob("*.hex"))) >= 20
    assert len(list(VLLM_DIR.glob("*.hex"))) >= 14


@pytest.mark.parametrize("path", FRAME_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FRAME_FILES])
def test_every_frame_decodes_cleanly(path: Path) -> None:
    batch = SglangDecoder().decode(read_frames(path))

    assert batch.errors == ()
    assert batch.ignored == 0
    assert batch.events
    assert batch.dp_rank == 0 and batch.epoch is None
    assert batch.seq == int(path.stem.rsplit("frame", 1)[1]) - 1  # frameNNN was seq NNN - 1
    for event in batch.events:
        if isinstance(event, Stored):
            assert len(event.tokens) == 4 * event.block_count * event.block_size
            assert event.lookahead_tokens == 0 and event.lora_name is None and event.cache_salt is None


def test_every_sglang_hash_is_its_sha256_page_hash() -> None:
    """SGLang: first 8 bytes (signed) of SHA-256(prior page digest || LE u32 tokens)."""
    digests: dict[int, bytes] = {}
    explained = 0
    for event in stored_events(SGLANG_DIR):
        prior = None if event.parent is None else digests[event.parent]
        for index, engine_hash in enumerate(event.engine_hashes):
            (digest,) = sglang_page_digests(block_tokens(event, index), event.block_size, prior=prior)
            assert to_u64(int.from_bytes(digest[:8], "big", signed=True)) == engine_hash
            digests[engine_hash] = prior = digest
            explained += 1
    assert explained > 100


_VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_every_vllm_hash_is_its_sha256_block_hash() -> None:
    """vLLM (per the captures' README): low 64 bits of SHA-256(pickle((parent digest, tokens, None)))."""
    digests: dict[int, bytes] = {}
    explained = 0
    for event in stored_events(VLLM_DIR):
        prior = _VLLM_NONE_HASH if event.parent is None else digests[event.parent]
        for index, engine_hash in enumerate(event.engine_hashes):
            block = (prior, tuple(block_tokens(event, index)), None)
            digest = hashlib.sha256(pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)).digest()
            assert int.from_bytes(digest[-8:], "big") == engine_hash
            digests[engine_hash] = prior = digest
            explained += 1
    assert explained > 20


def _block_size(folder: Path) -> int:
    return next(stored_events(folder)).block_size


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
def test_router_keys_chain_parent_to_child(folder: Path) -> None:
    """Keys chained from the parent's key equal keys computed over the whole prefix from the root."""
    hasher = BlockHasher(MODEL, _block_size(folder))
    key_of: dict[int, BlockKey] = {}
    prefix_of: dict[int, list[int]] = {}
    for event in stored_events(folder):
        seed = hasher.root_seed() if event.parent is None else key_of[event.parent]
        prefix = [] if event.parent is None else prefix_of[event.parent]
        keys = chain_keys(seed, event.tokens, event.block_size, event.block_count, event.lookahead_tokens)
        for index, (engine_hash, key) in enumerate(zip(event.engine_hashes, keys, strict=True)):
            prefix = prefix + block_tokens(event, index)
            assert hasher.request_keys(prefix)[-1] == key
            assert key_of.setdefault(engine_hash, key) == key  # a re-stored handle keeps its key
            prefix_of[engine_hash] = prefix


class LiveBlocks:
    """What the stream says one cache holds: engine hash → the whole token prefix of the block."""

    def __init__(self) -> None:
        self.prefix_of: dict[int, list[int]] = {}
        self.skipped_stores = 0

    def apply(self, event: KvEvent) -> None:
        if isinstance(event, Cleared):
            self.prefix_of.clear()
        elif isinstance(event, Removed):
            for engine_hash in event.engine_hashes:
                self.prefix_of.pop(engine_hash, None)
        elif isinstance(event, Stored):
            if event.parent is not None and event.parent not in self.prefix_of:
                self.skipped_stores += 1  # its parent was evicted first: the index skips it too
                return
            prefix = [] if event.parent is None else self.prefix_of[event.parent]
            for index, engine_hash in enumerate(event.engine_hashes):
                prefix = prefix + block_tokens(event, index)
                self.prefix_of[engine_hash] = prefix


async def assert_index_holds(index: Any, replica: ReplicaId, hasher: BlockHasher, live: LiveBlocks) -> None:
    """The index holds exactly the live blocks, and each live chain matches up to its first gap."""
    live_keys = {hasher.request_keys(prefix)[-1] for prefix in live.prefix_of.values()}
    assert (await index.stats()).held_blocks == len(live_keys)
    for prefix in live.prefix_of.values():
        keys = hasher.request_keys(prefix)
        expected = next((depth for depth, key in enumerate(keys) if key not in live_keys), len(keys))
        overlap = await index.match(keys, None, 1e6)
        assert overlap.of(replica) == expected


@pytest.mark.parametrize("folder", FOLDERS, ids=[f.name for f in FOLDERS])
async def test_replaying_a_folder_into_the_index_is_consistent(folder: Path) -> None:
    memory = pytest.importorskip("balancer.index.memory")
    hasher = BlockHasher(MODEL, _block_size(folder))
    index = memory.MemoryIndex(hasher)
    replica = ReplicaId("captured")
    live = LiveBlocks()
    stored_blocks = skipped = most_live = 0
    for step, (_, batch) in enumerate(decode_folder(folder)):
        result = await index.apply(replica, batch.events, float(step))
        stored_blocks += result.stored_blocks
        skipped += result.skipped_unknown_parent
        for event in batch.events:
            live.apply(event)
        await assert_index_holds(index, replica, hasher, live)  # after every batch, not just the last
        most_live = max(most_live, len(live.prefix_of))
    assert stored_blocks > 0 and most_live > 0
    assert skipped == live.skipped_stores


def test_kvlbs_sglang_page_hashes_reproduce_every_captured_page_from_its_whole_prefix() -> None:
    """``balancer.engines.sglang.page_hashes`` (what receipts teach under) over each page's whole
    prefix, from the root, gives the hash the real engine published for it."""
    prefixes: dict[int, list[int]] = {}
    explained = 0
    for event in stored_events(SGLANG_DIR):
        prefix = [] if event.parent is None else prefixes[event.parent]
        tokens = [token for index in range(event.block_count) for token in block_tokens(event, index)]
        whole = prefix + tokens
        computed = page_hashes(whole, event.block_size)
        assert computed[len(prefix) // event.block_size :] == list(event.engine_hashes)
        for index, engine_hash in enumerate(event.engine_hashes):
            prefixes[engine_hash] = whole[: len(prefix) + (index + 1) * event.block_size]
            explained += 1
    assert explained > 100
