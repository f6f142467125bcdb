"""Golden byte fixtures for the SGLang/vLLM decoder (``tests/golden/sglang/``).

The fixtures are checked in. These tests decode them and compare with their JSON sidecars, check
that the encoder still produces exactly those bytes (so neither side drifts silently), and pin the
docs/reference/engine-events.md §1.4 example to its published hex and SGLang's real page hashes.
"""

from __future__ import annotations

import json
from array import array
from typing import Any

import msgpack
import pytest
from sglang_cases import FIXTURE_DIR, cases, fixture_paths, hex_text, sidecar_text
from sglang_encoder import (
    SPEC_SGLANG_HASHES,
    SPEC_SGLANG_HEX,
    Case,
    sglang_page_hashes,
)

from balancer.engines import DecodedBatch
from balancer.engines.sglang import SglangDecoder
from balancer.events import Cleared, KvEvent, Removed, Stored
from balancer.types import to_u64

CASES = cases()
CASE_IDS = [case.name for case in CASES]


def load_frames(name: str) -> list[bytes]:
    text = (FIXTURE_DIR / f"{name}.hex").read_text()
    return [bytes.fromhex(line) for line in text.splitlines()]


def load_expected(name: str) -> dict[str, Any]:
    expected: dict[str, Any] = json.loads((FIXTURE_DIR / f"{name}.json").read_text())["expected"]
    return expected


def unpack_u32(tokens: bytes) -> list[int]:
    values = array("I")
    values.frombytes(tokens)
    return values.tolist()


def event_view(event: KvEvent) -> dict[str, Any]:
    """An event in the sidecar's JSON shape."""
    if isinstance(event, Stored):
        return {
            "kind": "stored",
            "dp_rank": event.dp_rank,
            "parent": event.parent,
            "engine_hashes": list(event.engine_hashes),
            "tokens": unpack_u32(event.tokens),
            "block_size": event.block_size,
            "lookahead_tokens": event.lookahead_tokens,
            "lora_name": event.lora_name,
            "cache_salt": event.cache_salt,
        }
    if isinstance(event, Removed):
        return {"kind": "removed", "dp_rank": event.dp_rank, "engine_hashes": list(event.engine_hashes)}
    if isinstance(event, Cleared):
        return {"kind": "cleared", "dp_rank": event.dp_rank}
    raise AssertionError(f"unexpected event {event!r}")


def batch_view(batch: DecodedBatch) -> dict[str, Any]:
    return {
        "seq": batch.seq,
        "timestamp": batch.timestamp,
        "dp_rank": batch.dp_rank,
        "epoch": batch.epoch,
        "ignored": batch.ignored,
        "errors": len(batch.errors),
        "events": [event_view(event) for event in batch.events],
    }


@pytest.mark.parametrize("name", CASE_IDS)
def test_fixture_decodes_to_its_sidecar(name: str) -> None:
    batch = SglangDecoder().decode(load_frames(name))
    assert batch_view(batch) == load_expected(name)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_encoder_still_produces_the_checked_in_fixture(case: Case) -> None:
    hex_path, json_path = fixture_paths(case)
    assert hex_path.read_text() == hex_text(case.frames), "run: python tests/golden/sglang_cases.py --write"
    assert json_path.read_text() == sidecar_text(case)


def test_every_fixture_file_belongs_to_a_case() -> None:
    on_disk = {path.name for path in FIXTURE_DIR.iterdir()}
    expected = {path.name for case in CASES for path in fixture_paths(case)}
    assert on_disk == expected


def test_spec_example_bytes_are_the_published_hex() -> None:
    assert load_frames("spec-sglang-array")[2] == bytes.fromhex(SPEC_SGLANG_HEX)


def test_spec_example_decodes_to_exactly_the_listed_events() -> None:
    listed = msgpack.unpackb(bytes.fromhex(SPEC_SGLANG_HEX))
    h1, h2 = SPEC_SGLANG_HASHES
    assert listed[1][0][1] == [h1] and listed[1][1][2] == h1  # the listing is what the hex says

    batch = SglangDecoder().decode([b"", bytes(8), bytes.fromhex(SPEC_SGLANG_HEX)])

    assert batch.errors == () and batch.ignored == 0
    assert batch.timestamp == 1700000000.5 and batch.dp_rank == 0
    first, second, removed, cleared = batch.events
    assert first == Stored(0, None, (to_u64(h1),), array("I", [1, 2, 3, 4]).tobytes(), 4)
    assert second == Stored(0, to_u64(h1), (to_u64(h2),), array("I", [5, 6, 7, 8]).tobytes(), 4)
    assert removed == Removed(0, (to_u64(h2),))
    assert cleared == Cleared(0)
    assert to_u64(h1) == h1 + (1 << 64) and to_u64(h1) > (1 << 63)


def test_spec_hashes_are_sglangs_real_page_hashes() -> None:
    h1, h2 = SPEC_SGLANG_HASHES
    assert sglang_page_hashes([1, 2, 3, 4], 4) == [h1]
    # §1.4 says h2 hashes page [5, 6, 7, 8]; it is really the chained hash of the one-token page
    # [5] (the §2.4 golden). The example's token_ids are illustrative; the decoder keeps them as sent.
    assert sglang_page_hashes([1, 2, 3, 4, 5], 4) == [h1, h2]
    assert sglang_page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)[1] != h2
    # the other goldens quoted in docs/reference/engine-events.md §2.4
    assert sglang_page_hashes([10, 20, 30, 40], 4, bigram=True) == [-2735951481331064195]
    assert sglang_page_hashes([1, 2, 3, 4, 5, 6], 4, bigram=True) == [
        -638950109823820341,
        3604587133525381017,
    ]
    assert sglang_page_hashes([1, 2, 3, 4], 4, extra_key="salt-A") == [1848708812856982025]


def test_bigram_fixture_hashes_are_sglangs() -> None:
    (stored,) = SglangDecoder().decode(load_frames("sglang-bigram")).events
    assert isinstance(stored, Stored)
    tokens = unpack_u32(stored.tokens)
    expected = sglang_page_hashes(tokens, stored.block_size, bigram=True)
    assert list(stored.engine_hashes) == [to_u64(h) for h in expected]
    assert len(tokens) == stored.block_count * stored.block_size + 1
