"""Parsing of OpenAI request bodies and kvlb request headers (pure).

The balancer reads only what routing needs (model, prompt or messages, ``stream``, ``max_tokens``,
``user``) and forwards the client's original bytes untouched. Anything malformed raises
:class:`~balancer.api.errors.ApiError` 400 with a message naming the field.

Bodies are decoded with ``msgspec``, which accepts only strict JSON in UTF-8 whose strings hold no
lone surrogate; a ``/v1/completions`` body in ASCII is decoded into a typed struct whose token ids are
checked (ints in ``[0, 2**32)``) in the same pass. A body either decoder refuses goes through the
stdlib path (:func:`parse_json_object`), which accepts what it always did (a UTF-16 body, ``1e400``)
and words each refusal as before; so the fast decoders change what a request costs, never its answer.
"""

from __future__ import annotations

import re
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from balancer import strict_json
from balancer.api.errors import ApiError
from balancer.errors import ConfigError
from balancer.policy import PolicyWeights
from balancer.tokenizer.token_ids import (
    PROMPT_STANDIN,
    TokenIdMemo,
    decode_token_ids,
    known_prompt,
    take_known,
    worth_a_lookup,
)
from balancer.tokenizer.tokenizer import first_surrogate
from balancer.upstream.stream_usage import StreamUsage, stream_usage_of

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
    sequences: int = 1
    """OpenAI's ``n``: sequences generated for the prompt, each up to ``max_tokens`` (decode load)."""
    prompt: str | Sequence[int] | None = None
    """The text, or the token ids: a ``list`` from the typed or stdlib decoder, the ``packed`` array itself
    from the memoised one (:func:`~balancer.tokenizer.token_ids.decode_token_ids`) and from gRPC
    (:func:`packed_completion`)."""
    messages: list[dict[str, Any]] | None = None
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    """``tools``, ``add_generation_prompt`` and ``chat_template_kwargs`` for the chat template."""
    text_chars: int = 0
    """Size of the text the tokenizer reads, in characters (decides whether tokenizing runs in a
    thread): the prompt text, or for a chat every string in the messages (content parts and tool
    calls included), the tools and template kwargs, plus :data:`PER_MESSAGE_CHARS` per message."""
    ids_checked: bool = False
    """``prompt`` is a non-empty sequence of token ids already checked to be ints in ``[0, 2**32)``
    (by the typed decoder, or packed from gRPC's ``uint32`` ids): only the prompt-size limit is left
    to check."""
    packed: array[int] | None = field(default=None, compare=False, repr=False)
    """With ``ids_checked``: the same ids as an ``array('I')``, made by the range check itself (the
    array that :func:`~balancer.index.hashing.compact_ids` would make of ``prompt``)."""
    stream_usage: StreamUsage = "asked"
    """What the request says about usage on its stream (``stream_options.include_usage``): whether
    kvlb must ask the engine for it (:func:`~balancer.upstream.stream_usage.with_stream_usage`)."""
    parsed_bytes: int = 0
    """Estimated bytes of the Python objects this request keeps of its body, in bytes: a text
    prompt's ``str``, or a chat's messages and chat kwargs (:func:`json_text_size`). 0 for token
    ids: they are checked on the event loop, never kept across a wait (their array is counted once
    tokenized)."""


TokenId = int
"""A token id as the typed decoder takes it (``true``/``false`` are not ints in ``msgspec``). Its
range, that of :func:`validate_token_ids <balancer.tokenizer.tokenizer.validate_token_ids>`
(``[0, 2**32)``), is checked after decoding by packing the ids as ``array('I')``, which refuses any
other int: the same ids pass as with ``msgspec.Meta(ge=0, lt=2**32)`` on each, and the packing is
needed anyway (``compact_ids``), so the per-id constraint check (about 10% of the decode) is saved."""


class _CompletionBody(msgspec.Struct):
    """What routing reads of a ``/v1/completions`` body; other fields are skipped while decoding."""

    prompt: str | list[TokenId] | None = None
    model: Any = None
    stream: Any = False
    max_tokens: Any = None
    max_completion_tokens: Any = None
    user: Any = None
    n: Any = None
    stream_options: Any = msgspec.UNSET


class _RawPromptBody(msgspec.Struct):
    """:class:`_CompletionBody` with the prompt left as its JSON text (checked, not decoded)."""

    prompt: msgspec.Raw = msgspec.Raw(b"")
    model: Any = None
    stream: Any = False
    max_tokens: Any = None
    max_completion_tokens: Any = None
    user: Any = None
    n: Any = None
    stream_options: Any = msgspec.UNSET


_OBJECT_DECODER = msgspec.json.Decoder(dict[str, Any])
_COMPLETION_DECODER = msgspec.json.Decoder(_CompletionBody)
_RAW_PROMPT_DECODER = msgspec.json.Decoder(_RawPromptBody)
_TEXT_DECODER = msgspec.json.Decoder(str)
_FAST_DECODE_ERRORS = (msgspec.DecodeError, ValueError, RecursionError)
"""What the fast decoders raise on a body they refuse (``ValidationError`` is a ``DecodeError``;
invalid UTF-8 raises ``UnicodeDecodeError``): the body then takes the stdlib path."""


def decode_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object, or 400: :func:`parse_json_object`'s answer, at ``msgspec`` speed
    for a body it accepts (strict UTF-8 JSON holding no lone surrogate, so no walk is needed)."""
    try:
        return _OBJECT_DECODER.decode(raw)
    except _FAST_DECODE_ERRORS:
        return parse_json_object(raw)


def fast_decode(raw: bytes) -> dict[str, Any] | None:
    """``raw`` as a JSON object by ``msgspec`` alone, or ``None`` when it refuses it (then only
    :func:`decode_object` may answer, for its errors)."""
    try:
        return _OBJECT_DECODER.decode(raw)
    except _FAST_DECODE_ERRORS:
        return None


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
    if may_hold_surrogate(raw):
        refuse_lone_surrogates(body)
    return body


def refuse_lone_surrogates(body: Mapping[str, Any]) -> None:
    """400 when a string or key of the decoded request ``body`` holds a lone UTF-16 surrogate."""
    where = lone_surrogate_at(body)
    if where is not None:
        raise ApiError(
            400,
            f"the request body is not valid Unicode: {where} holds a lone UTF-16 surrogate; "
            "strings must be UTF-8 text (a surrogate escape must be half of a pair)",
        )


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
    ``'messages[0].content'``), or ``None``. Iterative, so any nesting ``json.loads`` accepts is fine.

    A first walk only looks (:func:`holds_lone_surrogate`: 8 B of stack an item); only when it finds
    one does a second walk name where, with a path string for every item it lists (a path and a tuple
    each, about 110 B: for a body of 1.4 M empty objects that walk was 160 MB, the most of its parse)."""
    if not holds_lone_surrogate(value):
        return None
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


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a string or key of the decoded JSON ``value`` holds a lone UTF-16 surrogate (no
    recursion; an ASCII string, a flag CPython keeps, is not scanned). In document order, as the
    second walk of :func:`lone_surrogate_at`, so a surrogate early in the body is found before a
    long array after it is listed."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if first_surrogate(item) is not None:
                return True
        elif isinstance(item, dict):
            if not all(map(str.isascii, item)) and any(first_surrogate(key) is not None for key in item):
                return True
            pending.extend(reversed(item.values()))
        elif isinstance(item, list):
            pending.extend(reversed(item))
    return False


def parse_request(
    raw: bytes,
    kind: RequestKind,
    memo: TokenIdMemo | None = None,
    known: Callable[[bytes], dict[str, Any] | None] | None = None,
) -> ParsedRequest:
    """Validate the fields routing reads; other fields are the engine's business. With ``memo``,
    token ids are decoded through it (:func:`~balancer.tokenizer.token_ids.decode_token_ids`). With
    ``known``, a chat body is first offered to it (the HTTP face's
    :meth:`~balancer.api.prefix_memo.PrefixMemo.decode_known`: what :func:`decode_object` gives, or
    ``None``), then decoded whole when it gives ``None``."""
    if kind == "completions" and (fast := typed_completion(raw, memo)) is not None:
        return fast
    if kind == "chat" and known is not None and (body := known(raw)) is not None:
        return parse_body(body, kind)
    return parse_body(decode_object(raw), kind)


def parse_body(body: Mapping[str, Any], kind: RequestKind) -> ParsedRequest:
    """:func:`parse_request` of a decoded body."""
    common = _common(body)
    if kind == "chat":
        messages = _messages(body)
        chat_kwargs = _chat_kwargs(body)
        chars, size = json_text_size(messages)
        kwargs_chars, kwargs_size = json_text_size(chat_kwargs) if chat_kwargs else (0, 0)
        return ParsedRequest(
            kind="chat",
            messages=messages,
            chat_kwargs=chat_kwargs,
            text_chars=chars + kwargs_chars + PER_MESSAGE_CHARS * len(messages),
            parsed_bytes=size + kwargs_size,
            **common,
        )
    prompt = _prompt(body)
    if isinstance(prompt, str):
        return _text_completion(prompt, common)
    return ParsedRequest(kind="completions", prompt=prompt, **common)


def _text_completion(prompt: str, common: dict[str, Any]) -> ParsedRequest:
    """A ``/v1/completions`` request whose prompt is the text ``prompt``."""
    return ParsedRequest(
        kind="completions",
        prompt=prompt,
        text_chars=len(prompt),
        parsed_bytes=sys.getsizeof(prompt),
        **common,
    )


def typed_completion(raw: bytes, memo: TokenIdMemo | None = None) -> ParsedRequest | None:
    """The typed decode of a completion body, or ``None`` when the stdlib path must answer.

    Only ASCII bodies: the struct decoder skips unread fields without checking their UTF-8 (an
    escaped lone surrogate is refused even there, raw CESU-8 bytes are not), and ASCII holds neither.
    A prompt the struct does not take (absent, a batch, an id out of range, a ``bool``) takes the
    stdlib path too, for its own message."""
    if memo is not None and (known := _known_completion(raw, memo)) is not None:
        return known
    if not raw.isascii():
        return None
    if memo is not None and worth_a_lookup(raw, memo):
        return _memoised_completion(raw, memo)
    try:
        body = _COMPLETION_DECODER.decode(raw)
    except _FAST_DECODE_ERRORS:
        return None
    if body.prompt is None:
        return None
    packed = None
    if type(body.prompt) is list:
        try:
            packed = array("I", body.prompt)
        except OverflowError:  # an id out of [0, 2**32): the stdlib path answers, as for any refusal
            return None
    common = _completion_common(body)
    if isinstance(body.prompt, str):
        return _text_completion(body.prompt, common)
    if not body.prompt:
        raise ApiError(400, "'prompt' must not be empty")
    return ParsedRequest(kind="completions", prompt=body.prompt, ids_checked=True, packed=packed, **common)


def _memoised_completion(raw: bytes, memo: TokenIdMemo) -> ParsedRequest | None:
    """:func:`typed_completion` of an ASCII body with its token ids decoded through ``memo``.

    A prompt that is not an array of ids takes the stdlib path, as from the typed decoder."""
    try:
        body = _RAW_PROMPT_DECODER.decode(raw)
        span = bytes(body.prompt)
        text = _TEXT_DECODER.decode(span) if span[:1] == b'"' else None
    except _FAST_DECODE_ERRORS:
        return None
    ids = decode_token_ids(span, memo) if text is None else None
    if text is None and ids is None:  # absent, null, empty, a batch, a bad id: the stdlib path answers
        return None
    common = _completion_common(body)
    if text is not None:
        return _text_completion(text, common)
    return ParsedRequest(kind="completions", prompt=ids, ids_checked=True, packed=ids, **common)


def _known_completion(raw: bytes, memo: TokenIdMemo) -> ParsedRequest | None:
    """:func:`_memoised_completion` of a body whose prompt ``memo`` noted whole
    (:func:`~balancer.tokenizer.token_ids.known_prompt`), without checking and decoding its text again;
    ``None`` when there is none, and then ``memo`` is as it was.

    The rest of the body is checked as the whole body would be: decoded with
    :data:`~balancer.tokenizer.token_ids.PROMPT_STANDIN` in place of the prompt's text, it must give
    the stand-in as its prompt, found in that body where the text was and nowhere else (so the text
    was the prompt's value, not part of a string or of another field). Since the text is a JSON array
    (of ids: ASCII), putting it back gives a body that decodes the same, but for its prompt; and
    that body is ``raw``. About 20 µs for 8k ids, against about 140 through the runs."""
    found = known_prompt(raw, memo)
    if found is None:
        return None
    start, end, ident = found
    rest = b"".join((raw[:start], PROMPT_STANDIN, raw[end:]))
    # the stand-in has no border: occurrences cannot overlap, so ``count`` counts every one
    if rest.count(PROMPT_STANDIN) != 1 or not rest.isascii():
        return None
    try:
        body = _RAW_PROMPT_DECODER.decode(rest)
    except _FAST_DECODE_ERRORS:
        return None
    if bytes(body.prompt) != PROMPT_STANDIN:
        return None
    ids = take_known(ident, memo)
    if ids is None:
        return None
    common = _completion_common(body)
    return ParsedRequest(kind="completions", prompt=ids, ids_checked=True, packed=ids, **common)


def packed_completion(body: Mapping[str, Any], packed: array[int]) -> ParsedRequest:
    """:func:`parse_body` of a ``/v1/completions`` body whose prompt is the token ids ``packed``
    (not in ``body``): an ``array('I')`` holds ids in ``[0, 2**32)`` only, so they need no check."""
    if not packed:
        raise ApiError(400, "'prompt' must not be empty")
    return ParsedRequest(kind="completions", prompt=packed, ids_checked=True, packed=packed, **_common(body))


def _completion_common(body: _CompletionBody | _RawPromptBody) -> dict[str, Any]:
    """:func:`_common` of a typed ``/v1/completions`` body."""
    fields = {
        "model": body.model,
        "stream": body.stream,
        "max_tokens": body.max_tokens,
        "max_completion_tokens": body.max_completion_tokens,
        "user": body.user,
        "n": body.n,
    }
    if body.stream_options is not msgspec.UNSET:
        fields["stream_options"] = body.stream_options
    return _common(fields)


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    """The checked fields every kind of request has."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    stream = body.get("stream")
    if stream is None:  # absent or null: OpenAI's and the engines' default, a whole answer
        stream = False
    elif not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean")
    options = body.get("stream_options")
    return {
        "model": model,
        "stream": stream,
        "stream_usage": stream_usage_of(stream, options, "stream_options" in body),
        "max_tokens": _max_tokens(body),
        "session_key": _optional_str(body, "user"),
        "sequences": _sequences(body),
    }


def json_text_chars(value: Any) -> int:
    """Characters of every string in a decoded JSON value, object keys included (no recursion)."""
    return json_text_size(value)[0]


def json_text_size(value: Any) -> tuple[int, int]:
    """Characters of every string in a decoded JSON value, object keys included, and an estimate of
    the bytes its objects take: ``sys.getsizeof`` of each value and key (a ``str`` 41–80 B plus its
    characters at 1, 2 or 4 B each, a ``dict`` 64–200 B plus its table, a ``list`` 56 B plus 8 B a
    slot, an ``int`` 28 B). Objects the decoder shares are counted at each use (a key such as
    ``"role"`` decoded once for every message, one-character strings, small ints, ``None``), so the
    estimate is above what ``tracemalloc`` measures: 1.00–1.45 of it on the shapes of
    ``tests/unit/test_parsed_bytes.py`` (1.37 for 270,000 one-letter messages, which keep 8.7× their
    body; 1.00 for one long string or 100,000 distinct keys).
    One pass, no recursion: the walk :func:`json_text_chars` did, with a ``getsizeof`` per item."""
    chars = 0
    size = 0
    sizeof = sys.getsizeof
    pending = [value]
    while pending:
        item = pending.pop()
        size += sizeof(item)
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            chars += sum(map(len, item))
            size += sum(map(sizeof, item))
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return chars, size


def json_text_ascii(value: Any) -> bool:
    """Whether every string in a decoded JSON value, object keys included, is ASCII: CPython keeps
    that as a flag of each ``str``, so this is one look per string and container, not per character."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                return False
        elif isinstance(item, dict):
            if not all(map(str.isascii, item)):
                return False
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return True


def _max_tokens(body: Mapping[str, Any]) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ApiError(400, f"'{name}' must be a non-negative integer")
        return value
    return 0


def _sequences(body: Mapping[str, Any]) -> int:
    """OpenAI's ``n``: sequences generated for the prompt (1 when absent or null), each decoding up
    to ``max_tokens``; forwarded untouched, counted in the decode load. A whole float (``2.0``)
    counts as its integer, as vLLM and SGLang (pydantic) read it."""
    value = body.get("n")
    if value is None:
        return 1
    if isinstance(value, float) and value.is_integer():  # 2.0: the engines' (pydantic's) lax int
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, "'n' must be a positive integer")
    return value


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


_DECIMAL_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def decimal_number(text: str) -> float | None:
    """``text`` (a query parameter) read as an unsigned decimal number in ASCII digits (``10``,
    ``0.5``, ``1e-3``), else ``None``. ``float`` alone also reads ``1_0``, `` 5``, ``5\\n``, ``+5``,
    ``inf`` and other scripts' digits (``\\u0665``, an Arabic-Indic five), none of which is a
    number as the OpenAPI document describes it. Too large for a float: ``inf``."""
    if _DECIMAL_NUMBER.fullmatch(text) is None:
        return None
    return float(text)


def decimal_integer(text: str) -> int | None:
    """``text`` (a path parameter) read as an integer in ASCII decimal digits with an optional
    ``-`` (``12``, ``-3``), else ``None``; ``int`` alone also reads `` 12``, ``1_2``, ``+12`` and other
    scripts' digits. ``None`` too past Python's 4,300-digit limit of ``int``."""
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # over sys.get_int_max_str_digits() digits
        return None


NO_QUERY: frozenset[str] = frozenset()
"""The query parameters of an endpoint that takes none: any is a 400 (:func:`check_query`)."""


def check_query(query: Mapping[str, str], known: frozenset[str]) -> None:
    """400 unless every query parameter in ``query`` (a multidict: aiohttp's ``request.query``) is
    one of ``known`` and given once: a repeated parameter is refused, not read as its first value."""
    unknown = sorted(set(query) - known)
    if unknown:
        names = [name[:40] for name in unknown[:5]]
        raise ApiError(400, f"unknown query parameter(s) {names}; known: {sorted(known)}")
    if len(query) > len(set(query)):  # a multidict's length counts every value, its keys once each
        counts = Counter(name for name, _ in query.items())
        repeated = sorted(name[:40] for name, count in counts.items() if count > 1)
        raise ApiError(400, f"query parameter(s) {repeated[:5]} given more than once; give each once")


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
