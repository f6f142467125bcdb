"""Load-time self-checks of a Hugging Face tokenizer: which shortcuts are exact for it (pure).

:class:`~balancer.tokenizer.tokenizer.HfTokenizer` takes three shortcuts: the segment cache
(:mod:`balancer.tokenizer.segments`: a text split at its added tokens, each segment encoded once),
the split of a rendered chat chunk by chunk (:meth:`~balancer.tokenizer.segments.Splitter.split_chunks`)
and a long text encoded in pieces (:mod:`balancer.tokenizer.cuts`). Each is read off the tokenizer's
description first (its normaliser, pre-tokenizer and post-processor, its added tokens), then proved
once, when the tokenizer is loaded, on a probe text encoded both ways: a shortcut whose proof fails
is not taken. No I/O, no state: CPU only (the probes are short texts).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer as _RustTokenizer

from balancer.tokenizer.cuts import cuts_apply, encode_pieces
from balancer.tokenizer.segments import AddedToken, SegmentCache, Splitter, build_splitter, encode_segmented

Encode = Callable[[str], list[int]]
"""Ids of a text, without special tokens (what the shortcuts are proved against)."""


def checked_cuts(rust: _RustTokenizer, raw: Encode, added: Sequence[AddedToken]) -> bool:
    """Whether :mod:`balancer.tokenizer.cuts` covers this tokenizer and, cut at every safe cut,
    a probe text's pieces give the ids of the whole (the proof checked once more here)."""
    try:
        pre_tokenizer = json.loads(rust.pre_tokenizer.__getstate__()) if rust.pre_tokenizer else None
    except (AttributeError, TypeError, ValueError):
        return False
    covered = cuts_apply(
        pre_tokenizer if isinstance(pre_tokenizer, dict) else None,
        identity_normalizer=_identity_normalizer(rust.normalizer),
        added=[(token.content, token.verbatim) for token in added],
        dropout=getattr(rust.model, "dropout", None),
    )
    if not covered:
        return False
    probe = _cuts_probe(added)
    whole = rust.encode(probe, add_special_tokens=False).ids
    ids, _ = encode_pieces(probe, raw, len(whole), min_chars=1)
    return ids == whole


def checked_splitter(
    rust: _RustTokenizer, raw: Encode, added: Sequence[AddedToken], segment_cache_tokens: int
) -> Splitter | None:
    """The added-token splitter for the segment cache, if segmenting is exact here (``None`` too
    when the cache is off: ``segment_cache_tokens`` 0)."""
    identity = _identity_normalizer(rust.normalizer)
    splitter = build_splitter(added, identity_normalizer=identity)
    if splitter is None or segment_cache_tokens <= 0:
        return None
    probe = _probe_text(_probe_tokens(added, splitter))
    plain = rust.encode(probe, add_special_tokens=False).ids
    cached = encode_segmented(probe, splitter, SegmentCache(min_chars=0), raw)
    return splitter if cached == plain else None


def adds_no_tokens(post_processor: Any) -> bool:
    """Whether a post-processor adds no token to a single text: none, or ``ByteLevel`` (it only
    trims offsets)."""
    if post_processor is None:
        return True
    try:
        state = json.loads(post_processor.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    return isinstance(state, dict) and state.get("type") == "ByteLevel"


CUTS_PROBE = (
    "Line one ends here.\nsecond line\n\n  indented\n\tTab\n\u00e9t\u00e9 \u4e2d\u6587\n1234 56\n"
    'x y z. Words, then a space: fox jumps \n\u0301mark\n-dash (paren) "quote" end'
)
"""What the load-time check of :mod:`~balancer.tokenizer.cuts` encodes whole and cut at every safe
cut (newlines before text and after spaces, letters before spaces, accents, CJK, digits)."""


def _cuts_probe(added: Sequence[AddedToken]) -> str:
    """:data:`CUTS_PROBE` with a few added tokens between its lines."""
    tokens = [token.content for token in added if token.verbatim][:3]
    return CUTS_PROBE + "\n" + "\n".join(f"a {token} b\n{token}" for token in tokens)


def _identity_normalizer(normalizer: Any) -> bool:
    """Whether ``normalizer`` (a ``tokenizers`` normaliser or ``None``) leaves every text as it is:
    none at all, or a ``Sequence`` of such (DeepSeek-V3 has an empty one)."""
    if normalizer is None:
        return True
    try:
        state = json.loads(normalizer.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    return _identity_state(state)


def _identity_state(state: Any) -> bool:
    if state is None:
        return True
    if isinstance(state, dict) and state.get("type") == "Sequence":
        return all(_identity_state(part) for part in state.get("normalizers", ()))
    return False


PROBE_PIECES = (
    "A segment",
    " another one ",
    "\u00e9t\u00e9 \u4e2d\u6587 1234",
    "\n\n  tabs\tand  spaces ",
    "x y",
)
"""Texts the self-check puts between and around split tokens (spaces, newlines, accents, CJK, digits)."""


def _probe_tokens(added: Sequence[AddedToken], splitter: Splitter) -> list[str]:
    """Up to three split tokens of each kind (special or not, normalised or not), for the self-check."""
    kinds: dict[tuple[bool, bool], list[str]] = {}
    for token in added:
        if token.content in splitter.ids:
            found = kinds.setdefault((token.special, token.normalized), [])
            if len(found) < 3:
                found.append(token.content)
    return [token for found in kinds.values() for token in found]


def _probe_text(tokens: Sequence[str]) -> str:
    """A text holding ``tokens`` at the start, the end, side by side and between
    :data:`PROBE_PIECES`: what the self-check encodes both ways."""
    parts: list[str] = [tokens[0]]
    for index, piece in enumerate(PROBE_PIECES * 2):
        parts += [piece, tokens[index % len(tokens)]]
        if index % 3 == 0:
            parts.append(tokens[(index + 1) % len(tokens)])
    parts.append(tokens[-1])
    return "".join(parts)


def chunks_split_alike(splitter: Splitter, added: Sequence[AddedToken]) -> bool:
    """The self-check of :meth:`Splitter.split_chunks`: the probe text cut in two at every position,
    and cut at every piece's ends and inside every text piece, split chunk by chunk gives the
    pieces of the whole text whenever it answers."""
    text = _probe_text(_probe_tokens(added, splitter))
    expected = splitter.split(text)
    cuts = [[text[:at], text[at:]] for at in range(len(text) + 1)]
    chunks: list[str] = []
    for piece in expected:
        middle = 0 if piece in splitter.ids else len(piece) // 2
        chunks += [piece[:middle], piece[middle:]]
    for pieces in map(splitter.split_chunks, [*cuts, chunks]):
        if pieces is not None and pieces != expected:
            return False
    return True
