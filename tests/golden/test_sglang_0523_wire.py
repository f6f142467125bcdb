"""Salted SGLang 0.5.23 events, byte for byte against 0.5.23's struct shapes (msgspec).

docs/reference/engine-events.md §1.3 (checked against the installed sglang 0.5.23 wheel): events are
tagged msgspec maps with ``omit_defaults``; ``BlockStored`` carries a top-level ``cache_salt`` (not a
``metadata`` map), and ``medium``/``cache_salt`` are left out when ``None``; the envelope stays the
positional ``[ts, events, attn_dp_rank]``. The structs below are written from that description. They
are first proven on every real 0.5.23 capture frame (decode, re-encode, same bytes), then used as the
judge of the emulator's encoder (:class:`replicas.wire.sglang.KvEventEncoder`), of the golden fixture
``sglang/sglang-0.5.23-salted.hex`` and of kvlb's decoder.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from sglang_encoder import sglang_page_hashes

from balancer.engines.sglang import SglangDecoder
from balancer.events import Removed, Stored
from replicas.wire.sglang import KvEventEncoder, frames

GOLDEN = Path(__file__).resolve().parent
REAL = GOLDEN / "real" / "sglang-0.5.23-cpu"


class Event(msgspec.Struct, omit_defaults=True, tag=True):
    """0.5.23's event base: a map tagged under ``type``, defaults omitted."""


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(Event):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Batch)


def real_frames() -> list[Path]:
    paths = sorted(REAL.glob("*.hex"))
    assert len(paths) == 20, "the 0.5.23 capture is part of the tree"
    return paths


@pytest.mark.parametrize("path", real_frames(), ids=lambda path: path.name)
def test_the_structs_reproduce_every_real_frame(path: Path) -> None:
    """The structs are 0.5.23's shape: each captured payload round-trips through them unchanged."""
    payload = bytes.fromhex(path.read_text().split()[2])
    assert ENCODER.encode(DECODER.decode(payload)) == payload


def salted_content() -> tuple[list[int], list[int]]:
    root = [value for value in sglang_page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a")]
    plain = sglang_page_hashes([100, 101, 102, 103], 4)
    return root, plain


def test_the_emulator_encoder_writes_0523_salted_bytes() -> None:
    root, plain = salted_content()
    encoder = KvEventEncoder(flavor="sglang", encoding="map")
    ours = encoder.batch(
        15.0,
        [
            encoder.block_stored(root, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a"),
            encoder.block_stored(plain, None, [100, 101, 102, 103], 4, medium=None),
            encoder.block_removed(root[1:], medium=None),
            encoder.all_blocks_cleared(),
        ],
        0,
    )
    theirs = Batch(
        15.0,
        [
            BlockStored(root, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", "tenant-a"),
            BlockStored(plain, None, [100, 101, 102, 103], 4, None),
            BlockRemoved(root[1:]),
            AllBlocksCleared(),
        ],
        0,
    )
    assert ours == ENCODER.encode(theirs)
    decoded = DECODER.decode(ours)  # 0.5.23's own decoder keeps the salt (a metadata map it would drop)
    stored = decoded.events[0]
    assert isinstance(stored, BlockStored) and stored.cache_salt == "tenant-a" and stored.medium == "GPU"
    assert b"metadata" not in ours and b"\xa6medium\xc0" not in ours  # no metadata map, no medium: nil


def test_the_golden_fixture_is_0523_bytes_and_kvlb_reads_the_salt() -> None:
    topic, seq, payload = (
        bytes.fromhex(line) for line in (GOLDEN / "sglang/sglang-0.5.23-salted.hex").read_text().split()
    )
    batch = DECODER.decode(payload)
    assert ENCODER.encode(batch) == payload
    first, second, plain, _removed = batch.events
    assert (
        isinstance(first, BlockStored) and isinstance(second, BlockStored) and isinstance(plain, BlockStored)
    )
    assert (first.cache_salt, second.cache_salt, plain.cache_salt, plain.medium) == (
        "tenant-a",
        "tenant-a",
        None,
        None,
    )
    root, _ = salted_content()
    assert first.block_hashes == root and second.parent_block_hash == root[-1]
    decoded = SglangDecoder(block_size=4).decode([topic, seq, payload])
    assert decoded.errors == () and decoded.ignored == 0
    stored = [event for event in decoded.events if isinstance(event, Stored)]
    assert [event.cache_salt for event in stored] == ["tenant-a", "tenant-a", None]
    assert any(isinstance(event, Removed) for event in decoded.events)


def test_the_emulator_frames_decode_with_kvlb_salt_intact() -> None:
    root, _ = salted_content()
    encoder = KvEventEncoder(flavor="sglang", encoding="map")
    event = encoder.block_stored(root, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a")
    message = frames("kv-events", 3, encoder.batch(1.0, [event], 0))
    decoded = SglangDecoder(block_size=4).decode(message)
    [stored] = decoded.events
    assert isinstance(stored, Stored) and stored.cache_salt == "tenant-a"
    assert list(stored.engine_hashes) == [value & ((1 << 64) - 1) for value in root]
