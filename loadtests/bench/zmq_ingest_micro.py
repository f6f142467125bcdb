"""In-process micro-benchmark of a ZMQ source's handling of live messages in order (no sockets).

Not part of ``kvlb bench``: a probe of ``ZmqEventSource``'s per-message path (decode, the stream's
order, the batch emitted) alone, for comparing two revisions (run it with ``PYTHONPATH`` at each
one's tree; it reaches the source's ``_on_message``, which both sides of h-zmqcore have). Each
message is one SGLang batch of one ``BlockStored`` page, seqs in order from 0, built before timing.
Figures: CPU microseconds per message (``time.process_time``), the minimum and median over
``--rounds`` rounds of ``--messages`` each. Under ``valgrind --tool=callgrind`` the difference of
two runs' instruction counts (``--messages`` N and 2N, ``--rounds 1``) divided by N is the
instructions per message, which the machine's load does not move.

    PYTHONPATH=$PWD python loadtests/bench/zmq_ingest_micro.py [--messages 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import msgpack
import zmq.asyncio

from balancer.engines.sglang import SglangDecoder
from balancer.metrics import Metrics
from balancer.sources.base import IngestBatch
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId

BLOCK = 4


def message(seq: int) -> list[bytes]:
    """SGLang's ``[topic, seq8, msgpack batch]`` of one ``BlockStored`` page (hash ``seq + 1``)."""
    page = {
        "type": "BlockStored",
        "block_hashes": [seq + 1],
        "parent_block_hash": seq if seq else None,
        "token_ids": [seq * BLOCK + i for i in range(BLOCK)],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }
    payload: bytes = msgpack.packb([time.time(), [page], 0])
    return [b"kv", seq.to_bytes(8, "big"), payload]


async def rounds_us(messages: int, rounds: int) -> list[float]:
    """CPU microseconds per message of each round."""
    ctx = zmq.asyncio.Context()
    try:
        source = ZmqEventSource(
            ReplicaId("r"),
            "tcp://127.0.0.1:1",  # never connected: only the per-message path runs
            ctx=ctx,
            decoder=SglangDecoder(block_size=BLOCK),
            metrics=Metrics.create(),
        )
        built = [message(seq) for seq in range(messages * rounds)]
        emitted: list[IngestBatch] = []
        out: list[float] = []
        for index in range(rounds):
            started = time.process_time()
            for frames in built[index * messages : (index + 1) * messages]:
                await source._on_message(frames, False, emitted.append)
            out.append((time.process_time() - started) / messages * 1e6)
            assert len(emitted) == messages, "every message is taken in order"
            emitted.clear()
        return out
    finally:
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (the first warms up too)")
    args = parser.parse_args()
    per = asyncio.run(rounds_us(args.messages, args.rounds))
    result = {
        "messages_per_round": args.messages,
        "rounds": args.rounds,
        "cpu_us_per_message_min": round(min(per), 2),
        "cpu_us_per_message_median": round(statistics.median(per), 2),
    }
    print(json.dumps(result))
    print(f"{'messages/round':>15} {'rounds':>6} {'CPU µs/msg min':>15} {'median':>8}")
    print(
        f"{args.messages:>15} {args.rounds:>6} {result['cpu_us_per_message_min']:>15} "
        f"{result['cpu_us_per_message_median']:>8}"
    )


if __name__ == "__main__":
    main()
