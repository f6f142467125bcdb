"""Unit tests of the SGLang/vLLM ZMQ decoder (``balancer.engines.sglang``): frames, envelopes, event
encodings, hash forms, token layouts, filters and malformed input (fuzzing is in
``test_sglang_decoder_fuzz.py``)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from sglang_frames import SEQ, TOKENS, decode, message, only, stored, u32

from balancer.engines.sglang import SglangDecoder
from balancer.errors import EventDecodeError
from balancer.events import Cleared, Removed, Stored
from balancer.types import U64_MASK

# ----------------------------------------------------------------------------- frames and envelope


def test_three_frames_with_topic_metadata_give_seq_epoch_and_rank() -> None:
    topic = b"kv\x00sgl-kv-epoch=00ff\x00sgl-kv-snapshot=b-9"
    batch = SglangDecoder().decode(message([["AllBlocksCleared"]], 3, topic=topic))
    assert (batch.seq, batch.epoch, batch.dp_rank, batch.timestamp) == (41, "00ff", 3, 1.25)
    assert batch.events == [Cleared(3)]


def test_plain_topic_has_no_epoch() -> None:
    assert SglangDecoder().decode(message([])).epoch is None


def test_two_frame_replay_reply_is_seq_and_payload() -> None:
    batch = SglangDecoder().decode([SEQ, msgpack.packb([2.0, [["AllBlocksCleared"]], 0])])
    assert batch.seq == 41 and batch.epoch is None and batch.events == [Cleared(0)]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame"),
        ([b"x"], "frame"),
        ([b"", b"", b"", b""], "frame"),
        ([b"kv", b"\x00" * 7, msgpack.packb([1.0, []])], "frame"),
        ([b"kv", SEQ, b""], "msgpack"),
        ([b"kv", SEQ, b"\xc1"], "msgpack"),
        ([b"kv", SEQ, msgpack.packb([1.0, []]) + b"\x00"], "msgpack"),
        ([b"kv", SEQ, b"\x92\xa1"], "msgpack"),
        ([b"", b"\xff" * 8, b""], "replay_end"),
        ([b"\xff" * 8, b""], "replay_end"),
        ([b"kv", SEQ, msgpack.packb(7)], "schema"),
        ([b"kv", SEQ, msgpack.packb([1.0])], "schema"),
        ([b"kv", SEQ, msgpack.packb([1.0, {"a": 1}])], "schema"),
        ([b"kv", SEQ, msgpack.packb(["ts", []])], "schema"),
        ([b"kv", SEQ, msgpack.packb([1.0, [], -1])], "schema"),
        ([b"kv", SEQ, msgpack.packb([1.0, [], "0"])], "schema"),
        ([b"kv", SEQ, msgpack.packb({"ts": 1.0})], "schema"),
    ],
)
def test_unusable_messages_raise_event_decode_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        SglangDecoder().decode(frames)
    assert info.value.reason == reason


def test_non_bytes_frames_are_a_frame_error() -> None:
    with pytest.raises(EventDecodeError, match="frame"):
        SglangDecoder().decode(["kv", "x", "y"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("payload", "dp_rank", "event_rank"),
    [
        ([1.0, [["AllBlocksCleared"]]], None, 0),
        ([1.0, [["AllBlocksCleared"]], None], None, 0),
        ([1.0, [["AllBlocksCleared"]], 2], 2, 2),
        ({"ts": 1.0, "events": [["AllBlocksCleared"]], "data_parallel_rank": 1}, 1, 1),
        ({"ts": 1.0, "events": [["AllBlocksCleared"]], "attn_dp_rank": 4}, 4, 4),
        ({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]}, None, 0),
    ],
)
def test_envelopes(payload: Any, dp_rank: int | None, event_rank: int) -> None:
    batch = SglangDecoder().decode([b"", SEQ, msgpack.packb(payload)])
    assert batch.dp_rank == dp_rank
    assert batch.events == [Cleared(event_rank)]
    assert batch.timestamp == 1.0


# ----------------------------------------------------------------------------- events


def test_positional_and_tagged_map_events_decode_the_same() -> None:
    positional = [stored([-5], TOKENS, 4, 9), ["BlockRemoved", [-5], "GPU"], ["AllBlocksCleared"]]
    tagged = [
        {
            "type": "BlockStored",
            "block_hashes": [-5],
            "parent_block_hash": 9,
            "token_ids": TOKENS,
            "block_size": 4,
        },
        {"type": "BlockRemoved", "block_hashes": [-5]},
        {"type": "AllBlocksCleared"},
    ]
    expected = [
        Stored(2, 9, ((-5) & U64_MASK,), u32(TOKENS), 4),
        Removed(2, ((-5) & U64_MASK,)),
        Cleared(2),
    ]
    assert decode(positional, 2).events == expected
    assert decode(tagged, 2).events == expected


@pytest.mark.parametrize(
    ("wire", "normalised"),
    [
        (-1, U64_MASK),
        (-(1 << 63), 1 << 63),
        ((1 << 64) - 2, (1 << 64) - 2),
        (7, 7),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
        (b"\x01\x02", 0x0102),
        ("9f86d081884c7d659a2feaa0c55ad015", 0x9F86D081884C7D65),
        ("ABC", 0xABC),
    ],
)
def test_hash_forms_normalise_to_u64(wire: Any, normalised: int) -> None:
    event = only(decode([stored([wire], TOKENS, 4, wire)]))
    assert isinstance(event, Stored)
    assert event.engine_hashes == (normalised,) and event.parent == normalised


@pytest.mark.parametrize("bad", [True, 1.5, "", "xyz", "0x12", " 12", b"", [1], {"h": 1}])
def test_bad_hashes_are_malformed_events(bad: Any) -> None:
    batch = decode([["BlockRemoved", [bad]], ["AllBlocksCleared"]])
    assert batch.events == [Cleared(0)] and len(batch.errors) == 1
    assert batch.errors[0].startswith("event 0:")


def test_coalesced_store_keeps_every_block_in_order() -> None:
    tokens = list(range(100, 112))
    event = only(decode([stored([1, 2, 3], tokens, 4)]))
    assert event == Stored(0, None, (1, 2, 3), u32(tokens), 4)


def test_bigram_pairs_become_raw_tokens_plus_one_lookahead() -> None:
    raw = list(range(1, 10))
    pairs = [[raw[j], raw[j + 1]] for j in range(8)]
    event = only(decode([stored([1, 2], pairs, 4)]))
    assert event == Stored(0, None, (1, 2), u32(raw), 4, lookahead_tokens=1)
    assert len(event.tokens) == 4 * (event.block_count * event.block_size + event.lookahead_tokens)


def test_partial_bigram_page_is_dropped() -> None:
    raw = list(range(1, 7))  # 5 pairs: one full page of 4, one partial
    pairs = [[raw[j], raw[j + 1]] for j in range(5)]
    batch = decode([stored([1, 2], pairs, 4)])
    assert batch.events == [Stored(0, None, (1,), u32(raw[:5]), 4, lookahead_tokens=1)]
    assert batch.ignored == 1


@pytest.mark.parametrize(
    "pairs",
    [
        [[1, 2], [3, 4]],
        [[1, 2], [2]],
        [[1, 2], 3],
        [[1, 2, 3], [3, 4]],
        [[1, 2], [2, "x"]],
        [[1, -2], [-2, 3]],
    ],
)
def test_broken_bigram_pairs_are_malformed(pairs: list[Any]) -> None:
    batch = decode([stored([1], pairs, 2)])
    assert batch.events == [] and len(batch.errors) == 1


def test_partial_last_page_is_dropped_and_counted() -> None:
    batch = decode([stored([1, 2, 3], list(range(10)), 4), stored([4], [1, 2], 4)])
    assert batch.events == [Stored(0, None, (1, 2), u32(list(range(8))), 4)]
    assert batch.ignored == 2 and batch.errors == ()


@pytest.mark.parametrize(
    ("hashes", "count"),
    [([1], 5), ([1], 8), ([1, 2], 4), ([1, 2, 3], 8)],
)
def test_inconsistent_token_counts_are_malformed(hashes: list[int], count: int) -> None:
    batch = decode([stored(hashes, list(range(count)), 4), ["AllBlocksCleared"]])
    assert batch.events == [Cleared(0)] and len(batch.errors) == 1


@pytest.mark.parametrize(
    "event",
    [
        ["BlockStored", [1], None, TOKENS],  # too few fields
        stored([], TOKENS),
        stored([1], []),
        stored([1], TOKENS, 0),
        stored([1], TOKENS, True),
        stored([1], [1, 2, 3, -4]),
        stored([1], [1, 2, 3, 1 << 32]),
        stored([1], [1, 2, 3, 4.0]),
        stored([1], "abcd"),
        ["BlockStored", [1], None, TOKENS, 4, None, 7],  # medium not a string
        stored([1], TOKENS, 4, None, 5),  # index 7: neither lora_name nor metadata
        stored([1], TOKENS, 4, None, {"cache_salt": 3}),
        stored([1], TOKENS, 4, None, None, "not-a-list"),
        {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS},  # no block_size
        {"type": "BlockStored", "block_hashes": [1], "token_ids": TOKENS, "block_size": 4, "metadata": []},
        {"type": 5},
        ["BlockRemoved"],
        [],
        None,
        "BlockStored",
        [7, 1, 2],
    ],
)
def test_malformed_events_are_skipped_with_a_reason(event: Any) -> None:
    batch = decode([["AllBlocksCleared"], event, ["BlockRemoved", [3]]])
    assert batch.events == [Cleared(0), Removed(0, (3,))]
    assert len(batch.errors) == 1 and batch.errors[0].startswith("event 1: ")


def test_unknown_tags_are_ignored_and_counted() -> None:
    batch = decode([["Ignored"], {"type": "BlockUpdated", "x": 1}, ["AllBlocksCleared"]])
    assert batch.events == [Cleared(0)] and batch.ignored == 2 and batch.errors == ()


# ----------------------------------------------------------------------------- namespaces and filters


def test_sglang_salted_positional_metadata_at_index_7() -> None:
    event = only(decode([stored([1], TOKENS, 4, None, {"cache_salt": "s1"})]))
    assert isinstance(event, Stored) and event.cache_salt == "s1" and event.lora_name is None


def test_vllm_lora_name_at_index_7_is_not_metadata() -> None:
    event = only(
        decode([stored([1], TOKENS, 4, None, "sql-lora", [["sql-lora"]], 0, "full_attention", None)])
    )
    assert isinstance(event, Stored) and event.lora_name == "sql-lora" and event.cache_salt is None


@pytest.mark.parametrize(
    "extra",
    [
        {"metadata": {"cache_salt": "s2"}},
        {"cache_salt": "s2"},
        {"metadata": {"cache_salt": "s2"}, "cache_salt": "x"},
    ],
)
def test_map_events_carry_the_salt(extra: dict[str, Any]) -> None:
    base = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": TOKENS}
    event = only(decode([{**base, "block_size": 4, **extra}]))
    assert isinstance(event, Stored) and event.cache_salt == "s2"


def test_lora_known_only_by_id_is_ignored() -> None:
    batch = decode([["BlockStored", [1], None, TOKENS, 4, 3, "GPU"]])
    assert batch.events == [] and batch.ignored == 1


def test_extra_keys_beyond_lora_and_salt_cut_the_chain() -> None:
    tokens = list(range(12))
    extra = [["sql-lora"], [["mm", 0]], None]
    batch = decode([stored([1, 2, 3], tokens, 4, None, "sql-lora", extra, 0, "full_attention", None)])
    assert batch.events == [Stored(0, None, (1,), u32(tokens[:4]), 4, lora_name="sql-lora")]
    assert batch.ignored == 1
    cut_at_root = decode([stored([1], TOKENS, 4, None, None, [["mm-hash"]], 0, "full_attention", None)])
    assert cut_at_root.events == [] and cut_at_root.ignored == 1


@pytest.mark.parametrize("medium", ["CPU", "CPU_PINNED", "DISK", "EXTERNAL"])
def test_only_the_gpu_tier_is_kept(medium: str) -> None:
    batch = decode(
        [
            ["BlockStored", [1], None, TOKENS, 4, None, medium],
            ["BlockRemoved", [1], medium],
            {"type": "AllBlocksCleared", "medium": medium},
            ["BlockRemoved", [2], None],
            ["BlockRemoved", [3], "GPU"],
        ]
    )
    assert batch.events == [Removed(0, (2,)), Removed(0, (3,))] and batch.ignored == 3


def vllm_stored(group: int, kind: str | None) -> list[Any]:
    return stored([1], TOKENS, 4, None, None, [None], group, kind, None)


def test_main_full_attention_group_is_learned_from_stores() -> None:
    decoder = SglangDecoder()
    first = decode([["BlockRemoved", [1], "GPU", 1], ["BlockRemoved", [1], "GPU", 0]], decoder=decoder)
    assert first.events == [Removed(0, (1,))] and first.ignored == 1  # before learning: group 0
    batch = decode(
        [
            vllm_stored(0, "sliding_window"),
            vllm_stored(1, "full_attention"),
            vllm_stored(2, "full_attention"),  # a second full group: same hashes, keep one
            ["BlockRemoved", [1], "GPU", 0],
            ["BlockRemoved", [1], "GPU", 1],
        ],
        decoder=decoder,
    )
    assert batch.events == [Stored(0, None, (1,), u32(TOKENS), 4), Removed(0, (1,))]
    assert batch.ignored == 3


def test_group_without_kind_defaults_to_group_zero() -> None:
    batch = decode([vllm_stored(0, None), vllm_stored(1, None)])
    assert len(batch.events) == 1 and batch.ignored == 1


@pytest.mark.parametrize("fields", [("0", None), (0, 5)])
def test_bad_group_fields_are_malformed(fields: tuple[Any, Any]) -> None:
    batch = decode([vllm_stored(*fields)])
    assert batch.events == [] and len(batch.errors) == 1


def test_pool_block_size_drops_short_pages_and_rejects_mismatches() -> None:
    decoder = SglangDecoder(block_size=4)
    batch = decode(
        [stored([1], [1, 2], 2), stored([1, 2], [1, 2, 3, 4], 2), stored([3], TOKENS, 4)], decoder=decoder
    )
    assert batch.events == [Stored(0, None, (3,), u32(TOKENS), 4)]
    assert batch.ignored == 1 and len(batch.errors) == 1
    with pytest.raises(ValueError):
        SglangDecoder(block_size=0)
