"""The SGLang/vLLM golden cases: a message each, and the decode a correct decoder must give.

Expectations are derived from what ``sglang_encoder`` encoded, never from the decoder.
``python tests/golden/sglang_cases.py --write`` (re)writes ``tests/golden/sglang/*.hex|*.json``;
the tests only compare against those files, they never write them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from sglang_encoder import (
    SPEC_SGLANG_HASHES,
    SPEC_VLLM_HASH,
    SPEC_VLLM_TOKENS,
    TOPIC,
    Case,
    batch_array,
    batch_map,
    exp_cleared,
    exp_removed,
    exp_stored,
    expect,
    live_frames,
    seq_frame,
    sglang_map_stored,
    sglang_page_digests,
    sglang_page_hashes,
    sglang_stored,
    tagged,
    vllm_stored,
)

FIXTURE_DIR = Path(__file__).parent / "sglang"


def cases() -> list[Case]:
    """Every golden case, in a stable order."""
    return [*_spec_cases(), *_sglang_cases(), *_vllm_cases(), *_edge_cases()]


def _spec_cases() -> list[Case]:
    h1, h2 = SPEC_SGLANG_HASHES
    sglang_events = [
        sglang_stored([h1], None, [1, 2, 3, 4], 4),
        sglang_stored([h2], h1, [5, 6, 7, 8], 4),
        ["BlockRemoved", [h2], "GPU"],
        ["AllBlocksCleared"],
    ]
    vllm_positional = [
        vllm_stored([SPEC_VLLM_HASH], None, SPEC_VLLM_TOKENS, 16),
        ["BlockRemoved", [SPEC_VLLM_HASH], "GPU", 0],
    ]
    vllm_map = tagged(
        "BlockStored",
        block_hashes=[SPEC_VLLM_HASH],
        parent_block_hash=None,
        token_ids=SPEC_VLLM_TOKENS,
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    stored_vllm = exp_stored([SPEC_VLLM_HASH], None, SPEC_VLLM_TOKENS, 16)
    return [
        Case(
            "spec-sglang-array",
            "docs/reference/engine-events.md §1.4 SGLang example: two chained pages, an eviction, a clear",
            live_frames(batch_array(1700000000.5, sglang_events, 0), 0),
            expect(
                [
                    exp_stored([h1], None, [1, 2, 3, 4], 4),
                    exp_stored([h2], h1, [5, 6, 7, 8], 4),
                    exp_removed([h2]),
                    exp_cleared(),
                ],
                seq=0,
                ts=1700000000.5,
            ),
        ),
        Case(
            "spec-vllm-positional",
            "docs/reference/engine-events.md §1.4 vLLM positional era"
            " (12-element BlockStored, 4-element BlockRemoved)",
            live_frames(batch_array(1.5, vllm_positional, 0), 1),
            expect([stored_vllm, exp_removed([SPEC_VLLM_HASH])], seq=1, ts=1.5),
        ),
        Case(
            "spec-vllm-map",
            "docs/reference/engine-events.md §1.4 vLLM map era as captured from vLLM 0.26.0",
            live_frames(batch_array(1789095808.8378847, [vllm_map], 0), 2),
            expect([stored_vllm], seq=2, ts=1789095808.8378847),
        ),
    ]


def _sglang_cases() -> list[Case]:
    tokens = list(range(100, 112))  # three pages of 4
    hashes = sglang_page_hashes(tokens, 4)
    bigram_tokens = list(range(1, 10))  # 8 pairs: two full pages of 4 pairs
    bigram_hashes = sglang_page_hashes(bigram_tokens, 4, bigram=True)
    pairs = [[bigram_tokens[j], bigram_tokens[j + 1]] for j in range(len(bigram_tokens) - 1)]
    salted = sglang_page_hashes([1, 2, 3, 4], 4, extra_key="salt-A")
    seeded = sglang_page_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a")
    seeded_tail = sglang_page_hashes(
        [9, 10, 11, 12], 4, prior=sglang_page_digests([1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a")[-1]
    )
    return [
        Case(
            "sglang-legacy-array",
            "old SGLang: 6-element BlockStored (no medium), 2-element envelope [ts, events]",
            live_frames(
                batch_array(10.0, [sglang_stored(hashes[:1], None, tokens[:4], 4, legacy=True)], legacy=True),
                3,
            ),
            expect([exp_stored(hashes[:1], None, tokens[:4], 4)], seq=3, ts=10.0, dp_rank=None),
        ),
        Case(
            "sglang-tagged-maps-coalesced",
            "SGLang 0.5.23: tagged-map events, three pages coalesced in one BlockStored, then removal",
            live_frames(
                batch_array(
                    11.0,
                    [
                        sglang_map_stored(hashes, None, tokens, 4),
                        tagged("BlockRemoved", block_hashes=hashes[1:], medium="GPU"),
                    ],
                    0,
                ),
                4,
            ),
            expect([exp_stored(hashes, None, tokens, 4), exp_removed(hashes[1:])], seq=4, ts=11.0),
        ),
        Case(
            "sglang-map-envelope-attn-dp",
            "map envelope {ts, events, attn_dp_rank} on DP rank 2",
            live_frames(
                batch_map(
                    12.0,
                    [sglang_map_stored(hashes[:1], None, tokens[:4], 4), tagged("AllBlocksCleared")],
                    2,
                    "attn_dp_rank",
                ),
                5,
            ),
            expect(
                [exp_stored(hashes[:1], None, tokens[:4], 4, dp_rank=2), exp_cleared(2)],
                seq=5,
                ts=12.0,
                dp_rank=2,
            ),
        ),
        Case(
            "sglang-bigram",
            "EAGLE bigram pages: 8 pairs = two pages of 4 pairs spanning 9 raw tokens",
            live_frames(batch_array(13.0, [sglang_stored(bigram_hashes, None, pairs, 4)], 0), 6),
            expect([exp_stored(bigram_hashes, None, bigram_tokens, 4, lookahead=1)], seq=6, ts=13.0),
        ),
        Case(
            "sglang-salted",
            "older salted BlockStoredWithMetadata: 8th positional element {cache_salt}, and the "
            "pre-0.5.23 map form with a metadata map (kvlb still reads both)",
            live_frames(
                batch_array(
                    14.0,
                    [
                        sglang_stored(salted, None, [1, 2, 3, 4], 4, salt="salt-A"),
                        {
                            **sglang_map_stored(salted, None, [1, 2, 3, 4], 4),
                            "metadata": {"cache_salt": "salt-A"},
                        },
                    ],
                    0,
                ),
                7,
            ),
            expect([exp_stored(salted, None, [1, 2, 3, 4], 4, cache_salt="salt-A")] * 2, seq=7, ts=14.0),
        ),
        Case(
            "sglang-0.5.23-salted",
            "SGLang 0.5.23: top-level cache_salt, the salt-seeded hash chain, a child page chained on, "
            "and omit_defaults (a BlockStored and a BlockRemoved without medium)",
            live_frames(
                batch_array(
                    15.0,
                    [
                        sglang_map_stored(seeded, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a"),
                        sglang_map_stored(seeded_tail, seeded[-1], [9, 10, 11, 12], 4, cache_salt="tenant-a"),
                        sglang_map_stored(hashes[:1], None, tokens[:4], 4, medium=None),
                        tagged("BlockRemoved", block_hashes=seeded_tail),
                    ],
                    0,
                ),
                8,
            ),
            expect(
                [
                    exp_stored(seeded, None, [1, 2, 3, 4, 5, 6, 7, 8], 4, cache_salt="tenant-a"),
                    exp_stored(seeded_tail, seeded[-1], [9, 10, 11, 12], 4, cache_salt="tenant-a"),
                    exp_stored(hashes[:1], None, tokens[:4], 4),
                    exp_removed(seeded_tail),
                ],
                seq=8,
                ts=15.0,
            ),
        ),
        Case(
            "sglang-partial-page",
            "a coalesced store whose last page is short (dropped) and a lone short page (dropped)",
            live_frames(
                batch_array(
                    15.0,
                    [
                        sglang_stored(hashes, None, tokens[:10], 4),
                        sglang_stored([hashes[0]], None, [7, 8], 4),
                    ],
                    0,
                ),
                8,
            ),
            expect([exp_stored(hashes[:2], None, tokens[:8], 4)], seq=8, ts=15.0, ignored=2),
        ),
    ]


def _vllm_cases() -> list[Case]:
    tokens = list(range(1000, 1048))  # three blocks of 16
    ints = [0xF000_0000_0000_0001 + i for i in range(3)]  # u64 above 2^63: msgpack uint64
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
    return [
        Case(
            "vllm-positional-lora",
            "vLLM positional, three blocks in one event, LoRA named by lora_name and extra_keys",
            live_frames(
                batch_array(
                    20.0,
                    [
                        vllm_stored(
                            ints,
                            None,
                            tokens,
                            16,
                            lora_id=1,
                            lora_name="sql-lora",
                            extra_keys=[["sql-lora"]] * 3,
                        )
                    ],
                    0,
                ),
                9,
            ),
            expect([exp_stored(ints, None, tokens, 16, lora_name="sql-lora")], seq=9, ts=20.0),
        ),
        Case(
            "vllm-map-bytes-hashes",
            "vLLM map era with 32-byte digest hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), map envelope",
            live_frames(
                batch_map(
                    21.0,
                    [
                        tagged(
                            "BlockStored",
                            block_hashes=digests[1:3],
                            parent_block_hash=digests[0],
                            token_ids=tokens[:32],
                            block_size=16,
                            lora_id=None,
                            medium="GPU",
                            lora_name=None,
                            extra_keys=[None, None],
                            group_idx=0,
                            kv_cache_spec_kind="full_attention",
                        ),
                        tagged("BlockRemoved", block_hashes=[digests[2]], medium="GPU", group_idx=0),
                    ],
                    1,
                    "data_parallel_rank",
                ),
                10,
            ),
            expect(
                [
                    exp_stored(digests[1:3], digests[0], tokens[:32], 16, dp_rank=1),
                    exp_removed([digests[2]], 1),
                ],
                seq=10,
                ts=21.0,
                dp_rank=1,
            ),
        ),
        Case(
            "vllm-hybrid-groups",
            "hybrid model: sliding-window group 0 dropped, full-attention group 1 kept (stores and removals)",
            live_frames(
                batch_array(
                    22.0,
                    [
                        vllm_stored(ints[:1], None, tokens[:16], 16, group_idx=0, kind="sliding_window"),
                        vllm_stored(ints[:1], None, tokens[:16], 16, group_idx=1),
                        ["BlockRemoved", ints[:1], "GPU", 0],
                        ["BlockRemoved", ints[:1], "GPU", 1],
                    ],
                    0,
                ),
                11,
            ),
            expect(
                [exp_stored(ints[:1], None, tokens[:16], 16), exp_removed(ints[:1])],
                seq=11,
                ts=22.0,
                ignored=2,
            ),
        ),
        Case(
            "vllm-multimodal-cut",
            "extra_keys the router cannot key (multimodal) cut the chain before that block",
            live_frames(
                batch_array(
                    23.0, [vllm_stored(ints, None, tokens, 16, extra_keys=[None, [["img-7f3a", 0]], None])], 0
                ),
                12,
            ),
            expect([exp_stored(ints[:1], None, tokens[:16], 16)], seq=12, ts=23.0, ignored=1),
        ),
    ]


def _edge_cases() -> list[Case]:
    tokens = [5, 6, 7, 8]
    hashes = sglang_page_hashes(tokens, 4)
    hex_hash = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    good = sglang_stored(hashes, None, tokens, 4)
    return [
        Case(
            "topic-epoch-barrier",
            "newest SGLang topic metadata: epoch and snapshot barrier (empty events)",
            live_frames(
                batch_array(30.0, [], 0),
                13,
                TOPIC + b"\x00sgl-kv-epoch=4f1c2a9e\x00sgl-kv-snapshot=barrier-3",
            ),
            expect([], seq=13, ts=30.0, epoch="4f1c2a9e"),
        ),
        Case(
            "replay-two-frames",
            "a replay reply as read by a DEALER once the empty delimiter is stripped: [seq, payload]",
            [seq_frame(14), batch_array(31.0, [good], 0)],
            expect([exp_stored(hashes, None, tokens, 4)], seq=14, ts=31.0),
        ),
        Case(
            "hex-string-hashes",
            "hex digest hashes (first 16 hex digits kept)",
            live_frames(
                batch_array(32.0, [tagged("BlockRemoved", block_hashes=[hex_hash], medium=None)], 0), 15
            ),
            expect([exp_removed([hex_hash])], seq=15, ts=32.0),
        ),
        Case(
            "filtered-and-malformed",
            "other media and unknown tags are ignored; malformed events are skipped, neighbours kept",
            live_frames(
                batch_array(
                    33.0,
                    [
                        sglang_stored(hashes, None, tokens, 4, medium="CPU_PINNED"),
                        ["BlockRemoved", hashes, "DISK"],
                        ["Ignored", 1, 2],
                        ["BlockStored", hashes, None, tokens, 4, None, "GPU"],
                        ["BlockStored", hashes, None, tokens, 4, None, "GPU", None, None, "zero"],
                        ["BlockStored", hashes, None, tokens * 3, 4, None, "GPU"],
                        ["BlockRemoved", "not-a-list"],
                        "not-an-event",
                        ["AllBlocksCleared"],
                    ],
                    0,
                ),
                16,
            ),
            expect(
                [exp_stored(hashes, None, tokens, 4), exp_cleared()], seq=16, ts=33.0, ignored=3, errors=4
            ),
        ),
    ]


def fixture_paths(case: Case) -> tuple[Path, Path]:
    return FIXTURE_DIR / f"{case.name}.hex", FIXTURE_DIR / f"{case.name}.json"


def hex_text(frames: list[bytes]) -> str:
    """One frame per line, hex, like the real captures."""
    return "".join(frame.hex() + "\n" for frame in frames)


def sidecar_text(case: Case) -> str:
    return json.dumps({"description": case.description, "expected": case.expected}, indent=1) + "\n"


def write_all() -> None:
    FIXTURE_DIR.mkdir(exist_ok=True)
    for case in cases():
        hex_path, json_path = fixture_paths(case)
        hex_path.write_text(hex_text(case.frames))
        json_path.write_text(sidecar_text(case))


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/golden/sglang_cases.py --write")
    write_all()
