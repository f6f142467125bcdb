"""The memo of chat body prefixes: a body beginning with a known prefix decodes exactly as a whole
decode does (fields, their order and types, errors), bounded in entries and bytes, counted
(``balancer/api/prefix_memo.py``)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.api.errors import ApiError
from balancer.api.parsing import decode_object, parse_request
from balancer.api.prefix_memo import ENTRY_OVERHEAD_BYTES, MIN_PREFIX_BYTES, PrefixMemo

SYSTEM = "You are a careful assistant who answers about caches. " * 60


def _body(question: str, system: str = SYSTEM, **more: Any) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return json.dumps({"model": "m", "max_tokens": 8, "messages": messages, **more}).encode()


def _answer(call: Any, raw: bytes) -> tuple[str, Any]:
    """What ``call(raw)`` gives, or the 4xx it raises, in a form where ``1``, ``1.0`` and ``True``
    and the order of keys differ."""
    try:
        value = call(raw)
    except ApiError as exc:
        return ("error", (exc.status, exc.message))
    if isinstance(value, dict):
        return ("value", msgspec.json.encode(value))
    return ("value", value)


def _learned(memo: PrefixMemo, primer: bytes) -> None:
    """Three sights of bodies sharing a prefix: the head noted, the prefix proposed, then proved."""
    for _ in range(3):
        assert memo.decode(primer) == decode_object(primer)


def test_a_shared_system_prompt_is_decoded_once_and_the_rest_joined_exactly() -> None:
    memo = PrefixMemo(16, 1 << 24)
    bodies = [_body(f"Question {i}?", stream=i % 2 == 0) for i in range(6)]
    for raw in bodies:
        assert _answer(memo.decode, raw) == _answer(decode_object, raw)
    assert memo.counts() | {"held_bytes": 0} == {
        "hits": 4,  # from the third sight on
        "misses": 2,  # the head's first sight, then the prefix's proposal
        "learned": 1,
        "refused": 0,
        "fallbacks": 0,
        "evictions": 0,
        "too_large": 0,
        "entries": 1,
        "held_bytes": 0,
    }
    assert memo.bytes > len(SYSTEM) + ENTRY_OVERHEAD_BYTES
    for i, raw in enumerate(bodies):  # the parsed request too
        assert parse_request(raw, "chat", known=memo.decode_known) == parse_request(raw, "chat"), i


def test_a_request_changing_its_decoded_body_does_not_change_the_memo() -> None:
    memo = PrefixMemo(16, 1 << 24)
    _learned(memo, _body("first"))
    got = memo.decode(_body("second"))
    got["messages"][0]["content"] = "changed"
    got["messages"].append({"role": "user", "content": "more"})
    got["model"] = "other"
    assert memo.decode(_body("third")) == decode_object(_body("third"))
    assert memo.hits == 3


def test_bodies_never_sent_again_cost_a_digest_of_their_head_and_nothing_is_kept() -> None:
    memo = PrefixMemo(16, 1 << 24)
    for i in range(40):
        raw = _body("q", system=f"System prompt number {i}. " + SYSTEM)
        assert memo.decode_known(raw) is None
    assert len(memo) == 0 and memo.misses == 40 and memo.bytes == 0
    short = _body("q", system="short")
    assert len(short) < MIN_PREFIX_BYTES
    for _ in range(3):
        assert memo.decode_known(short) is None
    assert memo.misses == 40  # not even looked at


def test_bodies_the_join_could_answer_otherwise_are_decoded_whole() -> None:
    memo = PrefixMemo(16, 1 << 24)
    _learned(memo, _body("q"))
    cases = [
        _body("q")[:-1] + b', "model": "again"}',  # a key the prefix holds (the whole decode keeps the last)
        _body("q")[:-1] + b', "": 1}',  # the synthetic document's own key
        _body("q")[:-1] + b', "messages": []}',
        _body("q")[:-1] + b', "\\u006dodel": "escaped"}',  # "model" again, escaped
        _body("q")[:-3],  # cut
        _body("q")[:-2] + b"\xff]}",  # not UTF-8
        _body("q")[:-1] + b', "t": 1e400}',  # msgspec refuses, the stdlib path reads it as inf
        _body("q")[:-4] + b'\\ud800"}]}',  # a lone surrogate
    ]
    for raw in cases:
        assert _answer(memo.decode, raw) == _answer(decode_object, raw), raw[-40:]
        assert _answer(lambda r: parse_request(r, "chat", known=memo.decode_known), raw) == _answer(
            lambda r: parse_request(r, "chat"), raw
        )
    assert memo.fallbacks == 2 * len(cases)  # every one (twice: the decode, then the parse)
    assert memo.hits == 1


def test_a_prefix_whose_state_is_not_proved_is_refused_and_not_proposed_again() -> None:
    memo = PrefixMemo(16, 1 << 24)
    # the last "}, {" before the last "role" is in the user's message: a prefix ending in a string
    system = {"role": "system", "content": SYSTEM}
    bodies = [
        json.dumps(
            {"model": "m", "messages": [system, {"content": f"see {{a}}, {{b}} {i}", "role": "user"}]}
        ).encode()
        for i in range(6)
    ]
    for raw in bodies:
        assert _answer(memo.decode, raw) == _answer(decode_object, raw)
    assert memo.refused == 1 and memo.learned == 0 and memo.hits == 0 and len(memo) == 0


def test_the_memo_is_bounded_in_entries_and_bytes_and_counts_what_it_drops() -> None:
    memo = PrefixMemo(2, 1 << 24)
    for n in range(4):
        _learned(memo, _body("q", system=f"Prompt {n}. " + SYSTEM))
    assert len(memo) == 2 and memo.evictions == 2 and memo.learned == 4
    assert memo.decode_known(_body("q2", system="Prompt 0. " + SYSTEM)) is None  # evicted
    assert memo.decode_known(_body("q2", system="Prompt 3. " + SYSTEM)) is not None
    small = PrefixMemo(16, 4 * ENTRY_OVERHEAD_BYTES)  # room for pending entries, not for the fields
    _learned(small, _body("q"))
    assert small.too_large == 1 and small.learned == 0 and len(small) == 0 and small.bytes == 0
    for _ in range(3):  # not proposed, hence not decoded, again
        assert small.decode_known(_body("q")) is None
    assert small.too_large == 1 and len(small) == 0
    off = PrefixMemo(0, 1 << 24)
    for _ in range(3):
        assert off.decode_known(_body("q")) is None
    assert off.counts()["misses"] == 0
    with pytest.raises(ValueError):
        PrefixMemo(-1, 0)


_WS = st.sampled_from(["", " ", "\n  ", "\t", "\r\n"])
_TEXT = st.text(
    alphabet=st.sampled_from([*"abc xyz,:[]", "é", "汉", "\U0001f600", '"', "\\", "\n", "\u2028"]),
    max_size=12,
)
_ESCAPED = st.sampled_from(['"\\u00e9l\\u00e8ve"', '"\\ud83d\\ude00"', '"a\\"b\\\\"', '"\\n"', '"tab\\t"'])
_VALUE = st.one_of(
    st.builds(json.dumps, _TEXT),
    st.builds(lambda t: json.dumps(t, ensure_ascii=False), _TEXT),
    _ESCAPED,
    st.sampled_from(["1", "1.0", "true", "false", "null", "-0", "1e5", "[]", "{}", '[{"a": [1, {"b": 0}]}]']),
)
_PREFIX_KEY = st.sampled_from(
    ['"model"', '"max_tokens"', '"tools"', '"user"', '"stream"', '"m\\u006fdel"', '"messages"', '"n"']
)
_TAIL_KEY = st.sampled_from(
    ['"stream"', '"max_tokens"', '"model"', '"messages"', '""', '"\\u006dodel"', '"stop"', '"tools"', '"x"']
)


@st.composite
def _message(draw: st.DrawFn) -> str:
    role = draw(st.sampled_from(['"user"', '"assistant"', '"tool"', '"\\u0075ser"']))
    content = draw(
        st.one_of(
            _VALUE,
            st.builds(lambda t: json.dumps([{"type": "text", "text": t}]), _TEXT),
        )
    )
    ws = draw(_WS)
    pairs = [f'"role"{ws}:{ws}{role}', f'"content":{content}']
    if draw(st.booleans()):
        pairs.reverse()
    if draw(st.booleans()):
        pairs.append(f'"name": {draw(_VALUE)}')
    return "{" + ws + ("," + ws).join(pairs) + ws + "}"


@st.composite
def _prefix(draw: st.DrawFn) -> str:
    """A body's start up to the end of its last leading message, at least 2 kB."""
    ws = draw(_WS)
    before = [f"{draw(_PREFIX_KEY)}{ws}:{ws}{draw(_VALUE)}" for _ in range(draw(st.integers(0, 3)))]
    filler = draw(st.sampled_from(["Be brief. ", "Sé breve. ", "简短。", "\\u00e9t\\u00e9 "]))
    system = json.dumps(filler * (MIN_PREFIX_BYTES // len(filler) + 10), ensure_ascii=draw(st.booleans()))
    messages = [f'{{"role": "system", "content": {system}}}']
    messages += [draw(_message()) for _ in range(draw(st.integers(0, 2)))]
    sep = draw(st.sampled_from([",", ", "]))  # the separators whose boundary is found
    key = draw(st.sampled_from(['"messages"', '"m\\u0065ssages"']))
    head = ("{" + ws + ("," + ws).join([*before, f"{key}{ws}:{ws}["])) if before else "{" + ws + key + ":["
    return head + sep.join(messages)


@st.composite
def _tail(draw: st.DrawFn) -> bytes:
    """What may follow a prefix: messages, keys after them, whitespace, and now and then a flaw."""
    ws = draw(_WS)
    more = "".join(f",{draw(_WS)}{draw(_message())}" for _ in range(draw(st.integers(0, 3))))
    after = "".join(f",{ws}{draw(_TAIL_KEY)}{ws}:{ws}{draw(_VALUE)}" for _ in range(draw(st.integers(0, 3))))
    text = (more + ws + "]" + after + ws + "}" + draw(_WS)).encode()
    flaw = draw(st.sampled_from(["none", "none", "none", "cut", "insert"]))
    if flaw == "none":
        return text
    at = draw(st.integers(0, len(text)))
    if flaw == "cut":
        return text[:at]
    flaws = [b"\xff", b"\xed\xa0\x80", b'"', b"}", b"]", b",", b"\\ud800", b"1e400", b"x"]
    junk = draw(st.sampled_from(flaws))
    return text[:at] + junk + text[at:]


_PRIMER = b', {"role": "user", "content": "primer"}]}'


@settings(max_examples=100, deadline=None)
@given(_prefix(), st.lists(_tail(), min_size=1, max_size=8))
def test_a_body_with_a_known_prefix_decodes_as_a_whole_decode(prefix: str, tails: list[bytes]) -> None:
    memo = PrefixMemo(16, 1 << 24)
    start = prefix.encode()
    primer = start + _PRIMER
    for _ in range(3):
        assert _answer(memo.decode, primer) == _answer(decode_object, primer)
    assert memo.learned == 1 and memo.hits == 1  # the prefix is known
    for tail in tails:
        raw = start + tail
        assert _answer(memo.decode, raw) == _answer(decode_object, raw)
        known = memo.decode_known(raw)
        assert known is None or msgspec.json.encode(known) == msgspec.json.encode(decode_object(raw))
        assert _answer(lambda r: parse_request(r, "chat", known=memo.decode_known), raw) == _answer(
            lambda r: parse_request(r, "chat"), raw
        )


def test_tools_after_the_messages_do_not_hide_the_system_prompt() -> None:
    memo = PrefixMemo(16, 1 << 24)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(3)]
    bodies = [_body(f"q{i}", tools=tools) for i in range(5)]  # "}, {" in the tools, after the messages
    for raw in bodies:
        assert _answer(memo.decode, raw) == _answer(decode_object, raw)
    assert memo.learned == 1 and memo.hits == 3 and memo.refused == 0


def test_a_prefix_ending_in_another_array_than_messages_is_refused() -> None:
    memo = PrefixMemo(16, 1 << 24)
    # the last "role" (where the new message is looked for) is in "x", after "messages", which ends
    # with the very string the proof appends: only the other arrays' check tells the two apart
    head = b'{"model": "m", "messages": [{"role": "system", "content": "' + SYSTEM.encode() + b'"}, '
    bodies = [
        head + b'"\\u0000kvlb-prefix-memo"], "x": [{"role": "a"}, {"role": "' + str(i).encode() + b'"}]}'
        for i in range(5)
    ]
    for raw in bodies:
        assert _answer(memo.decode, raw) == _answer(decode_object, raw)
    assert memo.refused == 1 and memo.learned == 0 and memo.hits == 0


def test_sizes_are_a_whole_decodes_once_the_strings_were_read_as_utf8() -> None:
    # ``sys.getsizeof`` of a string counts its UTF-8 form once something asked for it (the tokenizer,
    # an encoder): the memo's strings are read so with each request, a whole decode's are new, but
    # for one Latin-1 character the decoder gives CPython's shared string, read so or not
    memo = PrefixMemo(16, 1 << 24)

    def chat(question: str) -> bytes:
        messages = [
            {"role": "system", "content": SYSTEM + "缓存"},
            {"role": "user", "content": "é"},
            {"role": "assistant", "content": "ü 汉"},
            {"role": "user", "content": question},
        ]
        return json.dumps({"model": "m", "messages": messages}, ensure_ascii=False).encode()

    _learned(memo, chat("q0"))
    for index in range(3):
        raw = chat(f"q{index + 1}")
        msgspec.json.encode(memo.decode(raw))  # every string read as UTF-8, the memo's included
        msgspec.json.encode(["é", "ü"])
        assert parse_request(raw, "chat", known=memo.decode_known) == parse_request(raw, "chat")
    assert memo.hits == 7
