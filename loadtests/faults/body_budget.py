"""Peak RSS of ``kvlb serve`` under a burst of large bodies, with the byte budget of the bodies held
at once (``limits.max_inflight_body_bytes``) small and at its largest (in effect off) (I/O).

``python -m loadtests.faults.body_budget`` from the repository root starts, for each run, one
emulated SGLang replica and a fresh ``kvlb serve`` (so that ``VmHWM`` is that run's peak), sends
``--bodies`` completion requests of ``--body-mib`` MiB at once (a short token-id prompt padded by an
unknown field: parsed, dropped, forwarded as is; each request succeeds), and reads ``VmHWM`` from
``/proc/<pid>/status`` before and after. Runs alternate off, on, on, off (``--pairs`` times two), so
that the two settings meet the same machine; the figures are printed as JSON, then as a table with
the ratio of the medians.

``--face grpc`` sends the same burst as ``Generate`` calls over one gRPC channel (the message padded
by an unknown field: :func:`padded_message`). ``--small-calls N`` times ``N`` small ``Generate``
calls one after the other instead (one run, no burst): the cost of a call on the gRPC face.
``--plumbing N`` times, in one process on 127.0.0.1, ``N`` small calls to each of two bare grpc
handlers (no kvlb), alternated in blocks: the unary-request handler kvlb had and the stream-request
one it has (a timeout, one read, :meth:`~balancer.service.admission.Admission.give_back`), so
the cost of the handler's shape, which a live run cannot resolve, is seen alone.
``--unread N`` measures what a gRPC call that waits for admission costs kvlb before it is let in
(one run): with ``max_inflight`` 1 held by a call to a stalled replica, ``N`` calls of ``--body-mib``
MiB wait in the queue; ``VmRSS`` is read before they are sent and once they all wait.

``--shape`` picks the bodies: ``pad`` (above), or the chats whose parsed form weighs most over
their bytes, sent to ``/v1/chat/completions`` and tokenized in kvlb's threads: ``tiny_messages``
(one-letter messages, about 8.7× the body parsed) and ``content_parts`` (one message of two-letter
text parts, about 9×); or ``long_text``, text completions of ASCII words (about 170,000 tokens a
MiB), each tokenized whole in a thread (the tokenizer's working memory: about 100 B a character
for such text, ``python -m loadtests.memory_figures tokenizer``); or ``long_chat``, chats of a
short system message and a user message of as many such words (a RAG context, in lines of 60
words). Their answers are the emulated
replica's (it has no tokenizer here, so what it says of a prompt does not matter: kvlb has parsed,
tokenized and routed it by then). ``--no-off``
runs the small budget only (``--pairs`` × 2 runs), to set the same runs of two trees side by side.

The budget bounds what kvlb holds for the requests it admitted, their parsed chats and text prompts
and the tokenizer's work on them (an estimate) included while they wait for and run in the
tokenizer's threads; the parse of each body (2× its size for one long string, up to 12× for tiny
messages, one at a time on the event loop) and aiohttp's read buffers come on top.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.service.admission import Admission, AdmissionLimits
from loadtests.faults.procs import MODEL, free_ports
from loadtests.faults.rig import fault_rig

MIB = 1024 * 1024
MAX_BODY_BYTES = 8 * MIB
OFF_BYTES = 2**40
"""``max_inflight_body_bytes`` at its largest: in effect, no budget."""
GENERATE = "/kvlb.v1.Balancer/Generate"
UNREAD_WAIT_S = 4.0
"""How long ``--unread`` lets its calls wait before it reads kvlb's RSS (seconds)."""
TIMEOUT_S = 120.0
"""Bound on one burst (every request succeeds well within it: the queue waits up to 60 s)."""


def proc_status_mb(pid: int, field: str) -> float:
    """A ``/proc/<pid>/status`` figure in MB (``VmHWM``: the peak RSS, ``VmRSS``: now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


SHAPES = ("pad", "tiny_messages", "content_parts", "long_text", "long_chat")
"""The bodies ``--shape`` may send: a padded completion, a chat whose parsed form is large, a long
text prompt, or a long chat (a RAG context)."""
CHAT_SHAPES = ("tiny_messages", "content_parts", "long_chat")
"""Those sent to ``/v1/chat/completions``."""
TOKENIZING_METRICS = ("kvlb_admission_tokenizing_bytes", "kvlb_admission_parsed_bytes")
"""The gauge of what requests tokenized in a thread hold, by its name now and before it covered the
tokenizer's work (to run this script against trees of either)."""
TEXT_WORDS = ("alpha", "river", "stone", "cloud", "green", "seven", "quiet", "table")


def text_body(index: int, size: int) -> bytes:
    """A text completion request of at most ``size`` bytes of ASCII words (5 letters and a space)."""
    head = json.dumps({"model": MODEL, "prompt": f"request {index} ", "max_tokens": 1}).encode()
    words = " ".join(TEXT_WORDS[(i + index) % len(TEXT_WORDS)] for i in range((size - len(head)) // 6))
    return json.dumps({"model": MODEL, "prompt": f"request {index} {words}", "max_tokens": 1}).encode()


def long_chat_body(index: int, size: int) -> bytes:
    """A chat request of at most ``size`` bytes: a short system message and a user message holding
    a context of ASCII words (as :func:`text_body`'s, a line of them every 60 words) and a
    question."""
    head = {"model": MODEL, "max_tokens": 1}
    system = {"role": "system", "content": "Answer from the context the user gives."}

    def made(context: str) -> bytes:
        user = {
            "role": "user",
            "content": f"request {index}. Context:\n{context}\nQuestion: which word is first?",
        }
        return json.dumps({**head, "messages": [system, user]}).encode()

    room = size - len(made(""))
    # 60 words of 5 letters: 359 characters and a newline, 361 bytes as JSON ("\\n")
    words = [TEXT_WORDS[(i + index) % len(TEXT_WORDS)] for i in range(room * 60 // 361)]
    lines = [" ".join(words[at : at + 60]) for at in range(0, len(words), 60)]
    return made("\n".join(lines))


def chat_body(index: int, size: int, shape: str) -> bytes:
    """A chat request of about ``size`` bytes (at most ``size``) of one-letter messages
    (``tiny_messages``) or of one message of two-letter text parts (``content_parts``)."""
    head = {"model": MODEL, "max_tokens": 1}
    first = {"role": "user", "content": f"request {index}"}
    if shape == "tiny_messages":
        item = json.dumps({"role": "user", "content": "a"}).encode()
        base = json.dumps({**head, "messages": [first]}).encode()
        count = (size - len(base)) // (len(item) + 2)
        return json.dumps({**head, "messages": [first] + [{"role": "user", "content": "a"}] * count}).encode()
    part = json.dumps({"type": "text", "text": "ab"}).encode()
    base = json.dumps({**head, "messages": [{"role": "user", "content": []}]}).encode()
    count = (size - len(base)) // (len(part) + 2)
    parts = [{"type": "text", "text": f"request {index}"}] + [{"type": "text", "text": "ab"}] * (count - 1)
    return json.dumps({**head, "messages": [{"role": "user", "content": parts}]}).encode()


def padded_body(index: int, size: int) -> bytes:
    """A completion request of ``size`` bytes: a 4-token prompt and an unknown ``pad`` field."""
    head = json.dumps({"model": MODEL, "prompt": [index + 1, 2, 3, 4], "max_tokens": 8}).encode()
    pad = size - len(head) - len(b', "pad": ""')
    return head[:-1] + b', "pad": "' + b"x" * pad + b'"}'


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def padded_message(head: bytes, size: int) -> bytes:
    """A serialized protobuf message ``head`` padded to ``size`` bytes by an unknown field (number
    1000, length-delimited): received and parsed, neither forwarded nor routed on."""
    tag = varint(1000 << 3 | 2)
    pad = size - len(head) - len(tag) - len(varint(size))
    data = head + tag + varint(pad) + b"x" * pad
    if len(data) != size:
        raise ValueError(f"cannot pad {len(head)} bytes to exactly {size}")
    return data


def generate_message(index: int, size: int, max_tokens: int = 8) -> bytes:
    """A ``kvlb.v1.GenerateRequest`` of ``size`` bytes: a 4-token prompt, padded (``size`` 0: as is)."""
    message = pb.GenerateRequest(
        model=MODEL, prompt_token_ids=pb.TokenIds(ids=[index + 1, 2, 3, 4]), max_tokens=max_tokens
    )
    head = message.SerializeToString()
    return padded_message(head, size) if size else head


async def generate(channel: grpc.aio.Channel, data: bytes) -> str:
    """One ``Generate`` of ``data`` (the message's bytes), read to its end; its status code's name."""
    call = channel.unary_stream(GENERATE)(data, timeout=TIMEOUT_S)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return str(error.code().name)
    return "OK"


def rig_settings(budget_bytes: int, bodies: int, face: str, queue_timeout_s: float = 60.0) -> dict[str, Any]:
    limits = {
        "max_body_bytes": MAX_BODY_BYTES,
        "max_inflight_body_bytes": budget_bytes,
        "max_queued": bodies,
        "queue_timeout_s": queue_timeout_s,
    }
    top: dict[str, Any] = {"limits": limits}
    if face == "grpc":
        top["listen"] = {"host": "127.0.0.1", "port": 0, "grpc_port": free_ports(1)[0]}
    return top


async def one_run(
    budget_bytes: int,
    bodies: int,
    body_bytes: int,
    face: str = "http",
    shape: str = "pad",
    queue_timeout_s: float = 60.0,
) -> dict[str, Any]:
    top = rig_settings(budget_bytes, bodies, face, queue_timeout_s)
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvlb-body-budget-") as tmp:
        async with fault_rig(Path(tmp), ("sglang",), time_scale=1.0, **top) as f:
            pid = f.kvlb.pid
            before = proc_status_mb(pid, "VmHWM")
            payloads: list[bytes] = []
            if face == "http":
                payloads = [
                    padded_body(i, body_bytes)
                    if shape == "pad"
                    else text_body(i, body_bytes)
                    if shape == "long_text"
                    else long_chat_body(i, body_bytes)
                    if shape == "long_chat"
                    else chat_body(i, body_bytes, shape)
                    for i in range(bodies)
                ]
            path = "/v1/chat/completions" if shape in CHAT_SHAPES else "/v1/completions"
            peak_held = peak_parsed = 0.0
            done = asyncio.Event()

            async def held() -> float:
                return (await f.metrics()).get("kvlb_admission_body_bytes", 0.0)

            async def sample() -> None:
                nonlocal peak_held, peak_parsed
                while not done.is_set():
                    figures = await f.metrics()
                    peak_held = max(peak_held, figures.get("kvlb_admission_body_bytes", 0.0))
                    tokenizing = sum(figures.get(name, 0.0) for name in TOKENIZING_METRICS)
                    peak_parsed = max(peak_parsed, tokenizing)
                    await asyncio.sleep(0.02)

            async def post(session: aiohttp.ClientSession, body: bytes) -> int:
                async with session.post(f.url + path, data=body) as response:
                    await response.read()
                    return response.status

            sampler = asyncio.create_task(sample())
            clock = time.monotonic()
            statuses: list[int | str]
            if face == "grpc":
                messages = [generate_message(i, body_bytes) for i in range(bodies)]
                target = f"127.0.0.1:{top['listen']['grpc_port']}"
                async with grpc.aio.insecure_channel(target) as channel, asyncio.timeout(TIMEOUT_S):
                    statuses = list(await asyncio.gather(*(generate(channel, m) for m in messages)))
            else:
                async with aiohttp.ClientSession() as session, asyncio.timeout(TIMEOUT_S):
                    statuses = list(await asyncio.gather(*(post(session, body) for body in payloads)))
            burst_s = time.monotonic() - clock
            done.set()
            await sampler
            after = proc_status_mb(pid, "VmHWM")
            held_after = await held()
    counts: dict[str, int] = {}
    for status in statuses:
        counts[str(status)] = counts.get(str(status), 0) + 1
    return {
        "face": face,
        "shape": shape,
        "body_bytes": len(payloads[0]) if payloads else body_bytes,
        "budget": "off" if budget_bytes >= OFF_BYTES else f"{budget_bytes / MIB:g} MiB",
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "peak_rss_before_mb": round(before, 1),
        "peak_rss_after_mb": round(after, 1),
        "peak_rise_mb": round(after - before, 1),
        "peak_held_bytes_sampled": int(peak_held),
        "peak_parsed_bytes_sampled": int(peak_parsed),
        "held_bytes_after": int(held_after),
        "burst_s": round(burst_s, 2),
        "statuses": counts,
    }


async def small_calls(count: int, budget_bytes: int) -> dict[str, Any]:
    """``count`` small ``Generate`` calls (``max_tokens`` 1) one after the other, after 50 to warm
    up: the median and mean time of one, client to client."""
    top = rig_settings(budget_bytes, 1, "grpc")
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvlb-body-budget-") as tmp:
        async with fault_rig(Path(tmp), ("sglang",), time_scale=100.0, **top) as f:
            target = f"127.0.0.1:{top['listen']['grpc_port']}"
            async with grpc.aio.insecure_channel(target) as channel:
                times = []
                for index in range(50 + count):
                    data = generate_message(index % 64, 0, max_tokens=1)
                    clock = time.perf_counter()
                    status = await generate(channel, data)
                    if status != "OK":
                        raise RuntimeError(f"a small Generate ended {status}:\n{f.kvlb.log_tail()}")
                    times.append(time.perf_counter() - clock)
    kept = times[50:]
    return {
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "calls": count,
        "median_us": round(statistics.median(kept) * 1e6, 1),
        "mean_us": round(statistics.fmean(kept) * 1e6, 1),
    }


async def unread_calls(count: int, body_bytes: int) -> dict[str, Any]:
    """``VmRSS`` of kvlb before and while ``count`` calls of ``body_bytes`` wait for the one slot."""
    top = rig_settings(OFF_BYTES, count, "grpc")
    top["limits"]["max_inflight"] = 1
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="kvlb-body-budget-") as tmp:
        async with fault_rig(Path(tmp), ("sglang",), time_scale=1.0, **top) as f:
            pid = f.kvlb.pid
            target = f"127.0.0.1:{top['listen']['grpc_port']}"
            async with grpc.aio.insecure_channel(target) as channel:
                await generate(channel, generate_message(0, 0, max_tokens=1))  # warm
                await f.fault("r0", stall_s=UNREAD_WAIT_S + 5.0)
                holder = asyncio.create_task(generate(channel, generate_message(1, 0, max_tokens=1)))
                await asyncio.sleep(1.0)
                before = proc_status_mb(pid, "VmRSS")
                messages = [generate_message(2 + i, body_bytes) for i in range(count)]
                waiting = [asyncio.create_task(generate(channel, m)) for m in messages]
                await asyncio.sleep(UNREAD_WAIT_S)
                during = proc_status_mb(pid, "VmRSS")
                still_waiting = sum(not task.done() for task in waiting)
                statuses = await asyncio.gather(holder, *waiting)
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status] = counts.get(status, 0) + 1
    return {
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "calls": count,
        "body_mib": body_bytes / MIB,
        "waiting_when_measured": still_waiting,
        "rss_before_mb": round(before, 1),
        "rss_while_waiting_mb": round(during, 1),
        "rise_per_call_kb": round((during - before) * 1024 / count, 1),
        "statuses": counts,
    }


async def plumbing(count: int) -> dict[str, Any]:
    """The time of a small call to a unary-request handler and to a stream-request handler reading
    its message as kvlb's :func:`balancer.api.grpc.calls.receive` does (medians of ``count`` each,
    wall and CPU: the process's, client, server and grpc's threads together)."""
    admission = Admission(AdmissionLimits(max_inflight=8, max_queued=8, queue_timeout_s=1.0))
    reply = pb.GenerateChunk(index=0).SerializeToString()

    async def unary(request: Any, context: Any) -> Any:
        yield reply

    async def streamed(requests: Any, context: Any) -> Any:
        async with asyncio.timeout(10.0):
            raw = await context.read()
            if raw is grpc.aio.EOF:
                raise RuntimeError("no message")
        admission.add(MAX_BODY_BYTES)
        admission.give_back(MAX_BODY_BYTES - len(raw))
        pb.GenerateRequest.FromString(raw)
        admission.give_back(len(raw))
        await context.write(reply)

    parse = pb.GenerateRequest.FromString
    handlers = {
        "Old": grpc.unary_stream_rpc_method_handler(unary, request_deserializer=parse),
        "New": grpc.stream_stream_rpc_method_handler(streamed),
    }
    server = grpc.aio.server(options=[("grpc.http2.bdp_probe", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Shape", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    times: dict[str, list[float]] = {"Old": [], "New": []}
    cpu_times: dict[str, list[float]] = {"Old": [], "New": []}
    data = generate_message(1, 0)
    started_utc = time.strftime("%H:%M:%S", time.gmtime())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for block in range(2 * (count // 200 + 1) + 2):
                name = ("Old", "New")[block % 2]
                method = channel.unary_stream(f"/bench.Shape/{name}")
                for _ in range(200):
                    clock, cpu = time.perf_counter(), time.process_time()
                    async for _ in method(data, timeout=10.0):
                        pass
                    if block >= 2:  # the first two blocks warm up
                        times[name].append(time.perf_counter() - clock)
                        cpu_times[name].append(time.process_time() - cpu)
    finally:
        await server.stop(None)
    old, new = statistics.median(times["Old"]), statistics.median(times["New"])
    old_cpu, new_cpu = statistics.median(cpu_times["Old"]), statistics.median(cpu_times["New"])
    return {
        "started_utc": started_utc,
        "load_1m_after": round(os.getloadavg()[0], 2),
        "calls_each": len(times["Old"]),
        "median_us_unary_request": round(old * 1e6, 1),
        "median_us_stream_request": round(new * 1e6, 1),
        "added_us": round((new - old) * 1e6, 1),
        "median_cpu_us_unary_request": round(old_cpu * 1e6, 1),
        "median_cpu_us_stream_request": round(new_cpu * 1e6, 1),
        "added_cpu_us": round((new_cpu - old_cpu) * 1e6, 1),
    }


async def main_async(args: argparse.Namespace) -> None:
    body_bytes = int(args.body_mib * MIB)
    budget_bytes = int(args.budget_mib * MIB)
    if args.small_calls:
        print(json.dumps(await small_calls(args.small_calls, budget_bytes)))
        return
    if args.unread:
        print(json.dumps(await unread_calls(args.unread, body_bytes)))
        return
    if args.plumbing:
        print(json.dumps(await plumbing(args.plumbing)))
        return
    if args.face == "grpc" and args.shape != "pad":
        raise SystemExit("--shape applies to --face http only")
    runs = []
    order = (
        (budget_bytes, budget_bytes) if args.no_off else (OFF_BYTES, budget_bytes, budget_bytes, OFF_BYTES)
    )
    for _ in range(args.pairs):
        for budget in order:
            runs.append(
                await one_run(budget, args.bodies, body_bytes, args.face, args.shape, args.queue_timeout_s)
            )
            print(json.dumps(runs[-1]), flush=True)
    off = [r["peak_rise_mb"] for r in runs if r["budget"] == "off"]
    on = [r["peak_rise_mb"] for r in runs if r["budget"] != "off"]
    summary: dict[str, Any] = {
        "face": args.face,
        "shape": args.shape,
        "bodies": args.bodies,
        "body_mib": args.body_mib,
        "budget_mib": args.budget_mib,
        "median_peak_rise_mb_off": round(statistics.median(off), 1) if off else None,
        "median_peak_rise_mb_on": round(statistics.median(on), 1),
        "ratio_on_over_off": round(statistics.median(on) / statistics.median(off), 3) if off else None,
        "runs": runs,
    }
    print(json.dumps(summary))
    print()
    print(
        "| run | budget | UTC start | load 1m | peak RSS before → after (MB) | rise (MB) "
        "| held peak (MiB) | parsed peak (MiB) | burst (s) | statuses |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for number, r in enumerate(runs, 1):
        print(
            f"| {number} | {r['budget']} | {r['started_utc']} | {r['load_1m_after']} | "
            f"{r['peak_rss_before_mb']} → {r['peak_rss_after_mb']} | {r['peak_rise_mb']} | "
            f"{r['peak_held_bytes_sampled'] / MIB:.1f} | {r['peak_parsed_bytes_sampled'] / MIB:.1f} | "
            f"{r['burst_s']} | {r['statuses']} |"
        )
    print(
        f"\nmedian rise: off {summary['median_peak_rise_mb_off']} MB, "
        f"on {summary['median_peak_rise_mb_on']} MB (on/off {summary['ratio_on_over_off']})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.faults.body_budget", description=__doc__)
    parser.add_argument("--bodies", type=int, default=32, help="requests sent at once (default 32)")
    parser.add_argument("--body-mib", type=float, default=4.0, help="size of each body (MiB, default 4)")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="the small budget (MiB, default 16)")
    parser.add_argument("--pairs", type=int, default=1, help="off/on/on/off rounds (default 1)")
    parser.add_argument("--face", choices=("http", "grpc"), default="http", help="the face sent to")
    parser.add_argument("--shape", choices=SHAPES, default="pad", help="the bodies sent (default pad)")
    parser.add_argument("--no-off", action="store_true", help="run the small budget only")
    parser.add_argument(
        "--queue-timeout-s",
        type=float,
        default=60.0,
        help="limits.queue_timeout_s of the burst runs (default 60: every request waits its turn)",
    )
    parser.add_argument(
        "--small-calls", type=int, default=0, help="time this many small gRPC Generate calls instead"
    )
    parser.add_argument(
        "--unread", type=int, default=0, help="measure this many gRPC calls waiting unread instead"
    )
    parser.add_argument(
        "--plumbing", type=int, default=0, help="time this many calls to each bare handler shape instead"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.bodies <= 256 or not 0 < args.body_mib <= 7.9 or args.budget_mib < 8:
        parser.error("--bodies in 1..256, --body-mib in (0, 7.9], --budget-mib >= 8 (max_body_bytes)")
    if (
        not 0 <= args.small_calls <= 100_000
        or not 0 <= args.unread <= 256
        or not 0 <= args.plumbing <= 100_000
    ):
        parser.error("--small-calls and --plumbing in 0..100000, --unread in 0..256")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
