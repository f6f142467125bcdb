"""The emulator's SGLang/vLLM wire encoder and hashes against goldens and real engine captures."""

from __future__ import annotations

import hashlib
import struct
from itertools import pairwise
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from wire_hashes import VLLM_NONE_HASH, sglang_page_hashes, vllm_block_hash, vllm_block_hashes

from replicas.wire.sglang import (
    REPLAY_END,
    KvEventEncoder,
    digest_to_i64,
    frames,
    page_digest,
    parse_replay_request,
    replay_reply,
    salt_seed,
)

CAPTURES = Path(__file__).resolve().parents[1] / "golden" / "real"
"""The real engine captures (``tests/golden/real/README.md``): part of the tree, so never skipped."""


def capture_files(folder: str) -> list[Path]:
    files = sorted((CAPTURES / folder).glob("*.hex"))
    assert files, f"no captured frames in {CAPTURES / folder}"
    return files


def read_capture(path: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in path.read_text().split()]


def capture_batches(folder: str) -> list[list[Any]]:
    return [msgpack.unpackb(read_capture(path)[2], raw=False) for path in capture_files(folder)]


def all_capture_paths() -> list[Path]:
    return capture_files("sglang-0.5.23-cpu") + capture_files("vllm-0.32.0-cpu")


# ------------------------------------------------------------------------------------------ hashes


def test_sglang_page_hash_goldens() -> None:
    """The five goldens produced by SGLang's own ``RadixKey.hash_page``.

    They are quoted in docs/reference/engine-events.md §2.4."""

    def hashes(tokens: list[int], page_size: int, **kwargs: Any) -> list[int]:
        return [value for value, _ in sglang_page_hashes(tokens, page_size, **kwargs)]

    assert hashes([1, 2, 3, 4], 4) == [-3488128144981237669]
    assert hashes([1, 2, 3, 4, 5], 4)[1] == -3787494577174227566
    assert hashes([10, 20, 30, 40], 4, bigram=True) == [-2735951481331064195]
    assert hashes([1, 2, 3, 4, 5, 6], 4, bigram=True) == [-638950109823820341, 3604587133525381017]
    assert hashes([1, 2, 3, 4], 4, extra_key="salt-A") == [1848708812856982025]


def test_salted_chain_starts_from_the_salt_seed() -> None:
    """SGLang 0.5.23 seeds a salted request's event-hash chain with SHA-256("sglang-cache-salt-v1\\0" +
    salt) as the root page's prior digest; no extra-key framing."""
    seed = hashlib.sha256(b"sglang-cache-salt-v1\x00tenant-a").digest()
    assert salt_seed("tenant-a") == seed
    root = hashlib.sha256(seed + struct.pack("<2I", 1, 2)).digest()
    child = hashlib.sha256(root + struct.pack("<2I", 7, 8)).digest()
    pages = sglang_page_hashes([1, 2, 7, 8], 2, cache_salt="tenant-a")
    assert pages == [(digest_to_i64(root), root), (digest_to_i64(child), child)]
    assert pages != sglang_page_hashes([1, 2, 7, 8], 2)  # the salt namespaces the chain
    assert pages != sglang_page_hashes([1, 2, 7, 8], 2, extra_key="tenant-a")  # not the older framing


def test_page_digest_layout() -> None:
    """Namespace framing first, then the prior digest, then LE u32 tokens; pairs feed both tokens."""
    prior = hashlib.sha256(b"parent").digest()
    expected = hashlib.sha256(struct.pack("<I", 2) + b"ns" + prior + struct.pack("<4I", 7, 8, 8, 9)).digest()
    assert page_digest(prior, [(7, 8), (8, 9)], extra_key="ns") == expected
    assert digest_to_i64(expected) == int.from_bytes(expected[:8], "big", signed=True)
    with pytest.raises(ValueError, match="32 bytes"):
        page_digest(b"short", [1])


def test_sglang_partial_last_page_and_prior_chaining() -> None:
    pages = sglang_page_hashes(list(range(1, 11)), 4)
    assert len(pages) == 3  # 4 + 4 + 2: the short last page is hashed too
    continued = sglang_page_hashes(list(range(5, 11)), 4, prior_digest=pages[0][1])
    assert continued == pages[1:]


def test_sglang_capture_hashes_reproduced_from_tokens() -> None:
    """Every BlockStored hash of the SGLang 0.5.23 capture follows from its tokens and its parent."""
    digests: dict[int, bytes] = {}
    checked = total = 0
    for _ts, events, _rank in capture_batches("sglang-0.5.23-cpu"):
        for event in events:
            if event["type"] != "BlockStored":
                continue
            total += len(event["block_hashes"])
            parent = event["parent_block_hash"]
            prior = None if parent is None else digests[parent]
            pages = sglang_page_hashes(event["token_ids"], event["block_size"], prior_digest=prior)
            assert [value for value, _ in pages] == event["block_hashes"]
            digests.update((value, digest) for value, digest in pages)
            checked += len(pages)
    assert checked == total > 0


def test_vllm_capture_hashes_reproduced_from_tokens() -> None:
    """Every BlockStored hash of the vLLM 0.32.0 capture follows from pickle protocol 5 + SHA-256."""
    digests: dict[int, bytes] = {}
    checked = total = 0
    for _ts, events, _rank in capture_batches("vllm-0.32.0-cpu"):
        for event in events:
            if event["type"] != "BlockStored":
                continue
            total += len(event["block_hashes"])
            parent = event["parent_block_hash"]
            prior = None if parent is None else digests[parent]
            size = event["block_size"]
            for index, expected in enumerate(event["block_hashes"]):
                block = event["token_ids"][index * size : (index + 1) * size]
                value, prior = vllm_block_hash(prior, block)
                assert value == expected
                digests[value] = prior
                checked += 1
    assert checked == total > 0


def test_vllm_block_hashes_chain_matches_capture_chain() -> None:
    """Frames 001-004 each store one block chained to the previous frame's block."""
    events = [batch[1][0] for batch in capture_batches("vllm-0.32.0-cpu")[:4]]
    for previous, event in pairwise(events):
        assert event["parent_block_hash"] == previous["block_hashes"][0]
    tokens = [token for event in events for token in event["token_ids"]]
    chain = vllm_block_hashes([*tokens, 1, 2, 3], 128)  # the 3 extra tokens make no partial block
    assert [value for value, _ in chain] == [event["block_hashes"][0] for event in events]


def test_vllm_none_hash_is_pickled_seed_string() -> None:
    """Protocol 5: PROTO 5, FRAME of 18 bytes, SHORT_BINUNICODE of 14, MEMOIZE, STOP."""
    pickled = b"\x80\x05\x95" + (18).to_bytes(8, "little") + b"\x8c\x0evllm-none-hash\x94."
    assert hashlib.sha256(pickled).digest() == VLLM_NONE_HASH


# ------------------------------------------------------------------------------- byte-exact events


def rebuild(encoder: KvEventEncoder, event: dict[str, Any]) -> object:
    kind = event["type"]
    if kind == "BlockStored":
        return encoder.block_stored(
            event["block_hashes"],
            event["parent_block_hash"],
            event["token_ids"],
            event["block_size"],
            medium=event["medium"],
            lora_name=event.get("lora_name"),
        )
    if kind == "BlockRemoved":
        return encoder.block_removed(event["block_hashes"], medium=event["medium"])
    assert kind == "AllBlocksCleared"
    return encoder.all_blocks_cleared()


@pytest.mark.parametrize("path", all_capture_paths(), ids=lambda path: path.name)
def test_reencoding_a_real_capture_is_byte_exact(path: Path) -> None:
    """Decode a real frame, re-encode its logical content, and get the engine's exact bytes back."""
    topic, seq, payload = read_capture(path)
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    encoder = KvEventEncoder(flavor="vllm" if path.name.startswith("vllm") else "sglang", encoding="map")
    rebuilt = encoder.batch(ts, [rebuild(encoder, event) for event in events], rank)
    assert frames(topic.decode(), int.from_bytes(seq, "big"), rebuilt) == [topic, seq, payload]


def test_array_encoding_matches_msgspec_golden() -> None:
    """The positional-era bytes msgspec produced for docs/reference/engine-events.md §1.4's SGLang example."""
    golden = bytes.fromhex(
        "93cb41d954fc402000009497ab426c6f636b53746f72656491d3cf97adeedb59e05bc0940102030404c0a3475055"
        "97ab426c6f636b53746f72656491d3cb701dbfc2cfd592d3cf97adeedb59e05b940506070804c0a347505593ac426c"
        "6f636b52656d6f76656491d3cb701dbfc2cfd592a347505591b0416c6c426c6f636b73436c656172656400"
    )
    # The notes' second hash is that of the short page [5] chained to [1, 2, 3, 4], not of [5, 6, 7, 8].
    (first, _), (second, _) = sglang_page_hashes([1, 2, 3, 4, 5], 4)
    assert (first, second) == (-3488128144981237669, -3787494577174227566)
    encoder = KvEventEncoder(flavor="sglang", encoding="array")
    events = [
        encoder.block_stored([first], None, [1, 2, 3, 4], 4),
        encoder.block_stored([second], first, [5, 6, 7, 8], 4),
        encoder.block_removed([second]),
        encoder.all_blocks_cleared(),
    ]
    assert encoder.batch(1700000000.5, events, 0) == golden


def test_vllm_array_fields() -> None:
    encoder = KvEventEncoder(flavor="vllm", encoding="array")
    stored = encoder.block_stored([5, 6], None, list(range(8)), 4, lora_name="ad", cache_salt="s")
    assert stored == [
        "BlockStored", [5, 6], None, list(range(8)), 4, None, "GPU", "ad",
        [["ad", "s"], ["ad"]], 0, "full_attention", None,
    ]  # fmt: skip
    assert encoder.block_removed([5]) == ["BlockRemoved", [5], "GPU", 0]
    assert encoder.all_blocks_cleared() == ["AllBlocksCleared"]


def test_vllm_map_omits_default_sliding_window() -> None:
    stored = KvEventEncoder(flavor="vllm").block_stored([1], 9, [3, 4], 2)
    assert isinstance(stored, dict)
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    ]  # fmt: skip
    assert stored["extra_keys"] == [None]


def test_sglang_salted_event_carries_the_salt_as_each_era_did() -> None:
    """Positional era: trailing ``metadata`` map. 0.5.23 maps: top-level ``cache_salt``, and a field at
    its default (``medium: None``) left out, not written as nil."""
    array = KvEventEncoder(encoding="array").block_stored([1], None, [1, 2], 2, cache_salt="tenant")
    assert array == ["BlockStored", [1], None, [1, 2], 2, None, "GPU", {"cache_salt": "tenant"}]
    mapped = KvEventEncoder().block_stored([1], None, [1, 2], 2, cache_salt="tenant", medium=None)
    assert mapped == {
        "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
        "block_size": 2, "lora_id": None, "cache_salt": "tenant",
    }  # fmt: skip
    salted = KvEventEncoder().block_stored([1], None, [1, 2], 2, cache_salt="tenant")
    assert isinstance(salted, dict) and list(salted)[-2:] == ["medium", "cache_salt"]
    assert KvEventEncoder().block_removed([1], medium=None) == {"type": "BlockRemoved", "block_hashes": [1]}
    assert KvEventEncoder(encoding="array").block_removed([1], medium=None) == ["BlockRemoved", [1], None]
    with pytest.raises(ValueError, match="lora_name"):
        KvEventEncoder().block_stored([1], None, [1, 2], 2, lora_name="x")


def test_hash_sign_follows_the_flavour() -> None:
    """SGLang sends signed i64 (msgpack int64 0xd3), vLLM unsigned u64 (uint64 0xcf)."""
    big = (1 << 63) + 5
    sglang = KvEventEncoder(encoding="array")
    payload = sglang.batch(1.0, [sglang.block_removed([big])], 0)
    assert msgpack.unpackb(payload)[1][0][1] == [big - (1 << 64)]
    assert b"\xd3" + (big - (1 << 64)).to_bytes(8, "big", signed=True) in payload
    vllm = KvEventEncoder(flavor="vllm", encoding="array")
    payload = vllm.batch(1.0, [vllm.block_removed([-1])], None)
    assert msgpack.unpackb(payload) == [1.0, [["BlockRemoved", [(1 << 64) - 1], "GPU", 0]], None]


def test_bigram_pages_are_pairs() -> None:
    tokens = [10, 20, 30, 40, 50]
    pairs = list(pairwise(tokens))
    (value, _), (tail, _) = sglang_page_hashes(tokens, 3, bigram=True)
    encoder = KvEventEncoder()
    event = encoder.block_stored([value, tail], None, pairs, 3)
    assert isinstance(event, dict)
    assert event["token_ids"] == [[10, 20], [20, 30], [30, 40], [40, 50]]
    with pytest.raises(ValueError, match="bigram"):
        KvEventEncoder(flavor="vllm").block_stored([value], None, pairs[:3], 3)


@pytest.mark.parametrize(
    ("hashes", "token_count", "block_size"),
    [([], 0, 4), ([1], 5, 4), ([1, 2], 4, 4), ([1], 3, 0)],
)
def test_block_stored_rejects_inconsistent_shapes(
    hashes: list[int], token_count: int, block_size: int
) -> None:
    with pytest.raises(ValueError):
        KvEventEncoder().block_stored(hashes, None, list(range(token_count)), block_size)


def test_map_envelope_names_the_rank_per_flavour() -> None:
    for flavor, key in (("sglang", "attn_dp_rank"), ("vllm", "data_parallel_rank")):
        encoder = KvEventEncoder(flavor=flavor, envelope="map")  # type: ignore[arg-type]
        body = msgpack.unpackb(encoder.batch(2, [], 3))
        assert body == {"ts": 2.0, "events": [], key: 3}


# ----------------------------------------------------------------------------------------- framing


def test_frames_topic_seq_and_epoch() -> None:
    assert frames("kv", 258, b"p") == [b"kv", b"\x00" * 6 + b"\x01\x02", b"p"]
    assert frames("kv", 0, b"p", epoch="ab12")[0] == b"kv\x00sgl-kv-epoch=ab12"
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError):
            frames("kv", bad, b"")


def test_replay_framing() -> None:
    assert replay_reply("kv", 7, b"x") == [b"", b"kv", (7).to_bytes(8, "big"), b"x"]
    assert REPLAY_END == [b"", b"", b"\xff" * 8, b""]
    assert parse_replay_request([b"id", b"", (42).to_bytes(8, "big")]) == 42
    for bad in ([b"id", (42).to_bytes(8, "big")], [b"id", b"x", b"\x00" * 8], [b"id", b"", b"\x00" * 4]):
        with pytest.raises(ValueError):
            parse_replay_request(bad)


def test_replay_round_trip_over_real_zmq_sockets() -> None:
    """A DEALER asks a ROUTER for replay from seq 1 and gets each batch, then the END marker."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        router.bind("inproc://replay-test")
        dealer.connect("inproc://replay-test")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        assert router.poll(2000)
        request = router.recv_multipart()
        start = parse_replay_request(request)
        for seq, payload in ((0, b"a"), (1, b"b"), (2, b"c")):
            if seq >= start:
                router.send_multipart([request[0], *replay_reply("kv", seq, payload)])
        router.send_multipart([request[0], *REPLAY_END])
        received: list[list[bytes]] = []
        while dealer.poll(2000) and len(received) < 3:
            received.append(dealer.recv_multipart())
        assert received == [replay_reply("kv", 1, b"b"), replay_reply("kv", 2, b"c"), REPLAY_END]
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()
