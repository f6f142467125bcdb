"""An encoder of TRT-LLM event drains independent of kvlb's decoder (``FakeTrtllm``), the golden
scenarios it writes, and helpers shared by the TRT-LLM decoder tests.

``FakeTrtllm`` is written from the wire format (docs/reference/engine-events.md §4.4) and the
decoding rules in ``balancer/engines/trtllm.py``'s docstring, sharing no code with the decoder. It
produces each drain together with the engine-neutral events kvlb should decode from it. The goldens in
``tests/golden/trtllm/`` are its frozen output (plus the spec's own example, with hand-written
expectations). After a deliberate change, regenerate them and review the diff::

    .venv/bin/python tests/unit/test_trtllm_decoder.py --write-golden
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from balancer.engines import DecodedBatch
from balancer.engines.trtllm import TrtllmDecoder
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


def partial_hashes(decoder: TrtllmDecoder) -> int:
    """How many partial-block hashes ``decoder`` remembers now (its bounded private memory)."""
    return len(decoder._partials)
