"""TRT-LLM decoder: golden drains, behaviour of each rule, random streams and fuzzing.

``FakeTrtllm`` below is an encoder written from the wire format (engine-events.md §4.4) and the
decoding rules in ``balancer/engines/trtllm.py``'s docstring, sharing no code with the decoder. It
produces each drain together with the engine-neutral events kvlb should decode from it. The goldens
in ``tests/golden/trtllm/`` are its frozen output (plus the spec's own example, with hand-written
expectations). After a deliberate change, regenerate them and review the diff::

    .venv/bin/python tests/unit/test_trtllm_decoder.py --write-golden
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.engines import DecodedBatch, decoder_factories
from balancer.engines.trtllm import TrtllmDecoder
from balancer.errors import EventDecodeError
from balancer.events import KvEvent, Removed, Resync, Stored

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "trtllm"
U64 = (1 << 64) - 1
Json = dict[str, Any]


# --------------------------------------------------------------------------- independent encoder


def _block_hash(parent: int | None, tokens: Sequence[int], salt: str | None) -> int:
    """A stand-in for TRT-LLM's block hash: chained, u64, often above 2**63."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent or 0).to_bytes(8, "little") + len(tokens).to_bytes(4, "little"))
    if parent is None and salt:
        digest.update(salt.encode())
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return int.from_bytes(digest.digest(), "big")


class FakeTrtllm:
    """Writes drains the way trtllm-serve's KVCacheEventSerializer does, and what kvlb should see."""

    def __init__(
        self,
        tokens_per_block: int,
        windows: Sequence[int] = (4096,),
        dp_ranks: int = 1,
        signed_hashes: bool = False,
    ) -> None:
        self.tpb = tokens_per_block
        self.windows = sorted(windows)
        self.max_window = max(windows)
        self.adp = dp_ranks > 1
        self.signed = signed_hashes
        self.next_id = dict.fromkeys(range(dp_ranks), 0)
        self.last_emitted: dict[int, int] = {}
        self.restarting: set[int] = set()
        self.partials: set[tuple[int, int]] = set()
        self.history: dict[int, list[int]] = {rank: [] for rank in range(dp_ranks)}
        self.drains: list[Json] = []
        self._body: list[Json] = []
        self._events: list[Json] = []
        self._ignored = 0

    def _wire(self, value: int) -> int:
        return value - (1 << 64) if self.signed and value >= 1 << 63 else value

    def _emit(self, rank: int, data: Json, window: int) -> None:
        event_id = self.next_id[rank]
        last = self.last_emitted.get(rank)
        reason = None
        if rank in self.restarting:
            reason = "restart"
        elif last is not None and event_id <= last:
            reason = "regression"
        elif last is not None and event_id > last + 1:
            reason = "gap"
        if reason is not None:
            self._events.append({"type": "resync", "dp_rank": rank, "reason": reason})
        if reason in ("restart", "regression"):
            self.partials = {key for key in self.partials if key[0] != rank}
        self.restarting.discard(rank)
        event: Json = {"event_id": event_id, "data": data, "window_size": window}
        if self.adp:
            event["attention_dp_rank"] = rank
        self._body.append(event)
        self.last_emitted[rank] = event_id
        self.next_id[rank] = event_id + 1

    def start(self, rank: int = 0) -> None:
        """The KV manager is (re)created: one ``created`` per window, ids from 0."""
        self.next_id[rank] = 0
        self.restarting.add(rank)
        for window in self.windows:
            self._emit(rank, {"type": "created", "num_blocks_per_cache_level": [1024, 0]}, window)

    def lose(self, rank: int, count: int) -> None:
        """The engine's buffer overflowed: ``count`` events of ``rank`` never reach us."""
        self.next_id[rank] += count

    def rewind(self, rank: int, event_id: int) -> None:
        """The engine restarted and its ``created`` was lost: ids start again lower."""
        self.next_id[rank] = event_id

    def store(
        self,
        rank: int,
        tokens: Sequence[int],
        parent: int | None = None,
        window: int | None = None,
        salt: str | None = None,
        level: int = 0,
    ) -> list[int]:
        window = self.max_window if window is None else window
        blocks = [list(tokens[i : i + self.tpb]) for i in range(0, len(tokens), self.tpb)]
        hashes: list[int] = []
        for block in blocks:
            hashes.append(_block_hash(hashes[-1] if hashes else parent, block, salt))
        wire_blocks = [
            {
                "type": "stored_block",
                "block_hash": self._wire(block_hash),
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in block],
                "cache_salt": salt,
                "cache_level": level,
                "priority": 35,
                "mm_keys": [],
            }
            for block_hash, block in zip(hashes, blocks, strict=True)
        ]
        parent_wire = None if parent is None else self._wire(parent)
        self._emit(rank, {"type": "stored", "parent_hash": parent_wire, "blocks": wire_blocks}, window)
        self.history[rank].extend(hashes)
        if window != self.max_window:
            self._ignored += 1
            return hashes
        full = 0 if level != 0 else len(tokens) // self.tpb
        if full:
            self._events.append(
                {
                    "type": "stored",
                    "dp_rank": rank,
                    "parent": parent,
                    "engine_hashes": hashes[:full],
                    "token_ids": list(tokens[: full * self.tpb]),
                    "block_size": self.tpb,
                    "cache_salt": salt,
                }
            )
        if full < len(blocks):
            self._ignored += len(blocks) - full
            if len(blocks[full]) < self.tpb:
                self.partials.add((rank, hashes[full]))
        return hashes

    def remove(self, rank: int, hashes: Sequence[int], window: int | None = None) -> None:
        window = self.max_window if window is None else window
        data = {"type": "removed", "block_hashes": [self._wire(h) for h in hashes]}
        self._emit(rank, data, window)
        if window != self.max_window:
            self._ignored += 1
            return
        kept = []
        for block_hash in hashes:
            if (rank, block_hash) in self.partials:
                self.partials.discard((rank, block_hash))
                self._ignored += 1
            else:
                kept.append(block_hash)
        if kept:
            self._events.append({"type": "removed", "dp_rank": rank, "engine_hashes": kept})

    def update(self, rank: int, block_hash: int, level: tuple[int, int] | None) -> None:
        """``level`` = (old, new) cache level; ``None`` is a priority-only update."""
        diff = None if level is None else {"type": "event_diff", "new_value": level[1], "old_value": level[0]}
        priority = {"type": "event_diff", "new_value": 50, "old_value": 35} if level is None else None
        data = {
            "type": "updated",
            "block_hash": self._wire(block_hash),
            "cache_level": diff,
            "priority": priority,
        }
        self._emit(rank, data, self.max_window)
        if level is not None and level[0] == 0 and level[1] != 0 and (rank, block_hash) not in self.partials:
            self._events.append({"type": "removed", "dp_rank": rank, "engine_hashes": [block_hash]})
        else:
            self._ignored += 1

    def empty(self) -> None:
        """The serializer writes ``{}`` for a ``None`` event."""
        self._body.append({})
        self._ignored += 1

    def drain(self) -> None:
        expected = {"events": self._events, "ignored": self._ignored, "errors": 0}
        self.drains.append({"body": self._body, "expected": expected})
        self._body, self._events, self._ignored = [], [], 0


# --------------------------------------------------------------------------- golden scenarios

TEXT = [1, 2860, 278, 263, 29871, 13, 1576, 338, 263, 1243, 29889, 13]


def _adp_interleaved() -> FakeTrtllm:
    engine = FakeTrtllm(4, dp_ranks=2)
    engine.start(0)
    engine.start(1)
    root0 = engine.store(0, TEXT[:8])
    engine.store(1, TEXT[:8])
    engine.store(0, TEXT[8:12], parent=root0[-1])
    engine.drain()
    root1 = engine.store(1, [7, 7, 7, 7])
    engine.remove(0, [root0[1]])
    engine.remove(1, root1)
    engine.drain()
    return engine


def _vswa_windows() -> FakeTrtllm:
    engine = FakeTrtllm(4, windows=(512, 4096))
    engine.start(0)
    engine.store(0, TEXT[:8], window=512)
    kept = engine.store(0, TEXT[:8], window=4096)
    engine.remove(0, [kept[1]], window=512)
    engine.remove(0, [kept[1]], window=4096)
    engine.drain()
    return engine


def _partial_block() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    first = engine.store(0, TEXT[:10])
    engine.drain()
    engine.remove(0, [first[2], first[1]])
    second = engine.store(0, [5, 6, 7, 8, 9, 10])
    engine.update(0, second[1], (0, 1))
    engine.remove(0, [second[1]])
    engine.drain()
    return engine


def _restart_midstream() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    engine.store(0, TEXT[:8])
    engine.drain()
    engine.store(0, TEXT[4:8])
    engine.start(0)
    engine.store(0, TEXT[:4])
    engine.drain()
    return engine


def _gap() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    hashes = engine.store(0, TEXT[:6])
    engine.drain()
    engine.lose(0, 3)
    engine.store(0, TEXT[6:12])
    engine.remove(0, [hashes[1]])
    engine.drain()
    return engine


def _regression() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    engine.store(0, TEXT[:4])
    engine.store(0, TEXT[4:8])
    engine.drain()
    engine.rewind(0, 1)
    engine.store(0, TEXT[8:12])
    engine.drain()
    return engine


def _cache_salt() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    plain = engine.store(0, TEXT[:4])
    salted = engine.store(0, TEXT[:4], salt="tenant-a")
    engine.store(0, TEXT[4:8], parent=salted[0], salt="tenant-a")
    assert plain != salted
    engine.drain()
    return engine


def _updated_offload() -> FakeTrtllm:
    engine = FakeTrtllm(4)
    engine.start(0)
    hashes = engine.store(0, TEXT[:12])
    engine.update(0, hashes[2], (0, 1))
    engine.update(0, hashes[2], (1, 0))
    engine.update(0, hashes[1], None)
    engine.empty()
    engine.drain()
    return engine


def _late_join_signed() -> FakeTrtllm:
    engine = FakeTrtllm(4, signed_hashes=True)
    engine.lose(0, 41)
    hashes = engine.store(0, TEXT[:12])
    engine.remove(0, hashes[1:])
    engine.drain()
    return engine


SCENARIOS = {
    "adp_interleaved": (_adp_interleaved, "two attention-DP ranks interleaved in one drain"),
    "vswa_windows": (_vswa_windows, "two windows; only the largest (4096) counts"),
    "partial_block": (_partial_block, "partial last blocks; their removal and offload are dropped"),
    "restart_midstream": (_restart_midstream, "a created event mid-stream: the engine restarted"),
    "gap": (_gap, "event ids skip ahead (buffer overflow); partials survive the gap"),
    "regression": (_regression, "event ids go back without a created event"),
    "cache_salt": (_cache_salt, "cache_salt names the namespace of stored blocks"),
    "updated_offload": (_updated_offload, "updated 0->1 removes; 1->0, priority and {} are ignored"),
    "late_join_signed": (_late_join_signed, "first event id 41 sets the baseline; hashes as signed i64"),
}


def _scenario_golden(name: str) -> Json:
    build, description = SCENARIOS[name]
    engine = build()
    return {
        "scenario": name,
        "description": description,
        "tokens_per_block": engine.tpb,
        "drains": engine.drains,
    }


def write_goldens() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name in SCENARIOS:
        text = json.dumps(_scenario_golden(name), indent=1) + "\n"
        (GOLDEN_DIR / f"{name}.json").write_text(text)


# --------------------------------------------------------------------------- helpers


def event_json(event: KvEvent) -> Json:
    """An event as the goldens spell it (written here, not taken from the decoder)."""
    if isinstance(event, Stored):
        assert event.lookahead_tokens == 0 and event.lora_name is None
        return {
            "type": "stored",
            "dp_rank": event.dp_rank,
            "parent": event.parent,
            "engine_hashes": list(event.engine_hashes),
            "token_ids": list(struct.unpack(f"<{len(event.tokens) // 4}I", event.tokens)),
            "block_size": event.block_size,
            "cache_salt": event.cache_salt,
        }
    if isinstance(event, Removed):
        return {"type": "removed", "dp_rank": event.dp_rank, "engine_hashes": list(event.engine_hashes)}
    assert isinstance(event, Resync), event
    return {"type": "resync", "dp_rank": event.dp_rank, "reason": event.reason}


def decode(decoder: TrtllmDecoder, body: object) -> DecodedBatch:
    return decoder.decode([json.dumps(body).encode()])


def summary(batch: DecodedBatch) -> Json:
    return {
        "events": [event_json(e) for e in batch.events],
        "ignored": batch.ignored,
        "errors": len(batch.errors),
    }


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


def check_invariants(decoder: TrtllmDecoder, batch: DecodedBatch, body_events: int) -> None:
    for item in batch.events:
        assert 0 <= item.dp_rank < decoder.max_dp_ranks
        if isinstance(item, Stored):
            assert item.block_count >= 1
            assert len(item.tokens) == 4 * decoder.tokens_per_block * item.block_count
            assert all(0 <= h <= U64 for h in item.engine_hashes)
            assert item.parent is None or 0 <= item.parent <= U64
        elif isinstance(item, Removed):
            assert item.engine_hashes and all(0 <= h <= U64 for h in item.engine_hashes)
        else:
            assert isinstance(item, Resync)
    assert len(batch.errors) <= body_events
    assert batch.ignored >= 0
    assert decoder.partial_hashes <= decoder.max_partial_hashes


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
    decoder = decoder_factories()["trtllm"]()
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
    assert decoder.partial_hashes == 0


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
    assert batch.ignored == 3 + 2 and decoder.partial_hashes == 0


def test_partial_hash_memory_is_per_rank() -> None:
    decoder = TrtllmDecoder(tokens_per_block=2)
    body = [event(0, stored(None, (9, [1])), rank=0), event(0, removed(9), rank=1)]
    assert decode(decoder, body).events == [Removed(1, (9,))]


def test_settings_are_validated() -> None:
    for kwargs in ({"tokens_per_block": 0}, {"max_partial_hashes": 0}, {"max_dp_ranks": -1}):
        with pytest.raises(ValueError):
            TrtllmDecoder(**kwargs)


# --------------------------------------------------------------------------- random streams


@settings(max_examples=150, deadline=None, database=None)
@given(st.data())
def test_random_streams_decode_as_the_encoder_expects(data: st.DataObject) -> None:
    tpb = data.draw(st.sampled_from([1, 2, 4]), label="tpb")
    ranks = data.draw(st.integers(1, 3), label="ranks")
    vswa = data.draw(st.booleans(), label="vswa")
    engine = FakeTrtllm(tpb, (256, 4096) if vswa else (4096,), ranks, data.draw(st.booleans()))
    if vswa or data.draw(st.booleans(), label="from start"):
        for rank in range(ranks):
            engine.start(rank)
    else:
        for rank in range(ranks):
            engine.lose(rank, data.draw(st.integers(0, 1000)))
    for _ in range(data.draw(st.integers(1, 16), label="steps")):
        rank = data.draw(st.integers(0, ranks - 1))
        _disturb(engine, rank, data)
        _operate(engine, rank, data)
    engine.drain()
    decoder = TrtllmDecoder(tokens_per_block=tpb)
    for drain in engine.drains:
        assert summary(decode(decoder, drain["body"])) == drain["expected"]


def _disturb(engine: FakeTrtllm, rank: int, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["none"] * 6 + ["lose", "rewind", "restart", "drain"]))
    if kind == "lose":
        engine.lose(rank, data.draw(st.integers(1, 5)))
    elif kind == "rewind" and rank in engine.last_emitted:
        engine.rewind(rank, data.draw(st.integers(0, engine.last_emitted[rank])))
    elif kind == "restart":
        engine.start(rank)
    elif kind == "drain":
        engine.drain()


def _operate(engine: FakeTrtllm, rank: int, data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["store", "store", "remove", "offload", "onboard", "priority", "empty"]))
    known = engine.history[rank]
    window = data.draw(st.sampled_from(engine.windows))
    if kind == "store" or not known:
        tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3 * engine.tpb + 1))
        parent = data.draw(st.none() | st.sampled_from(tuple(known))) if known else None
        salt = data.draw(st.sampled_from([None, "s"]))
        engine.store(rank, tokens, parent, window, salt, data.draw(st.sampled_from([0, 0, 0, 1])))
    elif kind == "remove":
        engine.remove(
            rank, data.draw(st.lists(st.sampled_from(tuple(known)), min_size=1, max_size=3)), window
        )
    elif kind == "empty":
        engine.empty()
    else:
        level = {"offload": (0, 1), "onboard": (1, 0), "priority": None}[kind]
        engine.update(rank, data.draw(st.sampled_from(tuple(known))), level)


# --------------------------------------------------------------------------- fuzzing

_KEYS = [
    "event_id", "data", "type", "window_size", "attention_dp_rank", "parent_hash", "blocks", "block_hash",
    "tokens", "token_id", "cache_level", "old_value", "new_value", "block_hashes", "cache_salt", "mm_keys",
    "lora_id", "priority",
]  # fmt: skip
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**66), 2**66)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["created", "stored", "removed", "updated", "00ff", "ab" * 32])
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=3), inner, max_size=5)
    ),
    max_leaves=12,
)


_JUNK = (
    _SCALARS | st.lists(_SCALARS, max_size=2) | st.dictionaries(st.sampled_from(_KEYS), _SCALARS, max_size=2)
)
"""Cheap wrong values (non-recursive, so thousands of examples stay fast)."""


def _mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(good, good, good, _JUNK)


_HASHES = (
    st.sampled_from([1, 2, 3, U64, -1, "00ff"]) | st.integers(-(2**63), U64) | st.text("0123456789abcdef")
)
_TOKEN = st.fixed_dictionaries({"token_id": _mostly(st.integers(0, 2**32 - 1) | st.just("ab" * 32))})
_BLOCK = st.fixed_dictionaries(
    {
        "block_hash": _mostly(_HASHES),
        "tokens": _mostly(st.lists(_TOKEN, max_size=5)),
        "cache_level": _mostly(st.sampled_from([0, 0, 1])),
    },
    optional={"cache_salt": _mostly(st.none() | st.text(max_size=3)), "mm_keys": _JUNK, "lora_id": _JUNK},
)
_DIFF = st.fixed_dictionaries(
    {"new_value": _mostly(st.integers(0, 2)), "old_value": _mostly(st.integers(0, 2))}
)
_STORED = {
    "type": st.just("stored"),
    "parent_hash": _mostly(st.none() | _HASHES),
    "blocks": _mostly(st.lists(_BLOCK, max_size=3)),
}
_REMOVED = {"type": st.just("removed"), "block_hashes": _mostly(st.lists(_HASHES, max_size=3))}
_UPDATED = {
    "type": st.just("updated"),
    "block_hash": _mostly(_HASHES),
    "cache_level": _mostly(st.none() | _DIFF),
}
_DATA = st.one_of(
    st.fixed_dictionaries({"type": st.just("created")}),
    st.fixed_dictionaries(_STORED),
    st.fixed_dictionaries(_REMOVED),
    st.fixed_dictionaries(_UPDATED),
)
_EVENT = st.one_of(
    st.fixed_dictionaries(
        {
            "event_id": _mostly(st.integers(0, 6)),
            "data": _mostly(_DATA),
            "window_size": _mostly(st.sampled_from([512, 4096])),
        },
        optional={"attention_dp_rank": _mostly(st.integers(0, 3))},
    ),
    st.just({}),
    _JUNK,
)


@settings(max_examples=1000, deadline=None, database=None)
@given(st.lists(st.lists(_EVENT, max_size=8), min_size=1, max_size=3))
def test_fuzz_event_shapes_never_escape(drains: list[list[Any]]) -> None:
    decoder = TrtllmDecoder(tokens_per_block=4, max_partial_hashes=4, max_dp_ranks=3)
    for body in drains:
        check_invariants(decoder, decode(decoder, body), len(body))


@settings(max_examples=400, deadline=None, database=None)
@given(_JSON)
def test_fuzz_any_json_body(body: Any) -> None:
    decoder = TrtllmDecoder()
    try:
        batch = decode(decoder, body)
    except EventDecodeError:
        assert not isinstance(body, list)
    else:
        check_invariants(decoder, batch, len(body))


@settings(max_examples=500, deadline=None, database=None)
@given(st.binary(max_size=64) | st.builds(lambda b: b"[" + b, st.binary(max_size=32)))
def test_fuzz_raw_bytes(frame: bytes) -> None:
    decoder = TrtllmDecoder()
    try:
        batch = decoder.decode([frame])
    except EventDecodeError:
        return
    check_invariants(decoder, batch, len(json.loads(frame)))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-golden"]:
        sys.exit("usage: python tests/unit/test_trtllm_decoder.py --write-golden")
    write_goldens()
