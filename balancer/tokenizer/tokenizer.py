"""The tokenizer seam: prompt or chat messages → token ids (IO-light).

Loading reads files (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) and is
blocking: the service calls :func:`load_tokenizer` / :meth:`HfTokenizer.load` once, in a thread.
Encoding does no I/O but is CPU work (milliseconds for a long prompt), so the service runs
``encode_*`` for long prompts through ``asyncio.to_thread``; a loaded tokenizer is immutable and
safe to share between threads.

The ids match what the engine computes (vLLM, SGLang): the chat is rendered by its template (see
:mod:`balancer.tokenizer.chat_template`), and the rendered text, which already holds BOS when the template
writes it, is encoded **without** special tokens (vLLM's chat default, ``add_special_tokens=False``).
Plain ``/v1/completions`` prompts are encoded **with** them, as the ``tokenizer.json`` post-processor
defines (vLLM's completions default; DeepSeek-V3's post-processor adds none, so its prompts get no BOS).
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import Tokenizer as _RustTokenizer

from balancer.errors import BalancerError, ConfigError
from balancer.tokenizer.chat_template import RENDER_ERRORS, ChatTemplate, flatten_messages, special_tokens
from balancer.tokenizer.cuts import PIECE_CHARS, LongPiece, encode_pieces
from balancer.tokenizer.segments import (
    AddedToken,
    SegmentCache,
    encode_pieces_packed,
    encode_segmented,
)
from balancer.tokenizer.self_checks import adds_no_tokens, checked_cuts, checked_splitter, chunks_split_alike
from balancer.tokenizer.words import WordMemo, checked_words

MAX_REASON_CHARS = 200
"""Longest tokenizer error text passed on to a client."""

_NO_CHAT = "no tokenizer is configured: chat requests need a tokenizer (and its chat template)"


class TokenizeError(BalancerError, ValueError):
    """A prompt that cannot be turned into token ids (maps to HTTP 400)."""


class PromptTooLarge(TokenizeError):
    """A prompt over a configured limit; ``size`` and ``limit`` are in ``unit`` (maps to HTTP 400).

    ``at_least``: ``size`` is a lower bound (a text refused before all of it was tokenized,
    :mod:`balancer.tokenizer.cuts`)."""

    def __init__(self, size: int, limit: int, unit: str, *, at_least: bool = False) -> None:
        has = f"at least {size} {unit} (the rest was not tokenized)" if at_least else f"{size} {unit}"
        super().__init__(f"prompt has {has}, over the limit of {limit} {unit}")
        self.size = size
        self.limit = limit
        self.unit = unit
        self.at_least = at_least


class LongRender(LongPiece):
    """A rendered chat longer than the caller held memory for
    (:meth:`HfTokenizer.encode_chat_in_pieces`), raised before it is encoded; the caller then
    holds the whole encode's estimate, as for a :class:`~balancer.tokenizer.cuts.LongPiece`."""

    def __init__(self, rendered_chars: int, max_chars: int) -> None:
        Exception.__init__(self, f"the rendered chat has {rendered_chars} characters, over {max_chars}")
        self.start = 0
        self.max_chars = max_chars
        self.rendered_chars = rendered_chars


class ChatTemplateError(TokenizeError):
    """The chat template refused the messages (``raise_exception``) or failed on them."""


@dataclass(frozen=True, slots=True)
class TokenizeLimits:
    """Size caps checked before and after tokenizing."""

    max_prompt_chars: int = 4_000_000
    """Longest prompt text or rendered chat, in characters. Longer: :class:`PromptTooLarge` is raised
    before any tokenizing, so an oversized body costs no CPU."""

    max_prompt_tokens: int = 1_048_576
    """Most token ids one prompt may have, tokenized or passed through. More: :class:`PromptTooLarge`."""

    segment_cache_tokens: int = 2_000_000
    """Token ids kept by the segment cache (8 bytes each, 12 for a segment a chat on the event loop
    hit: its ``u32`` copy; repeated system prompts and earlier turns are then tokenized once). 0
    disables it; past the cap the least recently used segments go."""

    segment_cache_bytes: int = 128 * 1024 * 1024
    """Bytes the segment cache holds at most: each segment's text (1, 2 or 4 bytes a character), its
    ids and about 700 bytes of entry, and its ``u32`` copy
    (:func:`~balancer.tokenizer.segments.segment_bytes`). Ordinary text is 11–32 bytes a cached id,
    so ``segment_cache_tokens`` binds first (21–61 MiB); this bounds the texts of few ids (a run of
    spaces is 128 characters an id), which could make the cache about 1 GiB. 0 disables the cache;
    past the cap the least recently used segments go, and a segment over a quarter of it is not
    cached."""

    piece_chars: int = PIECE_CHARS
    """Characters from which a text is encoded in pieces of at least this many, and refused once
    they hold more than ``max_prompt_tokens`` ids (:mod:`balancer.tokenizer.cuts`; for the
    tokenizers it covers). A piece's encode is what may be spent past the limit (at the default,
    22–133 ms of CPU measured: :data:`~balancer.tokenizer.cuts.PIECE_CHARS`). 1.."""

    def __post_init__(self) -> None:
        if self.max_prompt_chars <= 0 or self.max_prompt_tokens <= 0 or self.piece_chars <= 0:
            raise ConfigError(f"tokenize limits must be > 0, got {self}")
        if self.segment_cache_tokens < 0 or self.segment_cache_bytes < 0:
            raise ConfigError(f"the segment cache's limits must be >= 0, got {self}")

    def check_chars(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise PromptTooLarge(len(text), self.max_prompt_chars, "characters")

    def check_chars_sum(self, texts: Iterable[str]) -> None:
        total = sum(map(len, texts))
        if total > self.max_prompt_chars:
            raise PromptTooLarge(total, self.max_prompt_chars, "characters")

    def check_tokens(self, count: int) -> None:
        if count > self.max_prompt_tokens:
            raise PromptTooLarge(count, self.max_prompt_tokens, "tokens")


Messages = Sequence[Mapping[str, Any]]
Tools = Sequence[Mapping[str, Any]]


@runtime_checkable
class Tokenizer(Protocol):
    """What the request path needs: token ids for a completion prompt or a chat."""

    limits: TokenizeLimits
    """The size caps it checks (the request path checks ``max_prompt_chars`` of a text prompt itself
    before it holds bytes for a thread: :func:`balancer.api.openai.tokenize_inline`)."""

    @property
    def name(self) -> str:
        """Label for logs and metrics (e.g. the tokenizer's directory name)."""
        ...

    def encode_prompt(
        self,
        prompt: str | Sequence[int],
        *,
        add_special_tokens: bool = True,
        max_piece_chars: int | None = None,
    ) -> list[int]:
        """Ids of a ``/v1/completions`` prompt: text is tokenized, a list of ids is validated.
        ``max_piece_chars``: a text :meth:`encodes_in_pieces` raises
        :class:`~balancer.tokenizer.cuts.LongPiece`, before anything is encoded, when one of its
        pieces would be longer (the caller held memory for pieces of at most that many)."""
        ...

    def encodes_in_pieces(self, text_chars: int, *, add_special_tokens: bool = True) -> bool:
        """Whether :meth:`encode_prompt` encodes a text of ``text_chars`` characters in pieces of
        ``limits.piece_chars`` or more (:mod:`balancer.tokenizer.cuts`), and so honours
        ``max_piece_chars``; with ``add_special_tokens=False``, whether a rendered chat's segments
        that long are (:meth:`encode_chat_in_pieces`). Pure, a few comparisons."""
        ...

    def render_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat as the engine's template renders it (the text of ``/v1/chat/completions/render``)."""
        ...

    def encode_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the rendered chat, as the engine will prefill them."""
        ...

    def encode_chat_in_pieces(
        self,
        messages: Messages,
        chat_kwargs: Mapping[str, Any],
        max_piece_chars: int,
        max_rendered_chars: int,
    ) -> list[int]:
        """:meth:`encode_chat` (``chat_kwargs``: its keyword arguments) for a caller that held memory
        for pieces of at most ``max_piece_chars`` characters and a rendered chat of at most
        ``max_rendered_chars``: :class:`~balancer.tokenizer.cuts.LongPiece` before anything is
        encoded when the rendered chat is longer, or when one of a segment's pieces would be (a
        segment encoded whole is at most ``limits.piece_chars``)."""
        ...

    def encode_chat_if_cached(
        self, messages: Messages, chat_kwargs: Mapping[str, Any], max_new_chars: int
    ) -> Sequence[int] | None:
        """:meth:`encode_chat` (``chat_kwargs``: its keyword arguments) when at most
        ``max_new_chars`` characters of the rendered chat are not in a cache of already tokenized
        text; else ``None``, having rendered the chat but encoded nothing (the caller encodes it in
        a thread). The ids may come as an ``array('I')``, the form the request path keeps them in."""
        ...


def validate_token_ids(token_ids: Sequence[int], limits: TokenizeLimits) -> list[int]:
    """A copy of ``token_ids`` after checking each is an ``int`` with ``0 <= t < 2**32``.

    Raises :class:`TokenizeError` (a ``ValueError``) naming the problem, or :class:`PromptTooLarge`.
    """
    if isinstance(token_ids, (str, bytes)):
        raise TokenizeError("token ids must be a list of integers, not a string")
    limits.check_tokens(len(token_ids))
    ids = list(token_ids)
    if not ids:
        return ids
    kinds = set(map(type, ids))  # C-speed type scan; bool is rejected although it is an int
    if kinds != {int}:
        bad = sorted(k.__name__ for k in kinds - {int})
        raise TokenizeError(f"token ids must be integers, found {', '.join(bad)}")
    try:  # one C pass that fails on any id outside [0, 2**32) (cheaper than min() and max())
        array("I", ids)
    except OverflowError:
        low, high = min(ids), max(ids)
        wrong = low if low < 0 else high
        raise TokenizeError(f"token id {wrong} is outside [0, 2**32)") from None
    return ids


class TokenIdTokenizer:
    """Passthrough for deployments without a tokenizer: only token-id prompts can be routed."""

    __slots__ = ("limits",)

    def __init__(self, limits: TokenizeLimits | None = None) -> None:
        self.limits = limits or TokenizeLimits()

    @property
    def name(self) -> str:
        return "token-ids"

    def encode_prompt(
        self,
        prompt: str | Sequence[int],
        *,
        add_special_tokens: bool = True,
        max_piece_chars: int | None = None,
    ) -> list[int]:
        if isinstance(prompt, str):
            raise TokenizeError(
                "no tokenizer is configured: send the prompt as a list of token ids, or configure one"
            )
        return validate_token_ids(prompt, self.limits)

    def encodes_in_pieces(self, text_chars: int, *, add_special_tokens: bool = True) -> bool:
        return False

    def render_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> str:
        raise TokenizeError(_NO_CHAT)

    def encode_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        raise TokenizeError(_NO_CHAT)

    def encode_chat_in_pieces(
        self,
        messages: Messages,
        chat_kwargs: Mapping[str, Any],
        max_piece_chars: int,
        max_rendered_chars: int,
    ) -> list[int]:
        raise TokenizeError(_NO_CHAT)

    def encode_chat_if_cached(
        self, messages: Messages, chat_kwargs: Mapping[str, Any], max_new_chars: int
    ) -> Sequence[int] | None:
        raise TokenizeError(_NO_CHAT)


class HfTokenizer:
    """A Hugging Face fast tokenizer (``tokenizer.json``) plus its chat template."""

    __slots__ = (
        "_chat",
        "_chunked",
        "_cuts",
        "_cuts_special",
        "_name",
        "_segments",
        "_splitter",
        "_tokenizer",
        "_words",
        "limits",
    )

    def __init__(
        self,
        tokenizer: _RustTokenizer,
        chat: ChatTemplate,
        *,
        name: str,
        limits: TokenizeLimits | None = None,
    ) -> None:
        # Truncation or padding saved in tokenizer.json would silently change the ids: turn them off.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._chat = chat
        self._name = name
        self.limits = limits or TokenizeLimits()
        self._segments = SegmentCache(
            max_tokens=self.limits.segment_cache_tokens,
            max_bytes=self.limits.segment_cache_bytes,
            ints=self._shared_ints(),
        )
        added = self._added()
        self._splitter = checked_splitter(tokenizer, self._raw, added, self.limits.segment_cache_tokens)
        self._chunked = self._splitter is not None and chunks_split_alike(self._splitter, added)
        self._cuts = checked_cuts(tokenizer, self._raw, added)
        """Whether a long text is encoded in pieces (:mod:`balancer.tokenizer.cuts`)."""
        self._cuts_special = self._cuts and adds_no_tokens(self._tokenizer.post_processor)
        """... also with special tokens (the post-processor adds none)."""
        self._words = (
            checked_words(WordMemo(self._encode_offsets), self._raw) if self._chunked and self._cuts else None
        )
        """A new piece of a chat found by :meth:`encode_chat_if_cached` (a user message), word by word
        (:mod:`balancer.tokenizer.words`): only where the safe cuts hold for this tokenizer."""

    def _added(self) -> list[AddedToken]:
        return [
            AddedToken(
                content=str(tok.content),
                token_id=int(token_id),
                special=bool(tok.special),
                verbatim=not (tok.lstrip or tok.rstrip or tok.single_word),
                normalized=bool(tok.normalized),
            )
            for token_id, tok in self._tokenizer.get_added_tokens_decoder().items()
        ]

    def _shared_ints(self) -> tuple[int, ...]:
        """One int object per vocabulary id, for the segment cache (none when the cache is off)."""
        if self.limits.segment_cache_tokens <= 0 or self.limits.segment_cache_bytes <= 0:
            return ()
        return tuple(range(self._tokenizer.get_vocab_size(with_added_tokens=True)))

    def _raw(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=False)

    def _encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text`` (no special tokens) and each id's characters, for :class:`WordMemo`
        (``Tokenizer.encode`` holds the GIL: only for the short texts encoded on the event loop)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def _raw_words(self, text: str) -> list[int]:
        """:meth:`_raw`, word by word from :attr:`_words` where it can."""
        words = self._words
        ids = words.ids(text) if words is not None else None
        return self._raw(text) if ids is None else ids

    @property
    def word_memo(self) -> WordMemo | None:
        """The memo of words :meth:`encode_chat_if_cached` encodes new text with (``None``: off)."""
        return self._words

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text``, encoded with the GIL released.

        ``Tokenizer.encode`` holds the GIL for the whole encode (milliseconds for a long prompt), so
        running it in a thread still stops the event loop; ``encode_batch_fast`` releases it and
        gives the same ids (it skips only the character offsets, which kvlb does not read).
        """
        ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[
            0
        ].ids
        return ids

    @property
    def segment_cache(self) -> SegmentCache | None:
        """The segment cache in use (``None`` when segmenting is not exact for this tokenizer)."""
        return self._segments if self._splitter is not None else None

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        chat_template: str | None = None,
        name: str | None = None,
        limits: TokenizeLimits | None = None,
        clock: Callable[[], datetime] = datetime.now,
    ) -> HfTokenizer:
        """Load ``tokenizer.json`` (a directory or the file) and the template beside it. Blocking.

        The template is, first found: ``chat_template`` (the template text itself), a
        ``chat_template.jinja`` file, ``chat_template`` in ``tokenizer_config.json`` (a string, or a
        list of ``{"name", "template"}`` of which ``default`` is used, and ``tool_use`` when the
        request has tools, as transformers does), else ChatML. Raises :class:`ConfigError` when
        files are missing or malformed.
        """
        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        try:
            tokenizer = _RustTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust binding raises a bare Exception for every failure
            raise ConfigError(f"cannot load tokenizer {file}: {exc}") from exc
        config = _read_config(file.parent / "tokenizer_config.json")
        template = chat_template if chat_template is not None else _find_template(file.parent, config)
        chat = ChatTemplate(template, special_tokens(config), clock)
        return cls(tokenizer, chat, name=name or file.parent.name or file.stem, limits=limits)

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def encode_prompt(
        self,
        prompt: str | Sequence[int],
        *,
        add_special_tokens: bool = True,
        max_piece_chars: int | None = None,
    ) -> list[int]:
        """Ids of a completion prompt. CPU-bound: run long prompts via ``asyncio.to_thread``.
        ``max_piece_chars``: as :meth:`Tokenizer.encode_prompt` says."""
        if not isinstance(prompt, str):
            return validate_token_ids(prompt, self.limits)
        return self._encode(prompt, add_special_tokens, max_piece_chars)

    def encodes_in_pieces(self, text_chars: int, *, add_special_tokens: bool = True) -> bool:
        """Whether a text of ``text_chars`` characters is encoded in pieces (``add_special_tokens``
        as :meth:`encode_prompt`'s): over ``limits.piece_chars``, on a tokenizer
        :mod:`~balancer.tokenizer.cuts` covers."""
        return text_chars > self.limits.piece_chars and (
            self._cuts_special if add_special_tokens else self._cuts
        )

    def render_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the chat template. Raises :class:`ChatTemplateError` when the template refuses."""
        chunks = self._render_chunks(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return chunks[0] if len(chunks) == 1 else "".join(chunks)

    def _render_chunks(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> list[str]:
        """The rendered chat as the template's output chunks (:meth:`ChatTemplate.render_chunks`)."""
        flat = flatten_messages(messages)
        # Cheap guard first: rendering a huge body would cost CPU before the size check below.
        self.limits.check_chars_sum(m["content"] for m in flat if isinstance(m.get("content"), str))
        try:
            chunks = self._chat.render_chunks(
                flat,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=template_kwargs,
            )
        except RENDER_ERRORS as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        self.limits.check_chars_sum(chunks)
        return chunks

    def encode_chat(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the rendered chat. CPU-bound: run long chats via ``asyncio.to_thread``.

        No special tokens are added: the template writes BOS itself, as vLLM's chat endpoint assumes.
        """
        text = self.render_chat(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
        )
        return self._encode(text, add_special_tokens=False)

    def encode_chat_in_pieces(
        self,
        messages: Messages,
        chat_kwargs: Mapping[str, Any],
        max_piece_chars: int,
        max_rendered_chars: int,
    ) -> list[int]:
        """:meth:`Tokenizer.encode_chat_in_pieces`: the chat rendered, then, when it is at most
        ``max_rendered_chars`` long (else :class:`LongRender`), encoded as :meth:`encode_chat` does
        (by segment between added tokens, a segment over ``limits.piece_chars`` in pieces when
        :mod:`~balancer.tokenizer.cuts` covers this tokenizer) with ``max_piece_chars``: a segment
        whose pieces would be longer raises :class:`~balancer.tokenizer.cuts.LongPiece` before it
        is encoded (the segments before it were, within the caller's hold)."""
        text = self.render_chat(messages, **chat_kwargs)
        if len(text) > max_rendered_chars:
            raise LongRender(len(text), max_rendered_chars)
        return self._encode(text, add_special_tokens=False, max_piece_chars=max_piece_chars)

    def encode_chat_if_cached(
        self, messages: Messages, chat_kwargs: Mapping[str, Any], max_new_chars: int
    ) -> array[int] | None:
        """:meth:`encode_chat` as an ``array('I')`` if at most ``max_new_chars`` characters of the
        rendered chat miss the segment cache (a shared system prompt or earlier turns are hits), else
        ``None``. Renders and splits the chat either way: cheap next to encoding.

        The rendered chat is split chunk by chunk (:meth:`Splitter.split_chunk_parts`), not joined: the
        joined text would be a new two-byte-a-character string to scan, slice and copy (about 30 µs
        of the 40 µs this took for an 8k-token chat). That needs the load-time self-check
        (:func:`~balancer.tokenizer.self_checks.chunks_split_alike`) to have passed and no token to
        straddle two chunks; otherwise the joined text is split. A piece that several chunks make
        (the system prompt and the ``"\\n\\n"`` after it) is looked up in the cache by its parts
        and joined only when it misses."""
        splitter = self._splitter
        if splitter is None:
            return None
        chunks = self._render_chunks(messages, **chat_kwargs)
        pieces: Sequence[str | tuple[str, ...]] | None = None
        if self._chunked:
            pieces = splitter.split_chunk_parts(chunks)
        if pieces is None:
            pieces = splitter.split(chunks[0] if len(chunks) == 1 else "".join(chunks))
        with encode_errors(chunks):
            ids = encode_pieces_packed(pieces, splitter, self._segments, self._raw_words, max_new_chars)
        if ids is not None:
            self.limits.check_tokens(len(ids))
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``token_ids`` (for tests, debugging and ``/admin`` views)."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool, max_piece_chars: int | None = None) -> list[int]:
        self.limits.check_chars(text)
        ids: list[int] | None
        if self._splitter is not None and not add_special_tokens:
            counted = _Counted(segments=True, max_piece_chars=max_piece_chars)
            encode = functools.partial(self._counted, add_special_tokens=False, counted=counted)
            with encode_errors(text):
                ids = encode_segmented(text, self._splitter, self._segments, encode)
            assert ids is not None  # no character budget
        else:
            with encode_errors(text):
                ids = self._counted(
                    text, add_special_tokens, _Counted(segments=False, max_piece_chars=max_piece_chars)
                )
        self.limits.check_tokens(len(ids))
        return ids

    def _counted(self, text: str, add_special_tokens: bool, counted: _Counted) -> list[int]:
        """Ids of ``text`` (a prompt, or a segment of one: ``counted`` holds the tokens of the
        segments encoded before it). A text over ``limits.piece_chars`` is
        encoded in pieces when :mod:`~balancer.tokenizer.cuts` covers this tokenizer, and refused
        (:class:`PromptTooLarge`, a lower bound) as soon as the tokens counted pass
        ``max_prompt_tokens``; so is a segment encoded whole that takes the count past it."""
        limit = self.limits.max_prompt_tokens
        if self.encodes_in_pieces(len(text), add_special_tokens=add_special_tokens):
            room, piece_chars = limit - counted.tokens, self.limits.piece_chars
            pieces, count = encode_pieces(text, self._raw, room, piece_chars, counted.max_piece_chars)
            if pieces is None:
                raise PromptTooLarge(counted.tokens + count, limit, "tokens", at_least=True)
            ids = pieces
        else:
            ids = self._ids(text, add_special_tokens)
        counted.tokens += len(ids)
        if counted.segments and counted.tokens > limit:
            raise PromptTooLarge(counted.tokens, limit, "tokens", at_least=True)
        return ids


class _Counted:
    """The tokens one :meth:`HfTokenizer._encode` has encoded so far."""

    __slots__ = ("max_piece_chars", "segments", "tokens")

    def __init__(self, *, segments: bool, max_piece_chars: int | None = None) -> None:
        self.tokens = 0
        self.max_piece_chars = max_piece_chars
        """The longest piece the caller held memory for (:class:`~balancer.tokenizer.cuts.LongPiece`
        past it); ``None``: any."""
        self.segments = segments
        """Whether the text comes as segments (between added tokens): the count of the segments
        encoded so far is then a lower bound of the text's, checked after each; else the one
        count is the text's, checked by the caller."""


def first_surrogate(text: str) -> int | None:
    """Position of the first lone UTF-16 surrogate in ``text`` (``None`` when there is none): the
    only code points UTF-8 cannot encode. ASCII text is answered at once; other text costs one
    encode, about 1 ms per MB (a regex scan costs up to 3 ms per MB on Latin text)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


@contextmanager
def encode_errors(text: str | Sequence[str]) -> Iterator[None]:
    """What the Rust binding raises while encoding ``text`` (``TypeError`` for lone surrogates, a
    bare ``Exception`` else) becomes a :class:`TokenizeError` naming it; ours pass through.
    ``text`` may be given as its chunks, joined only when a failure is reported."""
    try:
        yield
    except (TokenizeError, LongPiece):
        raise
    except Exception as exc:
        whole = text if isinstance(text, str) else "".join(text)
        raise TokenizeError(encode_failure(whole, exc)) from None


def encode_failure(text: str, exc: BaseException) -> str:
    """The client-facing reason a tokenizer refused ``text`` (run only after a failure)."""
    position = first_surrogate(text)
    if position is not None:
        code = ord(text[position])
        return (
            f"the prompt is not valid Unicode: lone UTF-16 surrogate U+{code:04X} at character "
            f"{position}; send text as UTF-8 (or escaped surrogate pairs)"
        )
    return f"the prompt cannot be tokenized: {type(exc).__name__}: {str(exc)[:MAX_REASON_CHARS]}"


def load_tokenizer(
    path: str | Path | None,
    *,
    chat_template: str | None = None,
    limits: TokenizeLimits | None = None,
) -> Tokenizer:
    """A tokenizer from a directory or a ``tokenizer.json`` path; ``None`` gives the id passthrough.

    Blocking (reads files): call it from a thread in async code.
    """
    if path is None:
        return TokenIdTokenizer(limits)
    return HfTokenizer.load(path, chat_template=chat_template, limits=limits)


def _find_template(folder: Path, config: Mapping[str, Any]) -> Any:
    """``chat_template.jinja`` (what transformers 5 saves) wins over the config's ``chat_template``."""
    jinja_file = folder / "chat_template.jinja"
    if not jinja_file.is_file():
        return config.get("chat_template")
    try:
        return jinja_file.read_text("utf-8")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {jinja_file}: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config
