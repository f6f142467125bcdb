"""What a replay poll of a silent publisher costs kvlb (I/O: a micro-benchmark, prints one JSON line).

A real :class:`~balancer.sources.zmq_sub.ZmqEventSource` follows a publisher on 127.0.0.1 (a PUB and
a ROUTER replay socket served by a thread of this process, answering SGLang's end marker) that sent
one batch and then stays silent, so the source polls the replay socket at ``--interval-s`` for
``--seconds``. Reported: the polls made, and per poll the CPU of the source's event-loop thread and
of the whole process (ZMQ's I/O threads and the replay server included).

    python -m loadtests.bench.replay_poll [--seconds 5] [--interval-s 0.002]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import threading
import time

import msgpack
import zmq
import zmq.asyncio

from balancer.engines.sglang import SglangDecoder
from balancer.metrics import Metrics
from balancer.sources.zmq_settings import ZmqSourceSettings
from balancer.sources.zmq_sub import ZmqEventSource
from balancer.types import ReplicaId

END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def _serve(router: zmq.Socket[bytes], stop: threading.Event) -> None:
    while not stop.is_set():
        if router.poll(50):
            identity, *_ = router.recv_multipart()
            router.send_multipart([identity, *END])


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measure(seconds: float, interval_s: float) -> dict[str, float]:
    sync_ctx = zmq.Context()
    pub = sync_ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = sync_ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(router, stop), daemon=True)
    server.start()
    ctx = zmq.asyncio.Context()
    metrics = Metrics.create()
    settings = ZmqSourceSettings(replay_poll_min_s=interval_s, replay_poll_max_s=interval_s)
    source = ZmqEventSource(
        ReplicaId("bench"),
        f"tcp://127.0.0.1:{pub_port}",
        ctx=ctx,
        decoder=SglangDecoder(block_size=4),
        metrics=metrics,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        settings=settings,
    )
    task = asyncio.create_task(source.run(lambda batch: None))
    try:
        while source.status().last_seq is None:  # one live batch, so that the silence is polled
            pub.send_multipart([b"", (0).to_bytes(8, "big"), msgpack.packb([time.time(), [], 0])])
            await asyncio.sleep(0.05)
        polls = "kvlb_events_replay_polls_total"

        def count() -> float:
            labels = {"replica": "bench", "outcome": "nothing"}
            return metrics.registry.get_sample_value(polls, labels) or 0.0

        before, thread0, process0 = count(), time.thread_time(), _process_cpu_s()
        await asyncio.sleep(seconds)
        made = count() - before
        thread_s, process_s = time.thread_time() - thread0, _process_cpu_s() - process0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        stop.set()
        server.join()
        ctx.destroy(linger=0)
        sync_ctx.destroy(linger=0)
    return {
        "polls": made,
        "loop_thread_cpu_us_per_poll": round(1e6 * thread_s / max(made, 1), 1),
        "process_cpu_us_per_poll": round(1e6 * process_s / max(made, 1), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--interval-s", type=float, default=0.002)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.seconds, args.interval_s))))


if __name__ == "__main__":
    main()
