"""A test-side view of an engine's KV events, decoded independently of kvlb (I/O: a SUB thread).

:class:`EventTap` subscribes to one engine's PUB socket and keeps every message. :class:`HeldBlocks`
replays those messages into "which blocks does this engine hold now", keyed by the block's *prefix
identity* (the SHA-256 of every token from the start of the sequence to the end of the block), so
engines that hash differently (vLLM's pickled SHA-256 chain, SGLang's int32 chain) compare directly.
:func:`vllm_block_hashes` is vLLM's block-hash recipe (docs/reference/real-engines.md §2.3), used to name
a request's blocks the way the engine does.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

U64 = (1 << 64) - 1
_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The u64 event ids vLLM gives the full blocks of ``token_ids`` (no LoRA, no salt)."""
    parent = _NONE_HASH
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start : start + block_size])
        digest = hashlib.sha256(
            pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        out.append(int.from_bytes(digest, "big") & U64)
        parent = digest
    return out


def prefix_id(tokens: tuple[int, ...]) -> str:
    """Engine-neutral identity of a block: a digest of all tokens up to the end of the block."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]


@dataclass
class Message:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    received_s: float


class EventTap:
    """Every message one engine publishes, from a SUB connected to ``endpoint`` (a daemon thread)."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.name = name
        self.endpoint = endpoint
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._messages: list[Message] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big")
                ts, events = msgpack.unpackb(frames[2], raw=False)[:2]
                message = Message(seq, ts, [dict(e) for e in events], time.monotonic())
                with self._lock:
                    self._messages.append(message)
        finally:
            sub.close(linger=0)

    def messages(self) -> list[Message]:
        with self._lock:
            return list(self._messages)

    def count(self) -> int:
        with self._lock:
            return len(self._messages)

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 10.0) -> int:
        """Wait until no message arrived for ``quiet_s``, counted from the call at the earliest
        (a batch published just after a response still gets in); bounded. Returns the count."""
        called = time.monotonic()
        deadline = called + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                last = self._messages[-1].received_s if self._messages else 0.0
            if time.monotonic() - max(last, called) >= quiet_s:
                break
            time.sleep(0.05)
        return self.count()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()


@dataclass
class HeldBlocks:
    """What an engine holds, rebuilt from its events. Keys are :func:`prefix_id` identities."""

    prefixes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Engine hash → the tokens from the sequence start to the end of that block (kept after removal
    so a re-store under the same parent resolves)."""
    held: dict[int, str] = field(default_factory=dict)
    """Engine hash → prefix identity, for the blocks held now."""
    stored_order: list[str] = field(default_factory=list)
    removed_order: list[str] = field(default_factory=list)
    cleared: int = 0
    restarts: int = 0
    unresolved: int = 0
    last_seq: int | None = None

    def apply(self, messages: list[Message]) -> HeldBlocks:
        """Apply messages in order; a seq that does not move forward is a restarted engine (empty)."""
        for message in messages:
            if self.last_seq is not None and message.seq <= self.last_seq:
                self.restarts += 1
                self.held.clear()
            self.last_seq = message.seq
            for event in message.events:
                self.apply_event(event)
        return self

    def apply_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            self.cleared += 1
            self.held.clear()
        elif kind == "BlockRemoved":
            for block_hash in event["block_hashes"]:
                key = self.held.pop(block_hash, None)
                self.removed_order.append(key if key is not None else f"?{block_hash}")
        elif kind == "BlockStored":
            self._stored(event)

    def _stored(self, event: dict[str, Any]) -> None:
        size = event["block_size"]
        parent = event.get("parent_block_hash")
        prefix: tuple[int, ...] = ()
        if parent is not None:
            if parent not in self.prefixes:
                self.unresolved += 1
                return
            prefix = self.prefixes[parent]
        tokens = event["token_ids"]
        for i, block_hash in enumerate(event["block_hashes"]):
            prefix = prefix + tuple(tokens[i * size : (i + 1) * size])
            self.prefixes[block_hash] = prefix
            key = prefix_id(prefix)
            self.held[block_hash] = key
            self.stored_order.append(key)

    def held_ids(self) -> set[str]:
        return set(self.held.values())


def request_prefix_ids(token_ids: list[int], block_size: int) -> list[str]:
    """Prefix identities of every full block of a request."""
    return [prefix_id(tuple(token_ids[:end])) for end in range(block_size, len(token_ids) + 1, block_size)]
