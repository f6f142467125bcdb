"""TRT-LLM decoder: golden drains, message-level errors and the behaviour of each decoding rule
(random streams and fuzzing are in ``test_trtllm_decoder_fuzz.py``).

The goldens in ``tests/golden/trtllm/`` are written by ``FakeTrtllm`` (``trtllm_fake.py``). After a
deliberate change, regenerate them and review the diff::

    .venv/bin/python tests/unit/test_trtllm_decoder.py --write-golden
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from trtllm_fake import (
    GOLDEN_DIR,
    SCENARIOS,
    U64,
    Json,
    _scenario_golden,
    decode,
    event_json,
    partial_hashes,
    summary,
    write_goldens,
)

from balancer.engines.registry import engine_spec
from balancer.engines.trtllm import TrtllmDecoder
from balancer.errors import EventDecodeError
from balancer.events import Removed, Resync, Stored

# --------------------------------------------------------------------------- wire helpers


def event(event_id: int, data: Json, window: int = 4096, rank: int | None = None) -> Json:
    raw: Json = {"event_id": event_id, "data": data, "window_size": window}
    if rank is not None:
        raw["attention_dp_rank"] = rank
    return raw


def stored(parent: object, *blocks: tuple[object, list[object]], **extra: object) -> Json:
    """A ``stored`` data object; each block is (block_hash, token ids); ``extra`` goes on every block."""
    wire = [
        {
            "type": "stored_block",
            "block_hash": block_hash,
            "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens],
            "cache_level": 0,
            "priority": 35,
            **extra,
        }
        for block_hash, tokens in blocks
    ]
    return {"type": "stored", "parent_hash": parent, "blocks": wire}


def removed(*hashes: object) -> Json:
    return {"type": "removed", "block_hashes": list(hashes)}


# --------------------------------------------------------------------------- golden tests


def _golden_files() -> list[Path]:
    return sorted(p for p in GOLDEN_DIR.glob("*.json") if not p.name.endswith(".body.json"))


def test_every_scenario_has_a_golden() -> None:
    names = {p.stem for p in _golden_files()}
    assert set(SCENARIOS) | {"spec_example"} == names


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_is_what_the_encoder_writes(name: str) -> None:
    assert json.loads((GOLDEN_DIR / f"{name}.json").read_text()) == _scenario_golden(name)


@pytest.mark.parametrize("path", _golden_files(), ids=lambda p: p.stem)
def test_golden_decodes_to_expected_events(path: Path) -> None:
    golden = json.loads(path.read_text())
    decoder = TrtllmDecoder(tokens_per_block=golden["tokens_per_block"])
    assert golden["drains"]
    for drain in golden["drains"]:
        if "body_file" in drain:
            frame = (GOLDEN_DIR / drain["body_file"]).read_bytes()
        else:
            frame = json.dumps(drain["body"]).encode()
        batch = decoder.decode([frame])
        assert summary(batch) == drain["expected"], batch.errors
        assert batch.seq is None


def test_spec_example_is_the_verbatim_body() -> None:
    text = (GOLDEN_DIR / "spec_example.body.json").read_text()
    body = json.loads(text)
    assert [e["data"]["type"] for e in body] == ["created", "stored", "removed", "updated"]
    assert body[1]["data"]["blocks"][0]["block_hash"] == 9622824665191806685  # > 2**63: u64 on the wire


# --------------------------------------------------------------------------- message-level errors


def test_default_decoder_takes_an_empty_drain() -> None:
    spec = engine_spec("trtllm")
    decoder = spec.decoder(spec.default_block_size)
    assert decoder.engine == "trtllm"
    batch = decoder.decode([b"[]"])
    assert batch.events == [] and batch.ignored == 0 and batch.errors == ()
    assert TrtllmDecoder().tokens_per_block == 32


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "frame"),
        ([b"[]", b"[]"], "frame"),
        (["[]"], "frame"),
        ([b""], "json"),
        ([b"not json"], "json"),
        ([b"\xff\xfe\xfa"], "json"),
        ([b"[" * 200_000], "json"),
        ([b"1" * 5000], "json"),
        ([b"{}"], "schema"),
        ([b'"[]"'], "schema"),
        ([b"null"], "schema"),
    ],
)
def test_unusable_body_raises(frames: list[Any], reason: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        TrtllmDecoder().decode(frames)
    assert info.value.reason == reason


# --------------------------------------------------------------------------- event-level rules


def test_malformed_events_are_skipped_and_neighbours_kept() -> None:
    decoder = TrtllmDecoder(tokens_per_block=2)
    body = [
        event(0, stored(None, (11, [1, 2]))),
        5,
        {"event_id": "1", "data": removed(11)},
        event(1, stored(None, (12, [1, 2, 3]))),  # 3 tokens > 2: malformed, but id 1 counts
        event(2, {"type": "removed", "block_hashes": 11}),
        event(3, stored(None, (13, [1, True]))),
        event(4, {"type": "updated", "block_hash": 11, "cache_level": {"new_value": 1}}),
        event(5, removed(11)),
    ]
    batch = decode(decoder, body)
    assert [event_json(e) for e in batch.events] == [
        event_json(Stored(0, None, (11,), struct.pack("<2I", 1, 2), 2)),
        {"type": "removed", "dp_rank": 0, "engine_hashes": [11]},
    ]
    assert len(batch.errors) == 6
    assert batch.errors[0].startswith("event 1:") and "3 tokens > tokens_per_block 2" in batch.errors[2]


@pytest.mark.parametrize(
    ("wire", "engine_hash"),
    [
        (-1, U64),
        (-(1 << 63), 1 << 63),
        (U64, U64),
        (9622824665191806685, 9622824665191806685),
        ("ab" * 32, 0xABABABABABABABAB),
        ("00ff", 0xFF),
    ],
)
def test_hashes_normalise_to_u64(wire: object, engine_hash: int) -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    batch = decode(decoder, [event(0, stored(wire, (wire, [7])))])
    assert batch.errors == ("event 0: stored.blocks[0].block_hash repeats its parent or an earlier block",)
    batch = decode(decoder, [event(1, stored(None, (wire, [7]))), event(2, removed(wire))])
    assert [event_json(e)["engine_hashes"] for e in batch.events] == [[engine_hash], [engine_hash]]


@pytest.mark.parametrize("wire", [1 << 64, -(1 << 63) - 1, True, 1.5, "xyz", "", "0x12", None])
def test_bad_hash_is_malformed(wire: object) -> None:
    batch = decode(TrtllmDecoder(tokens_per_block=1), [event(0, stored(None, (wire, [7])))])
    assert batch.events == [] and len(batch.errors) == 1


def test_multimodal_blocks_end_the_chain() -> None:
    decoder = TrtllmDecoder(tokens_per_block=2)
    digest = "5f" * 32
    with_image = stored(None, (4, [1, 2]), (5, [3, 4]))
    with_image["blocks"][1]["mm_keys"] = [{"type": "mm_key", "hash": digest, "start_offset": 0}]
    body = [
        event(0, stored(None, (1, [1, 2]), (2, [digest, 9001]), (3, [9002, 9003]))),  # KV manager V2
        event(1, with_image),  # KV manager V1: the image is in mm_keys
    ]
    batch = decode(decoder, body)
    assert [e.engine_hashes for e in batch.events if isinstance(e, Stored)] == [(1,), (4,)]
    assert batch.ignored == 3 and batch.errors == ()
    assert partial_hashes(decoder) == 0


def test_secondary_level_blocks_are_not_held() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [event(0, stored(None, (1, [1]), (2, [2]), cache_level=1))]
    batch = decode(decoder, body)
    assert batch.events == [] and batch.ignored == 2 and batch.errors == ()


def test_lora_blocks_are_dropped() -> None:
    batch = decode(TrtllmDecoder(tokens_per_block=1), [event(0, stored(None, (1, [1]), lora_id=3))])
    assert batch.events == [] and batch.ignored == 1


def test_larger_window_makes_earlier_blocks_stale() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [
        event(5, stored(None, (1, [1])), window=512, rank=0),
        event(9, stored(None, (1, [1])), window=512, rank=1),
        event(6, stored(None, (2, [2])), window=4096, rank=0),
        event(7, stored(None, (3, [3])), window=512, rank=0),
    ]
    batch = decode(decoder, body)
    assert [event_json(e)["type"] for e in batch.events] == ["stored", "stored", "resync", "resync", "stored"]
    assert batch.events[2:4] == [Resync(0, "stale"), Resync(1, "stale")]
    assert decoder.max_window_size == 4096 and batch.ignored == 1


def test_a_cleared_rank_is_not_stale() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [
        event(0, stored(None, (1, [1])), window=512),
        event(5, stored(None, (2, [2])), window=4096),  # a gap first: the index clears rank 0
    ]
    assert [e for e in decode(decoder, body).events if isinstance(e, Resync)] == [Resync(0, "gap")]


@pytest.mark.parametrize(
    ("old", "new", "removes"), [(0, 1, True), (0, 2, True), (1, 0, False), (1, 2, False), (0, 0, False)]
)
def test_updated_removes_only_what_leaves_the_gpu(old: int, new: int, removes: bool) -> None:
    diff = {"type": "event_diff", "old_value": old, "new_value": new}
    body = [event(0, {"type": "updated", "block_hash": 7, "cache_level": diff, "priority": None})]
    batch = decode(TrtllmDecoder(), body)
    assert batch.events == ([Removed(0, (7,))] if removes else [])
    assert batch.ignored == (0 if removes else 1)


def test_first_event_sets_the_baseline_then_gaps_are_seen() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    assert decode(decoder, [event(57, removed(1)), event(58, removed(2))]).events == [
        Removed(0, (1,)),
        Removed(0, (2,)),
    ]
    batch = decode(decoder, [event(60, removed(3)), event(60, removed(4))])
    assert batch.events == [
        Resync(0, "gap"),
        Removed(0, (3,)),
        Resync(0, "regression"),
        Removed(0, (4,)),
    ]


def test_a_drain_gives_the_last_event_id_of_each_rank_it_held() -> None:
    """Ignored and malformed events count: their ids were taken from the engine's buffer too."""
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [
        event(4, removed(1), rank=0),
        event(9, removed(2), rank=1),
        event(5, {"type": "unknown"}, rank=0),  # ignored
        event(10, {"type": "stored", "blocks": "x"}, rank=1),  # malformed
    ]
    batch = decode(decoder, body)
    assert batch.positions == {0: 5, 1: 10}
    assert len(batch.errors) == 1
    assert decode(decoder, [event(6, removed(3), rank=0)]).positions == {0: 6}
    assert decode(decoder, []).positions == {}


def test_resumed_ranks_check_their_first_event_against_the_stored_id() -> None:
    """A lease taker's decoder: rank 0 follows on (nothing lost), rank 1 skips ids (drained by the
    previous holder and never applied: a gap), rank 2 restarted (``created`` from 0), rank 3 was
    never stored (its first event is the baseline, as for any new decoder)."""
    decoder = TrtllmDecoder(tokens_per_block=1)
    decoder.resume_after({0: 41, 1: 17, 2: 300})
    created = {"type": "created", "num_blocks_per_cache_level": [10, 0]}
    body = [
        event(42, removed(1), rank=0),
        event(20, removed(2), rank=1),
        event(0, created, rank=2),
        event(8, removed(3), rank=3),
    ]
    assert decode(decoder, body).events == [
        Removed(0, (1,)),
        Resync(1, "gap"),
        Removed(1, (2,)),
        Resync(2, "restart"),
        Removed(3, (3,)),
    ]
    regressed = TrtllmDecoder(tokens_per_block=1)
    regressed.resume_after({0: 41})
    assert decode(regressed, [event(41, removed(1))]).events == [Resync(0, "regression"), Removed(0, (1,))]


def test_created_bursts() -> None:
    decoder = TrtllmDecoder()
    created = {"type": "created", "num_blocks_per_cache_level": [10, 0]}
    batch = decode(decoder, [event(0, created, 512), event(1, created, 4096), event(0, created, 512)])
    assert batch.events == [Resync(0, "restart"), Resync(0, "restart")]
    assert decoder.max_window_size == 4096
    batch = decode(decoder, [event(1, created, 4096), event(2, removed(1)), event(3, created, 4096)])
    assert batch.events == [Removed(0, (1,)), Resync(0, "restart")]


def test_missing_rank_is_inferred_in_an_adp_stream() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [
        event(3, removed(1), rank=0),
        event(7, removed(2), rank=1),
        event(8, removed(3)),  # rank 1's next id: older engines left the rank out of removed events
        event(4, removed(4)),  # rank 0's next id
        event(2, removed(5)),  # nobody's next id: rank 0, where it is a regression
    ]
    batch = decode(decoder, body)
    assert batch.events == [
        Removed(0, (1,)),
        Removed(1, (2,)),
        Removed(1, (3,)),
        Removed(0, (4,)),
        Resync(0, "regression"),
        Removed(0, (5,)),
    ]
    assert decoder.inferred_ranks == 2


def test_ambiguous_missing_rank_goes_to_rank_zero() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1)
    body = [event(0, removed(1), rank=0), event(0, removed(2), rank=1), event(1, removed(3))]
    assert decode(decoder, body).events[-1] == Removed(0, (3,))
    assert decoder.inferred_ranks == 0


def test_rank_bound_and_single_rank_default() -> None:
    decoder = TrtllmDecoder(tokens_per_block=1, max_dp_ranks=2)
    batch = decode(decoder, [event(0, removed(1)), event(0, removed(2), rank=2)])
    assert batch.events == [Removed(0, (1,))]
    assert "max_dp_ranks" in batch.errors[0]


def test_partial_memory_is_bounded_oldest_first() -> None:
    decoder = TrtllmDecoder(tokens_per_block=2, max_partial_hashes=2)
    body = [event(i, stored(None, (100 + i, [i]))) for i in range(3)]
    body.append(event(3, removed(100, 101, 102)))
    batch = decode(decoder, body)
    assert decoder.partial_overflow == 1
    assert batch.events == [Removed(0, (100,))]
    assert batch.ignored == 3 + 2 and partial_hashes(decoder) == 0


def test_partial_hash_memory_is_per_rank() -> None:
    decoder = TrtllmDecoder(tokens_per_block=2)
    body = [event(0, stored(None, (9, [1])), rank=0), event(0, removed(9), rank=1)]
    assert decode(decoder, body).events == [Removed(1, (9,))]


def test_settings_are_validated() -> None:
    for kwargs in ({"tokens_per_block": 0}, {"max_partial_hashes": 0}, {"max_dp_ranks": -1}):
        with pytest.raises(ValueError):
            TrtllmDecoder(**kwargs)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-golden"]:
        sys.exit("usage: python tests/unit/test_trtllm_decoder.py --write-golden")
    write_goldens()
