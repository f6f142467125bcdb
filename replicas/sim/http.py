"""The OpenAI-compatible HTTP API every emulated replica serves (I/O shell, aiohttp).

``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE streaming, ``usage`` with
``prompt_tokens_details.cached_tokens``; a vLLM replica answers a request for a model it does not
serve 404, as vLLM does), ``/v1/models``, ``/health``, and what vLLM-style routers
call on workers: ``/v1/chat/completions/render``, ``/v1/completions/render`` and ``/tokenize``.
Prompts are tokenized by the tokenizer the replica was given (:mod:`replicas.sim.tokenizer`; ``kvlb
emulate`` gives it the balancer's, so replica and balancer see the same ids); a prompt may also be given
as token ids. A prompt the tokenizer refuses (a ``ValueError``) is answered 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from replicas.sim.context import ReplicaContext, json_error
from replicas.sim.engine import RequestHandle
from replicas.sim.sampling import sampling_salt, token_text
from replicas.sim.scheduler import SimRequest
from replicas.sim.tokenizer import PromptError

CTX_KEY = web.AppKey("sim_ctx", ReplicaContext)

MAX_SEQUENCES = 128
"""Largest ``n`` the emulator takes (OpenAI's own bound; vLLM and SGLang take more)."""
_INLINE_TOKENIZE_CHARS = 2048
"""Shorter texts are tokenized inline; longer ones in a thread (tokenizing is CPU work)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    seed: int | None
    stream: bool
    include_usage: bool
    dp_rank: int | None
    n: int = 1
    """Sequences to generate for the prompt (OpenAI's ``n``, 1..:data:`MAX_SEQUENCES`)."""


def _ctx(request: web.Request) -> ReplicaContext:
    return request.app[CTX_KEY]


async def _json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, read as the engines read it (FastAPI's ``json.loads`` of the raw
    bytes: the ``Content-Type`` charset is not consulted, a BOM or UTF-16 is detected); anything it
    refuses (not JSON, an integer over 4,300 digits, nesting past the recursion limit) is a 400 in
    the engines' error shape, never a 500."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise _bad_request(f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad_request("the body must be a JSON object")
    return body


def _bad_request(message: str) -> web.HTTPBadRequest:
    payload = {"object": "error", "error": {"message": message, "type": "BadRequestError", "code": 400}}
    return web.HTTPBadRequest(text=json.dumps(payload), content_type="application/json")


def parse_sampling(body: Mapping[str, Any], default_max_tokens: int) -> Sampling:
    """Sampling parameters of a request; ``ValueError`` names the bad field."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_new = default_max_tokens if max_tokens is None else max_tokens
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed")
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
        raise ValueError("max_tokens must be an integer >= 1")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError("temperature must be a number >= 0")
    if seed is not None and not isinstance(seed, int):
        raise ValueError("seed must be an integer")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SEQUENCES:
        raise ValueError(f"n must be an integer in 1..{MAX_SEQUENCES}")
    options = body.get("stream_options") or {}
    dp_rank = body.get("data_parallel_rank")
    return Sampling(
        max_new_tokens=max_new,
        temperature=float(temperature),
        seed=seed,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        dp_rank=dp_rank if isinstance(dp_rank, int) else None,
        n=n,
    )


async def tokenize_chat(ctx: ReplicaContext, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    if size <= _INLINE_TOKENIZE_CHARS:
        return ctx.tokenizer.encode_chat(messages)
    return await asyncio.to_thread(ctx.tokenizer.encode_chat, messages)


async def tokenize_prompt(ctx: ReplicaContext, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and len(prompt) > _INLINE_TOKENIZE_CHARS:
        return await asyncio.to_thread(ctx.tokenizer.encode_prompt, prompt)
    if not isinstance(prompt, (str, list)):
        raise PromptError("prompt must be a string or a list of token ids")
    return ctx.tokenizer.encode_prompt(prompt)


def _usage(requests: Sequence[SimRequest]) -> dict[str, Any]:
    """One answer's usage: the prompt once, the completions of its ``n`` sequences added."""
    prompt, completion = len(requests[0].prompt), sum(len(r.output) for r in requests)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": requests[0].cached_tokens},
    }


def _sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Shape:
    """Chat or text-completion response objects."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat = chat
        self.head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def chunk(self, text: str | None, first: bool, finish: str | None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self.head, "choices": [choice]}

    def whole(self, texts: Sequence[str], requests: Sequence[SimRequest]) -> dict[str, Any]:
        choices: list[dict[str, Any]] = []
        for index, (text, request) in enumerate(zip(texts, requests, strict=True)):
            finish = request.finish_reason
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
                )
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish})
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": obj, "choices": choices, "usage": _usage(requests)}


async def generate(
    request: web.Request,
    ctx: ReplicaContext,
    ids: list[int],
    body: Mapping[str, Any],
    *,
    chat: bool,
    received_s: float,
) -> web.StreamResponse:
    """Run one request through the engine and answer as OpenAI does (JSON or SSE).

    ``received_s`` (model time) is when the handler started: the request's TTFT clock starts there.
    """
    try:
        sampling = parse_sampling(body, ctx.config.default_max_tokens)
    except ValueError as exc:
        return json_error(400, str(exc))
    total = len(ids) + sampling.max_new_tokens
    limit = ctx.config.profile.max_context_tokens
    if total > limit:
        return json_error(
            400, f"prompt ({len(ids)}) + max_tokens ({sampling.max_new_tokens}) exceeds {limit}"
        )
    if not ids:
        return json_error(400, "the prompt is empty")
    n = sampling.n
    if not ctx.engine.fits(len(ids), sampling.max_new_tokens * n):
        pool = ctx.engine.ranks[0].scheduler.cache
        return json_error(
            400,
            f"prompt ({len(ids)}) + max_tokens ({sampling.max_new_tokens})"
            f"{f' x n ({n})' if n > 1 else ''} does not fit in the KV "
            f"cache ({pool.capacity_blocks} pages of {pool.page_size} tokens)",
        )
    rid = ctx.next_request_id("chatcmpl" if chat else "cmpl")
    salt = sampling_salt(sampling.temperature, sampling.seed, ctx.request_counter)
    # n sequences: n requests on one rank sharing the prompt (its prefix cached after the first), as
    # vLLM fans a request out into child requests and SGLang into n scheduler requests
    sims: list[SimRequest] = []
    handles: list[RequestHandle] = []
    try:
        for index in range(n):
            own_salt = salt if index == 0 or salt == 0 else salt | (index << 72)
            sim = SimRequest(
                rid if index == 0 else f"{rid}-{index}",
                ids,
                sampling.max_new_tokens,
                arrival_s=0.0,
                salt=own_salt,
            )
            rank = sampling.dp_rank if not handles else handles[0].rank
            handle = ctx.engine.submit(sim, rank, received_s)
            if handle is None:
                return json_error(503, "the waiting queue is full", "ServiceUnavailableError")
            sims.append(sim)
            handles.append(handle)
        shape = _Shape(chat, rid, ctx.model)
        if sampling.stream:
            return await _stream(request, ctx, handles, shape, sampling.include_usage)
        texts = await asyncio.gather(*(_whole_text(request, handle) for handle in handles))
        if any(text is None for text in texts):
            return web.Response(status=499)  # never read: ``finally`` aborts the requests
        if any(sim.finish_reason == "abort" for sim in sims):
            return json_error(503, "the engine restarted", "ServiceUnavailableError")
        whole = shape.whole([text or "" for text in texts], sims)
        return web.json_response(whole, headers=_headers(ctx, handles[0]))
    finally:
        for handle in handles:
            if handle.request.finish_reason is None:
                ctx.engine.abort(handle)


async def _whole_text(request: web.Request, handle: RequestHandle) -> str | None:
    """One sequence's text, or ``None`` when the client left meanwhile."""
    pieces = []
    while (out := await handle.next()) is not None:
        if _client_gone(request):  # the engines abort it (vLLM at once, SGLang within 4 s)
            return None
        pieces.append(token_text(out.token))
    return "".join(pieces)


def _client_gone(request: web.Request) -> bool:
    """Whether the client closed its connection. A whole answer writes nothing until its end, so
    without this a request whose client left ran to ``max_tokens``, where vLLM (``with_cancellation``)
    and SGLang (``is_disconnected`` while it waits) abort it; a stream finds out when it writes."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _headers(ctx: ReplicaContext, handle: RequestHandle) -> dict[str, str]:
    return {"x-sim-replica": ctx.config.name, "x-sim-dp-rank": str(handle.rank)}


async def _stream(
    request: web.Request,
    ctx: ReplicaContext,
    handles: Sequence[RequestHandle],
    shape: _Shape,
    include_usage: bool,
) -> web.StreamResponse:
    """Stream the ``n`` sequences of ``handles`` as they come, each chunk naming its choice ``index``."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **_headers(ctx, handles[0]),
        }
    )
    await response.prepare(request)
    crash_after = ctx.faults.settings.crash_after_chunks
    sent = [0] * len(handles)
    outs: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        while (out := await handle.next()) is not None:
            outs.put_nowait((index, token_text(out.token)))
        outs.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            index, text = await outs.get()
            if text is None:
                running -= 1
                if handles[index].request.finish_reason == "abort":
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                finish = handles[index].request.finish_reason
                await response.write(_sse(shape.chunk(None, sent[index] == 0, finish, index)))
                continue
            await response.write(_sse(shape.chunk(text, sent[index] == 0, None, index)))
            sent[index] += 1
            if crash_after is not None and sum(sent) >= crash_after:
                if request.transport is not None:
                    request.transport.abort()  # the "engine crashed mid-stream" fault
                return response
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if include_usage:
        usage = _usage([handle.request for handle in handles])
        await response.write(_sse({**shape.head, "choices": [], "usage": usage}))
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = _ctx(request)
    received_s = ctx.engine.clock.now()
    body = await _json(request)
    if (refused := ctx.unserved_model(body)) is not None:
        return refused
    try:
        ids = await tokenize_chat(ctx, body.get("messages"))
    except ValueError as exc:
        return json_error(400, str(exc))
    return await generate(request, ctx, ids, body, chat=True, received_s=received_s)


def _counted(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``handler`` counted in the replica's open and peak-open generation requests."""

    async def counted(request: web.Request) -> web.StreamResponse:
        ctx = _ctx(request)
        ctx.open_requests += 1
        ctx.peak_open_requests = max(ctx.peak_open_requests, ctx.open_requests)
        try:
            return await handler(request)
        finally:
            ctx.open_requests -= 1

    return counted


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = _ctx(request)
    received_s = ctx.engine.clock.now()
    body = await _json(request)
    if (refused := ctx.unserved_model(body)) is not None:
        return refused
    try:
        ids = await tokenize_prompt(ctx, body.get("prompt"))
    except ValueError as exc:
        return json_error(400, str(exc))
    return await generate(request, ctx, ids, body, chat=False, received_s=received_s)


def _render_body(ctx: ReplicaContext, ids: Sequence[int], body: Mapping[str, Any]) -> dict[str, Any]:
    try:
        sampling = parse_sampling(body, ctx.config.default_max_tokens)
        params: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature}
    except ValueError:
        params = {}
    return {
        "request_id": ctx.next_request_id("render"),
        "token_ids": list(ids),
        "features": None,
        "sampling_params": params,
        "model": ctx.model,
        "stream": bool(body.get("stream", False)),
    }


async def chat_render(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    body = await _json(request)
    try:
        ids = await tokenize_chat(ctx, body.get("messages"))
    except ValueError as exc:
        return json_error(400, str(exc))
    return web.json_response(_render_body(ctx, ids, body))


async def completions_render(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    body = await _json(request)
    try:
        ids = await tokenize_prompt(ctx, body.get("prompt"))
    except ValueError as exc:
        return json_error(400, str(exc))
    return web.json_response([_render_body(ctx, ids, body)])


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``{"prompt": ...}`` or ``{"messages": [...]}``."""
    ctx = _ctx(request)
    body = await _json(request)
    try:
        if "messages" in body:
            ids = await tokenize_chat(ctx, body["messages"])
        else:
            ids = await tokenize_prompt(ctx, body.get("prompt"))
    except ValueError as exc:
        return json_error(400, str(exc))
    limit = ctx.config.profile.max_context_tokens
    return web.json_response({"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": None})


async def models(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    card = {
        "id": ctx.model,
        "object": "model",
        "created": int(ctx.started_wall),
        "owned_by": "kvlb-sim",
        "root": ctx.model,
        "max_model_len": ctx.config.profile.max_context_tokens,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    if ctx.faults.settings.fail_health:
        return web.Response(status=503, text="unhealthy (injected fault)")
    return web.Response(status=200)


def add_openai_routes(app: web.Application, ctx: ReplicaContext) -> None:
    app[CTX_KEY] = ctx
    app.router.add_post("/v1/chat/completions", _counted(chat_completions))
    app.router.add_post("/v1/completions", _counted(completions))
    app.router.add_post("/v1/chat/completions/render", chat_render)
    app.router.add_post("/v1/completions/render", completions_render)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
