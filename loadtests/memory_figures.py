"""The per-item memory figures of docs/reliability.md, "Memory" (tracemalloc, in this process).

``python -m loadtests.memory_figures`` from the repository root prints, for each kind of input:

* ``bodies``: :func:`balancer.api.parsing.parse_request` on bodies of 8.4–9.6 MB of nine shapes
  (each decoder: typed, untyped, stdlib): the peak while parsing and what the parsed request keeps,
  over the body's bytes, and the request's estimate of what it keeps
  (:attr:`~balancer.api.parsing.ParsedRequest.parsed_bytes`, its parsed form's part of what it
  holds of the byte budget while it is tokenized in a thread) over the kept figure, and what the body
  holds while it is parsed (:func:`~balancer.api.parse_cost.json_parse_bytes`) over the peak;
* ``grpc``: a ``GenerateRequest`` of about 8 MB of four shapes (empty chat messages, one-letter ones,
  one-byte packed token ids, an unknown field), each in a fresh process: the peak RSS rise of its
  protobuf parse and of its conversion to the OpenAI body, and what kvlb holds for each
  (:mod:`balancer.api.parse_cost`);
* ``ids``: the token ids of one long prompt (the default tokenizer): bytes kept per id;
* ``events``: engine decoders on real captured frames (``tests/golden/real/``) and on synthetic
  batches: the peak while decoding one message, the memory a queue of decoded batches keeps per
  wire byte (averaged over 50 decodes each, one-time decoder state excluded), and
  :func:`balancer.sources.pipeline.batch_bytes` (the event queue's estimate) over that memory;
* ``index``: a :class:`~balancer.index.memory.MemoryIndex` holding 200,000 blocks in chains of
  1,000, stored by one replica, then by a second;
* ``tokenizer``: the working memory of the default tokenizer's encode, as kvlb runs it in a thread
  (a text completion's :meth:`~balancer.tokenizer.tokenizer.HfTokenizer.encode_prompt`, a one-message
  chat's :meth:`~balancer.tokenizer.tokenizer.HfTokenizer.encode_chat_in_pieces` when kvlb gives
  it the pieces' hold, else ``encode_chat``: the template rendered, then encoded), on six shapes
  of text (:data:`TEXT_SHAPES`) of 4,500 to 6 M characters: the rise of the peak RSS (``VmHWM``,
  reset through ``/proc/self/clear_refs`` once the text is made) per
  character, each in a fresh process (``tracemalloc`` does not see the tokenizer's Rust
  allocations). Sizes over the tokenizer's ``max_prompt_chars`` (4 M) are refused by kvlb before
  any encoding; they are measured with that cap lifted, to show the trend. Each line also gives
  what kvlb holds for the tokenizer's work on that text (:func:`~balancer.api.openai.tokenizing_hold_bytes`
  less the parsed form's part, which was made before the measure; ``*``: a text prompt or chat with
  no safe cut for two pieces' length, which holds the whole encode's estimate after the pieces'
  was refused, as kvlb's thread does) and the rise over it, which must stay under 1. Not part of the default
  run (it takes minutes): ``python -m loadtests.memory_figures tokenizer``.

* ``refusal``: the same measure for 4 M characters of ASCII words and of random latin-1 bytes,
  under ``max_prompt_tokens`` and far over it (refused): CPU seconds and peak RSS rise
  (``python -m loadtests.memory_figures refusal``; not part of the default run either).

``python -m loadtests.memory_figures events`` runs one part; ``tokenizer 0.25 1`` measures those
sizes only (millions of characters). Figures vary by a few percent between
runs and Python versions; the tokenizer's by a few percent between runs.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import random
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.grpc.messages import openai_call
from balancer.api.openai import piece_hold_chars, tokenizing_hold_bytes
from balancer.api.parse_cost import (
    chat_convert_bytes,
    json_parse_bytes,
    parsed_message_bytes,
    protobuf_parse_bytes,
)
from balancer.api.parsing import ParsedRequest, parse_request
from balancer.engines.registry import engine_spec
from balancer.events import Stored
from balancer.index.hashing import BlockHasher, compact_ids
from balancer.index.memory import MemoryIndex
from balancer.sources.base import IngestBatch
from balancer.sources.pipeline import batch_bytes
from balancer.tokenizer.cuts import LongPiece
from balancer.tokenizer.default import default_tokenizer
from balancer.tokenizer.tokenizer import PromptTooLarge, TokenizeLimits
from balancer.types import EngineHash, ReplicaId
from loadtests.faults.body_budget import padded_message, varint
from replicas.wire import trtllm as trtllm_wire

MIB = 1024 * 1024
REAL = Path(__file__).resolve().parent.parent / "tests" / "golden" / "real"
REPEAT = 50


def traced(call: Callable[[], Any]) -> tuple[Any, int, int]:
    """``call()``, the bytes it left allocated and its peak, both above the starting point."""
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    result = call()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, kept - base, peak - base


def bodies() -> None:
    shapes: list[tuple[str, str, bytes]] = [
        (
            "chat of one 8 MiB string",
            "chat",
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "a" * (8 * MIB)}]}).encode(),
        ),
        (
            "prompt of 1.2 M token ids",
            "completions",
            json.dumps({"model": "m", "prompt": [100_000 + i % 50_000 for i in range(1_200_000)]}).encode(),
        ),
        (
            "2.8 M empty objects",
            "completions",
            b'{"model": "m", "prompt": "x", "x": [' + b",".join([b"{}"] * 2_800_000) + b"]}",
        ),
        (
            "2.8 M empty arrays",
            "completions",
            b'{"model": "m", "prompt": "x", "x": [' + b",".join([b"[]"] * 2_800_000) + b"]}",
        ),
        (
            "270,000 one-letter chat messages",
            "chat",
            json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 270_000}).encode(),
        ),
        (
            "one message of 290,000 two-letter content parts",
            "chat",
            json.dumps(
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}] * 290_000}],
                }
            ).encode(),
        ),
        # The shapes above are decoded by msgspec into typed structs (completions in ASCII: unknown
        # fields are skipped); a chat, a non-ASCII completion body and anything msgspec refuses are
        # decoded whole, by msgspec into dicts or by the stdlib (a UTF-16 body, a lone surrogate).
        (
            "2.8 M empty objects in a chat (untyped decoder)",
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ['
            + b",".join([b"{}"] * 2_800_000)
            + b"]}",
        ),
        (
            "2.8 M empty arrays in a chat (untyped decoder)",
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ['
            + b",".join([b"[]"] * 2_800_000)
            + b"]}",
        ),
        (
            "1.4 M empty objects in UTF-16 (stdlib decoder)",
            "completions",
            ('{"model": "m", "prompt": "x", "x": [' + ",".join(["{}"] * 1_400_000) + "]}").encode("utf-16"),
        ),
        # Two more for the estimate of the parse (balancer/api/parse_cost.py): the stdlib decoder on
        # UTF-8 (a lone surrogate sends the body there, then the walk looks for it) and distinct keys.
        (
            "2.8 M empty objects and a lone surrogate (stdlib decoder)",
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}], "x": ['
            + b",".join([b"{}"] * 2_800_000)
            + b"]}",
        ),
        (
            "800,000 distinct keys in a chat (untyped decoder)",
            "chat",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": {'
            + b",".join(b'"%d":0' % i for i in range(800_000))
            + b"}}",
        ),
    ]
    for name, kind, body in shapes:
        parsed, kept, peak = traced(lambda body=body, kind=kind: _parse_or_refusal(body, kind))  # type: ignore[misc]
        size = len(body)
        estimate = parsed.parsed_bytes if parsed is not None else 0
        over_kept = f" ({estimate / kept:.2f} of kept)" if kept >= MIB and estimate else ""
        hold = json_parse_bytes(body)
        print(
            f"body, {name}: {size / 1e6:.1f} MB; parse peak {peak / 1e6:.0f} MB ({peak / size:.1f}x), "
            f"kept {kept / 1e6:.0f} MB ({kept / size:.1f}x), estimate {estimate / 1e6:.0f} MB{over_kept}; "
            f"held while parsed {hold / 1e6:.0f} MB ({hold / max(peak, 1):.2f} of the peak)"
            + ("" if parsed is not None else " (refused: 400)")
        )


def _parse_or_refusal(body: bytes, kind: str) -> ParsedRequest | None:
    """:func:`parse_request` of ``body``, ``None`` when it is refused (a 400)."""
    try:
        return parse_request(body, kind)  # type: ignore[arg-type]
    except ApiError:
        return None


GRPC_SHAPES = ("empty_chat_messages", "one_letter_chat_messages", "packed_one_byte_ids", "unknown_field")


def _grpc_message(shape: str) -> bytes:
    """A ``GenerateRequest`` of about 8 MB of ``shape`` (built from its wire bytes: fast)."""
    if shape == "unknown_field":
        return padded_message(pb.GenerateRequest(model="m", prompt_text="x").SerializeToString(), 8 * 10**6)
    if shape == "packed_one_byte_ids":
        ids = b"\x01" * 8 * 10**6
        inner = b"\x0a" + varint(len(ids)) + ids
        return b"\x0a\x01m\x1a" + varint(len(inner)) + inner
    one = b"\x0a\x00" if shape == "empty_chat_messages" else b"\x0a\x06\x0a\x01u\x12\x01a"
    inner = one * (8 * 10**6 // len(one))
    return b"\x0a\x01m\x12" + varint(len(inner)) + inner


def _hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def grpc_one(shape: str) -> None:
    """One gRPC shape in this process: the peak RSS rise of its protobuf parse, then of its conversion
    to the OpenAI body (``openai_call``), and what kvlb holds for each (JSON on the last line)."""
    raw = _grpc_message(shape)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = _hwm_bytes()
    request = pb.GenerateRequest.FromString(raw)
    parse_rise = _hwm_bytes() - before
    chats = len(request.chat_messages.messages)
    ids = len(request.prompt_token_ids.ids)
    Path("/proc/self/clear_refs").write_text("5")
    before = _hwm_bytes()
    try:
        openai_call(request, stream=True)
        refused = ""
    except ApiError as exc:
        refused = exc.message[:60]
    convert_rise = _hwm_bytes() - before
    result = {
        "bytes": len(raw),
        "parse_rise": parse_rise,
        "parse_hold": protobuf_parse_bytes(raw, "generate"),
        "kept_hold": parsed_message_bytes(len(raw), chats, ids),
        "convert_rise": convert_rise,
        "convert_hold": chat_convert_bytes(len(raw), chats, request.extra_json, ids),
        "refused": refused,
    }
    print(json.dumps(result))


def grpc() -> None:
    """:func:`grpc_one` of each of :data:`GRPC_SHAPES`, each in a fresh process (upb's memory is not
    Python's: ``tracemalloc`` does not see it)."""
    for shape in GRPC_SHAPES:
        command = [sys.executable, "-m", "loadtests.memory_figures", "grpc-one", shape]
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        size = r["bytes"]
        print(
            f"grpc, {shape}: {size / 1e6:.1f} MB; parse: peak RSS rise {r['parse_rise'] / 1e6:.0f} MB "
            f"({r['parse_rise'] / size:.1f}x), held while parsed {r['parse_hold'] / 1e6:.0f} MB, then "
            f"{r['kept_hold'] / 1e6:.0f} MB for the call; conversion: rise {r['convert_rise'] / 1e6:.0f} MB "
            f"({r['convert_rise'] / size:.1f}x), held {r['convert_hold'] / 1e6:.0f} MB"
            + (f" (refused: {r['refused']})" if r["refused"] else ""),
            flush=True,
        )


def ids() -> None:
    tokenizer = default_tokenizer()
    rng = random.Random(1)
    words = ["alpha", "river", "stone", "cloud", "green", "number", "seven", "quiet", "table", "light"]
    text = " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(80_000))
    token_ids, kept, _ = traced(lambda: tokenizer.encode_prompt(text))
    print(f"token ids: {len(token_ids):,} ids keep {kept / 1e6:.1f} MB, {kept / len(token_ids):.1f} B per id")


def _decode(name: str, engine: str, block_size: int, messages: Sequence[Sequence[bytes]]) -> None:
    decoder = engine_spec(engine).decoder(block_size)
    for frames in messages:  # warm-up: the decoder's one-time state is not counted below
        decoder.decode(frames)
    largest = max(messages, key=lambda frames: sum(len(frame) for frame in frames))
    _, _, peak = traced(lambda: decoder.decode(largest))
    peak_ratio = peak / sum(len(frame) for frame in largest)
    wire = REPEAT * sum(sum(len(frame) for frame in frames) for frames in messages)
    queue, kept, _ = traced(
        lambda: [
            IngestBatch(tuple(decoder.decode(frames).events)) for _ in range(REPEAT) for frames in messages
        ]
    )
    estimate = sum(batch_bytes(batch.events) for batch in queue)
    print(
        f"events, {name}: decode peak {peak_ratio:.1f}x the largest message; queued, {kept / wire:.2f}x"
        f" the wire bytes; batch_bytes = {estimate / kept:.2f} of that"
    )


def _hex_frames(path: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in path.read_text().split()]


def events() -> None:
    sglang_real = [_hex_frames(path) for path in sorted((REAL / "sglang-0.5.23-cpu").glob("*.hex"))]
    _decode("SGLang 0.5.23, the real captured frames", "sglang", 1, sglang_real)
    block = 16

    def page(n: int) -> dict[str, Any]:
        tokens = [(n * block + i) % 120_000 + 1000 for i in range(block)]
        return {
            "type": "BlockStored",
            "block_hashes": [n + 1],
            "parent_block_hash": n or None,
            "token_ids": tokens,
            "block_size": block,
            "lora_id": None,
            "medium": "GPU",
        }

    def message(events: list[dict[str, Any]]) -> list[bytes]:
        return [b"kv", (5).to_bytes(8, "big"), msgpack.packb([time.time(), events, 0])]

    _decode(
        "SGLang, 1,500 one-page BlockStored of 16 tokens",
        "sglang",
        block,
        [message([page(n) for n in range(1500)])],
    )
    removed = [{"type": "BlockRemoved", "block_hashes": [n + 10**15], "medium": "GPU"} for n in range(1500)]
    _decode("SGLang, 1,500 one-hash BlockRemoved", "sglang", block, [message(removed)])
    long_event = dict(
        page(0),
        block_hashes=list(range(1, 4097)),
        token_ids=[i % 120_000 + 1000 for i in range(4096 * block)],
    )
    _decode("SGLang, one BlockStored of 4,096 pages", "sglang", block, [message([long_event])])
    tpb = 32
    drain: list[dict[str, Any]] = [trtllm_wire.created(0, [100_000], 4096)]
    for n in range(500):
        tokens = [(n * tpb + i) % 120_000 + 1000 for i in range(tpb)]
        drain.append(trtllm_wire.stored(1 + n, None if n == 0 else n, [(n + 1, tokens)], 4096))
    body = json.dumps(drain).encode()
    decoder = engine_spec("trtllm").decoder(tpb)
    _, kept, peak = traced(lambda: decoder.decode([body]))
    print(
        f"events, TRT-LLM drain of 500 one-block stored events: {len(body):,} B; decode peak "
        f"{peak / len(body):.1f}x, kept {kept / len(body):.2f}x"
    )


def index() -> None:
    block, chains, length = 16, 200, 1000
    table = MemoryIndex(BlockHasher("m", block))

    def chain(number: int, salt: int) -> Stored:
        tokens = [(number * length * block + i) % 120_000 + 1000 for i in range(length * block)]
        hashes = tuple(EngineHash(salt + number * length + i + 1) for i in range(length))
        return Stored(0, None, hashes, struct.pack(f"<{len(tokens)}I", *tokens), block)

    async def store(replica: str, salt: int) -> None:
        for number in range(chains):
            await table.apply(ReplicaId(replica), [chain(number, salt)], 0.0)

    _, one, _ = traced(lambda: asyncio.run(store("a", 0)))
    _, two, _ = traced(lambda: asyncio.run(store("b", 10**12)))
    blocks = chains * length
    print(
        f"index, {blocks:,} blocks: {one / blocks:.0f} B per block held by one replica, "
        f"{(one + two) / blocks:.0f} B per block held by two"
    )


def _text(shape: str, chars: int) -> str:
    """``chars`` characters of ``shape`` (one of :data:`TEXT_SHAPES`), the same for a seed."""
    rng = random.Random(chars)
    if shape == "ascii_words":
        words = ["alpha", "river", "stone", "cloud", "green", "number", "seven", "quiet", "table", "light"]
        made = " ".join(rng.choice(words) for _ in range(chars // 5 + 1))
    elif shape == "cjk":
        made = "".join(map(chr, rng.choices(range(0x4E00, 0xA000), k=chars)))
    elif shape == "emoji":
        made = "".join(map(chr, rng.choices(range(0x1F600, 0x1F650), k=chars)))
    elif shape == "digits":
        made = "".join(rng.choices("0123456789", k=chars))
    elif shape == "whitespace":
        made = ("word" + " " * 996 + "\n" * 4) * (chars // 1000 + 1)
    elif shape == "latin1_bytes":
        made = rng.randbytes(chars).decode("latin-1")
    elif shape == "ascii_random":
        made = "".join(map(chr, rng.choices(range(0x20, 0x7F), k=chars)))
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return made[:chars]


TEXT_SHAPES = ("ascii_words", "cjk", "emoji", "digits", "whitespace", "latin1_bytes", "ascii_random")
"""The texts ``tokenizer`` encodes: words of ASCII letters and spaces, random CJK ideographs
(U+4E00–U+9FFF, 3 UTF-8 bytes each), random emoji (U+1F600–U+1F64F, 4 bytes), random digits, a word
in every 1,000 characters of spaces and newlines, random bytes read as latin-1 (1–2 bytes), and
random printable ASCII (U+0020–U+007E: letters, digits, punctuation)."""
TOKENIZER_CHARS = (4_500, 10_000, 50_000, 100_000, 250_000, 1_000_000, 4_000_000, 6_000_000)
TOKENIZER_PATHS = ("text", "chat")


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def tokenizer_one(path: str, shape: str, chars: int, max_prompt_tokens: int = 10**9) -> None:
    """One measure of ``tokenizer``, in this (fresh) process: prints one JSON line. With
    ``max_prompt_tokens`` (``refusal``), a text over it is refused: ``tokens`` is then the count
    the refusal gives (a lower bound when it came before the whole text was encoded)."""
    from concurrent.futures import ThreadPoolExecutor

    limits = TokenizeLimits(max_prompt_chars=10**9, max_prompt_tokens=max_prompt_tokens)
    tokenizer = default_tokenizer(limits)
    text = _text(shape, chars)
    messages = [{"role": "user", "content": text}]
    refused = False
    # what kvlb holds for it (the request's parse, made here before the measure, as kvlb's is)
    if path == "text":
        parsed = parse_request(json.dumps({"model": "m", "prompt": text}).encode(), "completions")
    else:
        parsed = parse_request(json.dumps({"model": "m", "messages": messages}).encode(), "chat")
    max_piece = piece_hold_chars(tokenizer, parsed)
    hold = tokenizing_hold_bytes(parsed, max_piece, max_prompt_tokens) - parsed.parsed_bytes
    long_piece = False

    def encode_text() -> int:
        """As kvlb's thread: the pieces' hold first, the whole's after a piece too long for it."""
        nonlocal long_piece, hold
        try:
            ids = tokenizer.encode_prompt(text, max_piece_chars=max_piece)
        except LongPiece:
            long_piece = True
            hold = tokenizing_hold_bytes(parsed) - parsed.parsed_bytes
            ids = tokenizer.encode_prompt(text)
        return len(compact_ids(ids))

    def encode_chat() -> int:
        """As kvlb's thread: rendered, then encoded in pieces within the pieces' hold, or whole."""
        nonlocal long_piece, hold
        if max_piece is None:
            return len(compact_ids(tokenizer.encode_chat(messages)))
        try:
            ids = tokenizer.encode_chat_in_pieces(messages, {}, max_piece, parsed.text_chars)
        except LongPiece:
            long_piece = True
            hold = tokenizing_hold_bytes(parsed) - parsed.parsed_bytes
            ids = tokenizer.encode_chat(messages)
        return len(compact_ids(ids))

    with ThreadPoolExecutor(1) as pool:  # as asyncio.to_thread: the encode runs in another thread
        pool.submit(tokenizer.encode_prompt, "warm up the encoder and the thread").result()
        pool.submit(tokenizer.encode_chat, [{"role": "user", "content": "warm up the template"}]).result()
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = _kib("VmRSS")
        started = time.perf_counter()
        cpu = time.process_time()  # every thread's CPU
        try:
            tokens = pool.submit(encode_text if path == "text" else encode_chat).result()
        except PromptTooLarge as exc:
            refused, tokens = True, exc.size
        took = time.perf_counter() - started
        cpu_s = time.process_time() - cpu
        rise = (_kib("VmHWM") - before) * 1024
    utf8 = len(text.encode("utf-8", "surrogatepass"))
    print(
        json.dumps(
            {
                "path": path,
                "shape": shape,
                "chars": chars,
                "utf8_bytes": utf8,
                "str_bytes": sys.getsizeof(text),
                "tokens": tokens,
                "refused": refused,
                "peak_rise_bytes": rise,
                "hold_bytes": hold,
                "long_piece": long_piece,
                "per_char": round(rise / chars, 1),
                "per_utf8_byte": round(rise / utf8, 1),
                "encode_s": round(took, 2),
                "cpu_s": round(cpu_s, 2),
            }
        )
    )


def tokenizer(argv: Sequence[str] = ()) -> None:
    """The ``tokenizer`` part: one fresh process per path, shape and size."""
    sizes = [int(float(arg) * 1e6) for arg in argv] or list(TOKENIZER_CHARS)
    print(
        "path  shape         chars      UTF-8 B     tokens   peak rise  B/char  B/UTF-8 B  encode s"
        "   hold (work)  rise/hold"
    )
    for chars in sizes:
        for shape in TEXT_SHAPES:
            for path in TOKENIZER_PATHS:
                run = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "loadtests.memory_figures",
                        "tokenizer-one",
                        path,
                        shape,
                        str(chars),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=600,
                    check=True,
                )
                r = json.loads(run.stdout.strip().splitlines()[-1])
                print(
                    f"{path:5} {shape:13} {chars:>9,} {r['utf8_bytes']:>11,} {r['tokens']:>10,} "
                    f"{r['peak_rise_bytes'] / 1e6:>7.0f} MB {r['per_char']:>7.1f} "
                    f"{r['per_utf8_byte']:>10.1f} "
                    f"{r['encode_s']:>9.2f} "
                    f"{r['hold_bytes'] / 1e6:>8.0f} MB{'*' if r['long_piece'] else ' '} "
                    f"{r['peak_rise_bytes'] / r['hold_bytes']:>9.2f}",
                    flush=True,
                )


REFUSAL_SHAPES = ("ascii_words", "latin1_bytes")
REFUSAL_LIMITS = (262_144, 10**9)
"""``refusal``: the default ``limits.max_prompt_tokens`` (4 M characters of either shape are far over
it) and a limit they are under."""


def refusal(argv: Sequence[str] = ()) -> None:
    """The ``refusal`` part: what a text costs that is far over ``max_prompt_tokens`` and refused, and
    the same text under the limit, for each path and shape of :data:`REFUSAL_SHAPES`, in a fresh
    process each (``tokenizer-one``): CPU seconds (of every thread) and the peak RSS rise. Sizes in
    millions of characters (default 4)."""
    sizes = [int(float(arg) * 1e6) for arg in argv] or [4_000_000]
    print("path  shape         chars        limit     tokens  refused  peak rise  CPU s  wall s  hold (work)")
    for chars in sizes:
        for shape in REFUSAL_SHAPES:
            for limit in REFUSAL_LIMITS:
                for path in TOKENIZER_PATHS:
                    command = [sys.executable, "-m", "loadtests.memory_figures", "tokenizer-one"]
                    command += [path, shape, str(chars), str(limit)]
                    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
                    r = json.loads(run.stdout.strip().splitlines()[-1])
                    print(
                        f"{path:5} {shape:13} {chars:>9,} {limit:>12,} {r['tokens']:>10,} "
                        f"{'yes' if r['refused'] else 'no':>7} {r['peak_rise_bytes'] / 1e6:>7.0f} MB "
                        f"{r['cpu_s']:>6.2f} {r['encode_s']:>7.2f} {r['hold_bytes'] / 1e6:>8.0f} MB",
                        flush=True,
                    )


PARTS: dict[str, Callable[[], None]] = {
    "bodies": bodies,
    "grpc": grpc,
    "ids": ids,
    "events": events,
    "index": index,
}


USAGE = (
    "usage: python -m loadtests.memory_figures [bodies|grpc|ids|events|index ...]\n"
    "       python -m loadtests.memory_figures tokenizer|refusal [MILLIONS_OF_CHARS ...]\n"
    "       python -m loadtests.memory_figures tokenizer-one text|chat SHAPE CHARS [MAX_PROMPT_TOKENS]"
)


def main(argv: Sequence[str]) -> int:
    """Runs the parts ``argv`` names (the default parts when it names none); 2 with the usage on
    stderr for arguments it does not take."""
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        run = _parsed(argv)
    except ValueError as exc:
        print(f"memory_figures: {exc}\n{USAGE}", file=sys.stderr)
        return 2
    run()
    return 0


def _parsed(argv: Sequence[str]) -> Callable[[], None]:
    """What ``argv`` asks for, checked before anything runs (ValueError: what is wrong)."""
    if argv[:1] in (["tokenizer"], ["refusal"]):
        for arg in argv[1:]:
            float(arg)
        return functools.partial(tokenizer if argv[0] == "tokenizer" else refusal, argv[1:])
    if argv[:1] == ["tokenizer-one"]:
        if len(argv) not in (4, 5) or argv[1] not in TOKENIZER_PATHS or argv[2] not in TEXT_SHAPES:
            raise ValueError(f"tokenizer-one takes a path of {TOKENIZER_PATHS} and a shape of {TEXT_SHAPES}")
        return functools.partial(tokenizer_one, argv[1], argv[2], int(argv[3]), *map(int, argv[4:5]))
    if argv[:1] == ["grpc-one"]:
        if len(argv) != 2 or argv[1] not in GRPC_SHAPES:
            raise ValueError(f"grpc-one takes a shape of {GRPC_SHAPES}")
        return functools.partial(grpc_one, argv[1])
    unknown = [name for name in argv if name not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}")
    return functools.partial(_run_parts, list(argv) or list(PARTS))


def _run_parts(names: Sequence[str]) -> None:
    for name in names:
        PARTS[name]()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
