"""Payload generators for the decoder fuzzer (pure: a seeded ``random.Random`` decides everything).

Each generator yields engine messages, most of them hostile: valid batches built with the emulator's
wire encoders (:mod:`replicas.wire`, written apart from the decoders), then mutated at one of three
levels, chosen at random per payload:

* **structure**: the decoded msgpack/JSON tree is edited (a node replaced by a hostile value, a key
  dropped or added, a list emptied or duplicated) and re-encoded, so the payload still parses and
  reaches the decoder's field checks;
* **bytes**: bit flips, truncation, insertion, splices of two payloads;
* **frames**: frames dropped, duplicated, swapped, or a wrong sequence-number width.

The hostile values are what a broken or malicious publisher could send: ints outside i64/u64, bools
where ints go, NaN and infinities, huge strings, deep nesting, maps with non-string keys, bytes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import msgpack

from replicas.wire import sglang as sgl_wire
from replicas.wire import trtllm as trt_wire

BLOCK_SIZE = 4
"""Tokens per block of every generated SGLang chain (the pool's block size in the test)."""
TRT_TOKENS_PER_BLOCK = 4

_HOSTILE: list[Callable[[random.Random], Any]] = [
    lambda r: None,
    lambda r: True,
    lambda r: -1,
    lambda r: 0,
    lambda r: 2**64,
    lambda r: -(2**63) - 1,
    lambda r: 2**63,
    lambda r: r.getrandbits(64) - 2**63,
    lambda r: float("nan"),
    lambda r: float("inf"),
    lambda r: -0.0,
    lambda r: 1e308,
    lambda r: "",
    lambda r: "x" * r.choice((1, 17, 4096)),
    lambda r: "ffffffffffffffffff",
    lambda r: "\u0000\uffff",
    lambda r: b"",
    lambda r: bytes(r.getrandbits(8) for _ in range(r.randint(1, 40))),
    lambda r: [],
    lambda r: [None] * r.randint(1, 5),
    lambda r: [[[[[]]]]],
    lambda r: {},
    lambda r: {1: 2, None: "x"},
    lambda r: {"type": "BlockStored"},
    lambda r: {"type": "stored", "blocks": None},
    lambda r: list(range(r.randint(0, 300))),
]


def hostile(rng: random.Random) -> Any:
    return rng.choice(_HOSTILE)(rng)


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


def mutate_tree(tree: Any, rng: random.Random, edits: int) -> Any:
    """``tree`` with ``edits`` random edits (in place where possible; returns the new root)."""
    for _ in range(edits):
        tree = _edit(tree, rng)
    return tree


def _edit(root: Any, rng: random.Random) -> Any:
    nodes: list[tuple[Any, Any]] = []  # (container, key) of every reachable slot
    stack = [root]
    while stack and len(nodes) < 5000:
        node = stack.pop()
        if isinstance(node, list):
            nodes.extend((node, i) for i in range(len(node)))
            stack.extend(node)
        elif isinstance(node, dict):
            nodes.extend((node, k) for k in list(node))
            stack.extend(node.values())
    if not nodes or rng.random() < 0.02:
        return hostile(rng)
    container, key = rng.choice(nodes)
    action = rng.random()
    if action < 0.55:
        container[key] = hostile(rng)
    elif action < 0.70:
        if isinstance(container, dict):
            del container[key]
        else:
            del container[key]
    elif action < 0.80:
        if isinstance(container, dict):
            container[rng.choice(("type", "medium", "block_size", "extra", 7, "event_id"))] = hostile(rng)
        else:
            container.insert(key, hostile(rng))
    elif action < 0.90:
        value = container[key]
        if isinstance(value, list) and value:
            container[key] = value * rng.randint(2, 4)
        else:
            container[key] = nested(rng.choice((3, 50, 400)))
    else:
        value = container[key]
        if isinstance(value, int) and not isinstance(value, bool):
            container[key] = value + rng.choice((-1, 1, 2**32, -(2**32), 2**63))
        else:
            container[key] = repr(value)[: rng.randint(0, 20)] if _scalar(value) else hostile(rng)
    return root


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str | bytes)


def mutate_bytes(data: bytes, rng: random.Random, other: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.35 and buf:
            index = rng.randrange(len(buf))
            buf[index] ^= 1 << rng.randrange(8)
        elif choice < 0.55:
            buf = buf[: rng.randint(0, len(buf))]
        elif choice < 0.75:
            index = rng.randint(0, len(buf))
            buf[index:index] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
        elif choice < 0.90:
            cut = rng.randint(0, len(buf))
            buf = buf[:cut] + other[rng.randint(0, len(other)) :]
        elif buf:
            index = rng.randrange(len(buf))
            buf[index] = rng.choice((0x00, 0xFF, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0x7F, 0x80))
    return bytes(buf)


# ----------------------------------------------------------------------------------------- SGLang


def _tokens(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(blocks * BLOCK_SIZE)]


def sglang_event_tree(rng: random.Random, encoder: sgl_wire.KvEventEncoder, live: list[int]) -> Any:
    """One valid event (as a msgpack-able tree); ``live`` holds this stream's engine hashes."""
    roll = rng.random()
    if roll < 0.6 or not live:
        count = rng.randint(1, 4)
        parent = rng.choice(live) if live and rng.random() < 0.7 else None
        hashes = [rng.getrandbits(64) for _ in range(count)]
        live.extend(hashes)
        del live[:-512]
        return encoder.block_stored(hashes, parent, _tokens(rng, count), BLOCK_SIZE)
    if roll < 0.95:
        gone = rng.sample(live, min(len(live), rng.randint(1, 3)))
        return encoder.block_removed(gone)
    live.clear()
    return encoder.all_blocks_cleared()


def sglang_message(rng: random.Random, seq: int, live: list[int]) -> list[bytes]:
    flavor = rng.choice(("sglang", "vllm"))
    encoder = sgl_wire.KvEventEncoder(
        flavor=flavor, encoding=rng.choice(("map", "array")), envelope=rng.choice(("array", "map"))
    )
    events = [sglang_event_tree(rng, encoder, live) for _ in range(rng.randint(0, 6))]
    payload = encoder.batch(1.7e9 + seq, events, rng.choice((None, 0, 0, 1)))
    epoch = rng.choice((None, None, "ab12"))
    return sgl_wire.frames("kv", seq, payload, epoch=epoch)


def sglang_payloads(seed: int, count: int) -> Iterator[list[bytes]]:
    """``count`` SGLang/vLLM messages, about 10% valid, the rest mutated."""
    rng = random.Random(seed)
    live: list[int] = []
    previous = b"\x93\xcb"
    for seq in range(count):
        frames = sglang_message(rng, seq, live)
        level = rng.random()
        if level < 0.10:
            pass
        elif level < 0.65:
            tree = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            tree = mutate_tree(tree, rng, rng.randint(1, 3))
            frames[2] = _packb(tree, rng)
        elif level < 0.90:
            frames[2] = mutate_bytes(frames[2], rng, previous)
        else:
            frames = _mutate_frames(frames, rng)
        previous = frames[-1] if frames else previous
        yield frames


def _packb(tree: Any, rng: random.Random) -> bytes:
    try:
        packed: bytes = msgpack.packb(tree, use_bin_type=rng.random() < 0.8)
    except (OverflowError, ValueError, TypeError):  # e.g. an int beyond u64: send a raw map instead
        packed = b"\xcf" + b"\xff" * 8
    return packed


def _mutate_frames(frames: list[bytes], rng: random.Random) -> list[bytes]:
    choice = rng.random()
    if choice < 0.25:
        return frames[: rng.randint(0, len(frames))]
    if choice < 0.45:
        return frames + [frames[-1]] * rng.randint(1, 3)
    if choice < 0.65:
        return [frames[0], frames[1][: rng.randint(0, 12)] + b"\x00" * rng.randint(0, 2), frames[2]]
    if choice < 0.80:
        return [frames[2], frames[1], frames[0]]
    if choice < 0.85:
        return [frames[0], b"\xff" * 8, frames[2] if rng.random() < 0.5 else b""]
    if choice < 0.92:  # deep nesting and huge declared lengths, straight in msgpack
        deep = rng.choice((b"\x91" * 100_000 + b"\xc0", b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff\xc0"))
        return [frames[0], frames[1], deep]
    return [b"\x00" * rng.randint(0, 3) for _ in range(rng.randint(0, 4))]


# ---------------------------------------------------------------------------------------- TRT-LLM


class TrtStream:
    """A valid TRT-LLM event stream's state: next ``event_id`` and the live chain tips."""

    def __init__(self) -> None:
        self.event_id = 0
        self.live: list[int] = []

    def next_id(self, rng: random.Random) -> int:
        event_id = self.event_id
        self.event_id += 1 if rng.random() < 0.97 else rng.randint(2, 5)  # occasional real gap
        return event_id


def trtllm_event(rng: random.Random, stream: TrtStream) -> dict[str, Any]:
    window = 4096
    rank = rng.choice((None, None, 0, 1))
    if stream.event_id == 0 or rng.random() < 0.01:
        stream.live.clear()
        return trt_wire.created(stream.next_id(rng), [64, 0], window, rank)
    roll = rng.random()
    if roll < 0.65 or not stream.live:
        count = rng.randint(1, 3)
        parent = rng.choice(stream.live) if stream.live and rng.random() < 0.7 else None
        blocks = []
        for index in range(count):
            size = TRT_TOKENS_PER_BLOCK if index < count - 1 or rng.random() < 0.7 else rng.randint(1, 3)
            block_hash = rng.getrandbits(64)
            blocks.append((block_hash, [rng.randrange(50_000) for _ in range(size)]))
            stream.live.append(block_hash)
        del stream.live[:-512]
        return trt_wire.stored(stream.next_id(rng), parent, blocks, window, dp_rank=rank)
    if roll < 0.90:
        gone = rng.sample(stream.live, min(len(stream.live), rng.randint(1, 3)))
        return trt_wire.removed(stream.next_id(rng), gone, window, rank)
    target = rng.choice(stream.live)
    return trt_wire.updated(stream.next_id(rng), target, window, cache_level=(0, 1), dp_rank=rank)


def trtllm_payloads(seed: int, count: int) -> Iterator[list[bytes]]:
    """``count`` TRT-LLM drain bodies (one frame each), about 10% valid, the rest mutated."""
    rng = random.Random(seed)
    stream = TrtStream()
    previous = b"[{"
    for _ in range(count):
        events = [trtllm_event(rng, stream) for _ in range(rng.randint(0, 6))]
        level = rng.random()
        if level < 0.10:
            body = trt_wire.encode_drain(events)
        elif level < 0.70:
            tree = mutate_tree(events, rng, rng.randint(1, 3))
            body = _json_bytes(tree, rng)
        elif level < 0.95:
            body = mutate_bytes(trt_wire.encode_drain(events), rng, previous)
        else:
            body = rng.choice(
                (
                    b"[" * 200_000,
                    b'[{"event_id": 1e999}]',
                    b"[NaN, Infinity, -Infinity]",
                    b"\xef\xbb\xbf[]",
                    b'[{"event_id": 0, "data": {"type": "stored", "blocks": ' + b"[" * 3000 + b"]}}]",
                    b'"' + b"a" * 100_000 + b'"',
                    b"[" + b"{}," * 10_000 + b"{}]",
                )
            )
        previous = body
        frames = [body] if rng.random() < 0.97 else [body, body]
        yield frames


def _json_bytes(tree: Any, rng: random.Random) -> bytes:
    def default(value: object) -> object:
        if isinstance(value, bytes):
            return value.decode("latin-1")
        return str(value)

    try:
        text = json.dumps(tree, default=default, allow_nan=True, ensure_ascii=rng.random() < 0.5)
    except (ValueError, RecursionError):
        text = "[" * 100
    return text.encode("utf-8", "surrogatepass")
