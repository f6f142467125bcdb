"""Parsing of OpenAI request bodies and kvlb request headers (pure).

The balancer reads only what routing needs (model, prompt or messages, ``stream``, ``max_tokens``,
``user``) and forwards the client's original bytes untouched. Anything malformed raises
:class:`~balancer.api.errors.ApiError` 400 with a message naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.errors import ConfigError
from balancer.policy import PolicyWeights
from balancer.tokenizer.tokenizer import first_surrogate

RequestKind = Literal["chat", "completions"]

PER_MESSAGE_CHARS = 64
"""What one chat message weighs in :attr:`ParsedRequest.text_chars` besides its text: rendering and
tokenizing a message costs about as much as 50 characters of text (13.5 µs against 0.26 µs per
character, measured with the DeepSeek-V3 tokenizer on 2,000 two-character messages), so that a chat
of many short messages is not tokenized on the event loop."""

MAX_WEIGHTS_HEADER_CHARS = 2048
"""Longest accepted ``x-kvlb-weights`` header; longer → 400."""


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What routing needs from one ``/v1/chat/completions`` or ``/v1/completions`` body."""

    kind: RequestKind
    model: str
    stream: bool
    max_tokens: int
    """``max_completion_tokens`` or ``max_tokens``; 0 when absent (the engine's default applies)."""
    session_key: str | None
    """The OpenAI ``user`` field, used by the ``session`` policy."""
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    """``tools``, ``add_generation_prompt`` and ``chat_template_kwargs`` for the chat template."""
    text_chars: int = 0
    """Size of the text the tokenizer reads, in characters (decides whether tokenizing runs in a
    thread): the prompt text, or for a chat every string in the messages (content parts and tool
    calls included), the tools and template kwargs, plus :data:`PER_MESSAGE_CHARS` per message."""


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, or 400."""
    if not raw:
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        body = strict_json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    # A lone surrogate comes from a "\\ud800" escape, from CESU-8 bytes (json.loads decodes bytes
    # with surrogatepass) or from a UTF-16/32 body; the tokenizer, the session hash and gRPC status
    # details cannot take it. The walk visits every value (2 ms for 8k token ids, five times the
    # json.loads before it), so it runs only when the bytes could hold one.
    where = lone_surrogate_at(body) if may_hold_surrogate(raw) else None
    if where is not None:
        raise ApiError(
            400,
            f"the request body is not valid Unicode: {where} holds a lone UTF-16 surrogate; "
            "strings must be UTF-8 text (a surrogate escape must be half of a pair)",
        )
    return body


_SURROGATE_HINTS = (b"\\ud", b"\\uD", b"\xed", b"\x00")
"""Bytes a JSON body holding a lone surrogate must contain: the start of a ``\\uD800``–``\\uDFFF``
escape, 0xED (the lead byte of CESU-8 surrogates, and of U+D000–U+D7FF: Hangul then costs the walk),
or NUL (a UTF-16 or UTF-32 body, whose ASCII characters such as ``{`` carry zero bytes)."""


def may_hold_surrogate(raw: bytes) -> bool:
    """``False`` when the JSON document ``raw`` cannot decode to a string with a lone surrogate (a
    few byte searches, no decoding); ``True`` means :func:`lone_surrogate_at` must look."""
    return any(hint in raw for hint in _SURROGATE_HINTS)


def lone_surrogate_at(value: Any) -> str | None:
    """Where the first string or key of ``value`` holding a lone UTF-16 surrogate is (e.g.
    ``'messages[0].content'``), or ``None``. Iterative, so any nesting ``json.loads`` accepts is fine."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if first_surrogate(item) is not None:
                return f"'{path}'" if path else "a string"
        elif isinstance(item, dict):
            children: list[tuple[str, Any]] = []
            for key, child in item.items():
                if first_surrogate(key) is not None:
                    return f"a key of '{path}'" if path else "a top-level key"
                children.append((f"{path}.{key}" if path else key, child))
            stack.extend(reversed(children))  # document order
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", item[i]) for i in range(len(item) - 1, -1, -1))
    return None


def parse_request(raw: bytes, kind: RequestKind) -> ParsedRequest:
    """Validate the fields routing reads; other fields are the engine's business."""
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean")
    common: dict[str, Any] = {
        "model": model,
        "stream": stream,
        "max_tokens": _max_tokens(body),
        "session_key": _optional_str(body, "user"),
    }
    if kind == "chat":
        messages = _messages(body)
        chat_kwargs = _chat_kwargs(body)
        chars = json_text_chars(messages) + json_text_chars(chat_kwargs) + PER_MESSAGE_CHARS * len(messages)
        return ParsedRequest(
            kind="chat", messages=messages, chat_kwargs=chat_kwargs, text_chars=chars, **common
        )
    prompt = _prompt(body)
    chars = len(prompt) if isinstance(prompt, str) else 0
    return ParsedRequest(kind="completions", prompt=prompt, text_chars=chars, **common)


def json_text_chars(value: Any) -> int:
    """Characters of every string in a decoded JSON value, object keys included (no recursion)."""
    total = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(map(len, item))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


def _max_tokens(body: Mapping[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ApiError(400, f"'{name}' must be a non-negative integer")
        return value
    return 0


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string")
    return value


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty array")
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, f"'messages[{position}]' must be an object")
        if not isinstance(message.get("role"), str):
            raise ApiError(400, f"'messages[{position}].role' must be a string")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"'messages[{position}].content' must be a string, an array or null")
    return messages


def _chat_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError(400, "'tools' must be an array of objects")
        kwargs["tools"] = tools
    add_generation_prompt = body.get("add_generation_prompt")
    if add_generation_prompt is not None:
        if not isinstance(add_generation_prompt, bool):
            raise ApiError(400, "'add_generation_prompt' must be a boolean")
        kwargs["add_generation_prompt"] = add_generation_prompt
    extra = body.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ApiError(400, "'chat_template_kwargs' must be an object")
        reserved = {"messages", "tools", "add_generation_prompt"} & set(extra)
        if reserved:
            raise ApiError(400, f"'chat_template_kwargs' may not set {sorted(reserved)}")
        kwargs.update(extra)
    return kwargs


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    # A batch of one prompt is accepted; routing a real batch would need one decision per prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    # ``set(map(type, ...))`` runs at C speed: an 8k-id prompt is checked in about a third of the time
    # of a per-element generator (``bool`` stays rejected: its type is not ``int``).
    if isinstance(prompt, list) and (not prompt or set(map(type, prompt)) == {int}):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request")
    raise ApiError(400, "'prompt' is required and must be a string or an array of token ids")


def parse_weights_header(value: str, base: PolicyWeights) -> PolicyWeights:
    """``x-kvlb-weights: {"overlap_credit": 0.5}`` laid over ``base``; 400 when invalid."""
    if len(value) > MAX_WEIGHTS_HEADER_CHARS:
        raise ApiError(400, f"x-kvlb-weights is longer than {MAX_WEIGHTS_HEADER_CHARS} characters")
    try:
        data = strict_json.loads(value)
    except ValueError as exc:
        raise ApiError(400, f"x-kvlb-weights is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "x-kvlb-weights must be a JSON object of weight names to numbers")
    where = lone_surrogate_at(data)
    if where is not None:
        raise ApiError(400, f"x-kvlb-weights is not valid Unicode: {where} holds a lone UTF-16 surrogate")
    return weights_from(data, base, "x-kvlb-weights")


def weights_from(data: Mapping[str, Any], base: PolicyWeights, where: str) -> PolicyWeights:
    """Validated weights, or 400 with :class:`PolicyWeights`' own message."""
    try:
        return PolicyWeights.from_dict(data, base)
    except ConfigError as exc:
        raise ApiError(400, f"{where}: {exc}") from None
    except TypeError as exc:  # dataclasses.replace with a bad keyword
        raise ApiError(400, f"{where}: {exc}") from None
