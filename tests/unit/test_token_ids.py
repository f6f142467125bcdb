"""Token-id prompts decoded through the memo of runs (:mod:`balancer.tokenizer.token_ids`): the same
answer as the typed decoder for any body, ids sent again found instead of decoded, bounded; a gRPC
prompt's packed ids through the same memo: always the field's ids and their JSON text."""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec
from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer._proto.kvlb.v1 import balancer_pb2 as pb
from balancer.api.errors import ApiError
from balancer.api.parsing import (
    ParsedRequest,
    _memoised_completion,
    decode_object,
    parse_body,
    parse_request,
    typed_completion,
)
from balancer.counter_collectors import TokenIdMemoCollector
from balancer.tokenizer.token_ids import (
    GUESS_IDS,
    PROMPT_STANDIN,
    TokenIdMemo,
    decode_token_ids,
    known_prompt,
    packed_token_ids,
    worth_a_lookup,
)


def answer(raw: bytes, memo: TokenIdMemo | None) -> Any:
    """What ``parse_request`` makes of ``raw``: the request with its ids as a list, or the error."""
    try:
        parsed = parse_request(raw, "completions", memo)
    except ApiError as exc:
        return (exc.status, exc.message)
    if parsed.prompt is not None and not isinstance(parsed.prompt, str):
        assert parsed.packed is not None or not parsed.ids_checked
        return (parsed.model, parsed.stream, parsed.max_tokens, parsed.session_key, list(parsed.prompt))
    return parsed


ids = st.integers(0, 2**32 - 1) | st.integers(0, 300)
odd_elements = (
    st.integers(-3, -1)
    | st.integers(2**32, 2**70)
    | st.booleans()
    | st.none()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=3)
    | st.lists(st.integers(0, 9), max_size=2)
)
separators = st.sampled_from([",", ", ", " ,", ",\n", "\t,  "])


@st.composite
def prompt_texts(draw: st.DrawFn, shared: list[int]) -> str:
    """A JSON array as clients write it: often ``shared``'s ids first (so runs repeat), maybe one
    element of another kind anywhere, any separator and space inside the brackets."""
    values: list[Any] = shared[: draw(st.integers(0, len(shared)))] + draw(st.lists(ids, max_size=12))
    if draw(st.booleans()) and values:
        values.insert(draw(st.integers(0, len(values))), draw(odd_elements))
    sep = draw(separators)
    inside = sep.join(json.dumps(v) for v in values)
    return "[" + draw(st.sampled_from(["", " ", "\n"])) + inside + draw(st.sampled_from(["", " "])) + "]"


SHARED = [7, 123456, 0, 4294967295, 42, 99999, 1, 128000, 5, 31]


@settings(max_examples=examples(400), deadline=None)
@given(
    texts=st.lists(prompt_texts(SHARED), min_size=1, max_size=4),
    run_bytes=st.integers(1, 24),
    max_runs=st.integers(0, 6),
    extra=st.sampled_from(
        [
            '"stream": true',
            '"max_tokens": 3',
            '"user": "u"',
            '"x": [1.5, "a"]',
            f'"meta": {{"prompt": {SHARED}}}',
        ]
    ),
    extra_first=st.booleans(),
)
def test_the_memo_answers_as_the_typed_decoder(
    texts: list[str], run_bytes: int, max_runs: int, extra: str, extra_first: bool
) -> None:
    """Whatever the prompt (ids out of range, bools, floats, strings, nested arrays, odd spacing)
    and whatever the memo holds from the prompts before it: the same acceptance, ids and message as
    without the memo, and the packed array holds the ids. Another ``"prompt"`` key before the real
    one (``meta``) misleads :func:`worth_a_lookup`'s guess, never the answer."""
    memo = TokenIdMemo(max_runs, run_bytes=run_bytes)
    for text in texts + texts:  # each prompt twice more: its runs are then found
        fields = [extra, '"model": "m"', f'"prompt": {text}']
        raw = ("{" + ", ".join(fields if extra_first else fields[::-1]) + "}").encode()
        expected = answer(raw, None)
        assert answer(raw, memo) == expected, text
        if isinstance(expected, tuple) and isinstance(expected[-1], list):
            parsed = parse_request(raw, "completions", memo)
            # ids out of range pass parsing on the stdlib path; tokenize refuses them later
            assert parsed.ids_checked == all(0 <= i < 2**32 for i in expected[-1])
            if parsed.ids_checked:
                assert parsed.packed is not None and parsed.packed.typecode == "I"
                assert parsed.packed.tolist() == expected[-1]
        assert len(memo) <= max_runs


def test_runs_sent_again_are_found_not_decoded() -> None:
    memo = TokenIdMemo(64, run_bytes=16)
    prefix = list(range(1000, 1100))
    first = json.dumps([*prefix, 1, 2, 3]).encode()
    decoded = decode_token_ids(first, memo)
    assert decoded is not None and decoded.tolist() == [*prefix, 1, 2, 3]
    assert memo.hits == 0 and len(memo) == 0  # seen once: noted, not kept
    assert decode_token_ids(first, memo) is not None and len(memo) > 0 and memo.hits == 0
    misses = memo.misses
    again = decode_token_ids(first, memo)
    assert again is not None and again.tolist() == [*prefix, 1, 2, 3]
    assert memo.misses == misses and memo.hits > 0  # every run found
    hits = memo.hits
    other = decode_token_ids(json.dumps([*prefix, 9, 8]).encode(), memo)
    assert other is not None and other.tolist() == [*prefix, 9, 8]
    assert memo.hits > hits and memo.misses > misses  # the shared prefix found, the new tail decoded


def test_a_found_run_does_not_let_a_bad_element_through() -> None:
    memo = TokenIdMemo(64, run_bytes=4)
    good = b"[11, 22, 33, 44, 55]"
    for _ in range(3):
        assert decode_token_ids(good, memo) is not None
    bad_texts = (
        b"[11, 22, 33, 44, 55, -1]",
        b"[11, 22, 33, 44, 55, 1.5]",
        b"[11, 22, 33, 44, 55, true]",
        b'[11, 22, 33, 44, 55, "a"]',
        b"[11, 22, 33, 44, 55, [1]]",
        b"[11, 22, 33, 44, 55, 4294967296]",
        b"[[11, 22, 33, 44, 55]]",
        b"[]",
        b"[ ]",
        b'"11, 22"',
    )
    for bad in bad_texts:
        assert decode_token_ids(bad, memo) is None, bad
        raw = b'{"model": "m", "prompt": ' + bad + b"}"
        assert answer(raw, memo) == answer(raw, None)


def test_the_memo_is_bounded_and_counts_evictions() -> None:
    memo = TokenIdMemo(5, run_bytes=64)  # 3 or 4 runs a prompt
    for n in range(50):
        text = json.dumps(list(range(n * 100, n * 100 + 40))).encode()
        for _ in range(2):
            assert decode_token_ids(text, memo) is not None
        assert len(memo) <= 5
        assert len(memo._seen) <= 5 and len(memo._seen_before) <= 5
    assert memo.evictions > 0 and memo.hits == 0  # every prompt new: kept at its second sight
    kept = json.dumps(list(range(4900, 4940))).encode()  # the last one
    assert decode_token_ids(kept, memo) is not None and memo.hits > 0
    assert decode_token_ids(b"[1, 2]", TokenIdMemo(0)) is not None  # off: decoded every time
    for bad in (-1, 0):
        try:
            TokenIdMemo(bad if bad < 0 else 1, run_bytes=bad if bad == 0 else 1)
        except ValueError:
            continue
        raise AssertionError("accepted a bad size")


def test_only_a_first_run_seen_before_is_worth_a_lookup() -> None:
    memo = TokenIdMemo(64, run_bytes=16)
    raw = json.dumps({"model": "m", "prompt": list(range(5000, 5040))}).encode()
    assert not worth_a_lookup(raw, memo)  # new: the typed decoder answers; noted
    assert worth_a_lookup(raw, memo)  # seen once: decoded through the memo
    assert not worth_a_lookup(json.dumps({"model": "m", "prompt": [1, 2]}).encode(), memo)  # one short run
    assert not worth_a_lookup(b'{"model": "m", "prompt": "text, text, text, text"}', memo)
    assert not worth_a_lookup(raw, TokenIdMemo(0))


def test_the_typed_path_with_a_memo_keeps_text_prompts() -> None:
    memo = TokenIdMemo(8)
    parse = functools.partial(parse_request, kind="completions", memo=memo)
    parsed = parse(b'{"model": "m", "prompt": "hello", "user": "u"}')
    assert isinstance(parsed, ParsedRequest) and parsed.prompt == "hello" and parsed.text_chars == 5
    assert parsed.session_key == "u" and not parsed.ids_checked


# ------------------------------------------------------------------ gRPC prompts: packed varints


class CountedIds(list[int]):
    """A repeated field stand-in that counts the ids it hands out by slicing."""

    read = 0

    def __getitem__(self, index: Any) -> Any:
        value = super().__getitem__(index)
        if isinstance(index, slice):
            self.read += len(value)
        return value


def field_of(values: list[int]) -> bytes:
    return pb.TokenIds(ids=values).SerializeToString()


def read_plainly(values: list[int]) -> tuple[list[int], bytes]:
    return values, msgspec.json.encode(values)


wire_ids = st.integers(0, 2**32 - 1) | st.integers(0, 127) | st.integers(0, 20_000)


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 40), st.lists(wire_ids, max_size=40)), min_size=1, max_size=5),
    shared=st.lists(wire_ids, min_size=1, max_size=40),
    run_bytes=st.integers(1, 24),
    max_runs=st.integers(0, 6),
    rounds=st.integers(1, 4),
)
def test_packed_ids_through_the_memo_are_the_ids(
    prompts: list[tuple[int, list[int]]], shared: list[int], run_bytes: int, max_runs: int, rounds: int
) -> None:
    """Prompts sharing prefixes, sent again and again through small memos (hits, misses, runs
    remembered mid-prompt, evictions): always the field's ids, packed, and their JSON text."""
    memo = TokenIdMemo(max_runs, run_bytes=run_bytes)
    for _ in range(rounds):
        for keep, tail in prompts:
            values = shared[:keep] + tail or [0]
            packed, text = packed_token_ids(values, functools.partial(field_of, values), memo)
            assert (packed.tolist(), text) == read_plainly(values)
            assert packed.typecode == "I"


def test_a_packed_prompt_sent_again_makes_no_int() -> None:
    """The first sight notes the leading ids; the second reads the ids and notes the runs; the third
    remembers them; the fourth finds every run and reads only the leading ids."""
    values = [(i * 7919) % 129_000 for i in range(3_000)]
    memo = TokenIdMemo(64)
    for _ in range(4):
        ids = CountedIds(values)
        packed, text = packed_token_ids(ids, functools.partial(field_of, values), memo)
        assert (packed.tolist(), text) == read_plainly(values)
    assert ids.read == GUESS_IDS
    runs = len(memo)
    assert runs >= 8 and memo.hits == runs


def test_a_prompt_new_to_the_memo_is_read_as_without_one() -> None:
    values = list(range(1_000, 5_000))
    memo = TokenIdMemo(64)
    ids = CountedIds(values)
    serialized: list[int] = []
    packed, text = packed_token_ids(ids, lambda: serialized.append(1) or field_of(values), memo)
    assert (packed.tolist(), text) == read_plainly(values)
    assert serialized == [] and ids.read == GUESS_IDS + len(values) and len(memo) == 0


def test_a_field_with_unknown_fields_after_it_is_read_whole() -> None:
    """A ``TokenIds`` carrying an unknown field (a newer client's) serializes it after the ids: those
    bytes are no ids, so nothing is looked up."""
    values = list(range(300, 900))
    message = pb.TokenIds.FromString(field_of(values) + b"\x10\x05")
    assert message.SerializeToString() != field_of(values)
    memo = TokenIdMemo(64, run_bytes=8)
    for _ in range(4):
        packed, text = packed_token_ids(message.ids, message.SerializeToString, memo)
        assert (packed.tolist(), text) == read_plainly(values)
    assert memo.hits == 0 and len(memo) == 0


def test_packed_runs_never_meet_json_runs() -> None:
    """The text ``12`` is also the varints 49, 50: a run of either kind is digested apart, so neither
    face finds the other's run (``run_bytes=4``: the JSON's last run and the varints' run are both
    these two bytes)."""
    memo = TokenIdMemo(64, run_bytes=4)
    values = list(b"12")
    first, both = b'{"model": "m", "prompt": [1,2,3,7]}', b'{"model": "m", "prompt": [1,2,3,12]}'
    for _ in range(3):  # the run "1,2,3" is remembered
        assert answer(first, memo) == answer(first, None)
    for _ in range(4):  # the varints' run is remembered, then found
        packed, ids_text = packed_token_ids(values, functools.partial(field_of, values), memo)
        assert (packed.tolist(), ids_text) == read_plainly(values)
    hits = memo.hits
    assert answer(both, memo) == answer(both, None)
    assert memo.hits == hits + 1  # "1,2,3" found, "12" not


# ------------------------------------------------------------------ whole prompts sent again


def old_path_answer(raw: bytes, memo: TokenIdMemo) -> Any:
    """:func:`answer` as before whole prompts were noted: the guess, then every run looked up (or the
    typed decoder), never :func:`known_prompt`'s shortcut."""
    try:
        parsed = None
        if raw.isascii():
            if worth_a_lookup(raw, memo):
                parsed = _memoised_completion(raw, memo)
            else:
                parsed = typed_completion(raw, None)
        if parsed is None:
            parsed = parse_body(decode_object(raw), "completions")
    except ApiError as exc:
        return (exc.status, exc.message)
    if parsed.prompt is not None and not isinstance(parsed.prompt, str):
        return (parsed.model, parsed.stream, parsed.max_tokens, parsed.session_key, list(parsed.prompt))
    return parsed


def memo_state(memo: TokenIdMemo) -> tuple[Any, ...]:
    """What the memo's metrics and later answers depend on: its counters and its runs, in LRU order."""
    return (memo.hits, memo.misses, memo.evictions, list(memo._runs.items()), memo._seen, memo._seen_before)


LONG = [(i * 7919 + 13) % 129_000 for i in range(60)]
"""Ids of a prompt several runs long at the tests' small ``run_bytes``."""


def standin_text() -> str:
    return PROMPT_STANDIN.decode()


@st.composite
def known_bodies(draw: st.DrawFn) -> bytes:
    """A body around one of a few prompts (often the same one, so it is noted whole and found), its
    other fields drawn each time: some of them hold the prompt's text, the stand-in, a ``"prompt"``
    key or a bad value where the shortcut must not be fooled; sometimes one id is changed."""
    base = draw(st.sampled_from([LONG, LONG[:40], [*LONG[:30], *SHARED]]))
    values = list(base)
    if draw(st.integers(0, 4)) == 0:  # one id changed, in any run
        at = draw(st.integers(0, len(values) - 1))
        values[at] = draw(st.sampled_from([values[at] + 1, values[at] * 10 % 129_000, 0, 4294967295]))
    sep = draw(st.sampled_from([", ", ","]))
    text = "[" + sep.join(map(str, values)) + "]"
    if draw(st.integers(0, 9)) == 0:  # not a prompt of ids after all
        text = draw(
            st.sampled_from([text[:-1] + ", -1]", text[:-1] + ", 1.5]", "[" + text + "]", json.dumps(text)])
        )
    before = draw(
        st.lists(
            st.sampled_from(
                [
                    '"user": "u"',
                    '"stream": true',
                    '"stream": 1',
                    '"max_tokens": 7',
                    '"max_tokens": -1',
                    '"model": "other"',
                    '"model": 5',
                    f'"note": {json.dumps(text)}',
                    f'"x": {standin_text()}',
                    f'"x": {json.dumps(standin_text())}',
                    f'"meta": {{"prompt": {text}}}',
                    f'"prompt": {text}',
                    '"prompt": "a string first"',
                    '"u": "\\u00e9"',
                    '"v": "\u00e9"',
                ]
            ),
            max_size=3,
        )
    )
    after = draw(
        st.lists(
            st.sampled_from(['"temperature": 0.5', f'"x": {standin_text()}', '"prompt": [1, 2]']), max_size=2
        )
    )
    model = draw(st.sampled_from(['"model": "m"', '"model": "m"', '"model": ""']))
    fields = [model, *before, f'"prompt"{draw(st.sampled_from([": ", ":", " : "]))}{text}', *after]
    tail = draw(st.sampled_from(["}", "}", " }", "}}", "}\n"]))
    return ("{" + ", ".join(fields) + tail).encode()


@settings(max_examples=examples(300), deadline=None)
@given(
    bodies=st.lists(known_bodies(), min_size=1, max_size=6),
    rounds=st.integers(3, 6),
    run_bytes=st.integers(1, 40),
    max_runs=st.integers(0, 40),
)
def test_a_known_prompt_answers_as_its_runs(
    bodies: list[bytes], rounds: int, run_bytes: int, max_runs: int
) -> None:
    """Bodies sent again and again (so their prompts are noted whole and found by the shortcut),
    their other fields holding the prompt's text, the stand-in, other ``"prompt"`` keys, bad values
    or invalid JSON, some with an id changed: the same answer as without a memo, and the memo's
    counters and runs as the run-by-run path leaves them."""
    memo = TokenIdMemo(max_runs, run_bytes=run_bytes)
    reference = TokenIdMemo(max_runs, run_bytes=run_bytes)
    for _ in range(rounds):
        for raw in bodies:
            expected = answer(raw, None)
            assert answer(raw, memo) == expected, raw
            assert old_path_answer(raw, reference) == expected, raw
            assert memo_state(memo) == memo_state(reference)
            assert memo._prompt_refs == sum(map(len, memo._prompts.values())) <= max_runs
            assert set(memo._heads) == {runs[0] for runs in memo._prompts.values()}
            assert sum(memo._heads.values()) == len(memo._prompts)


def test_a_changed_id_in_a_prompt_sent_again_is_read() -> None:
    """A prompt noted whole, then the same body with one id changed (same length of text, in the
    first, a middle and the last run) or one id more or fewer: the new ids, never the noted ones."""
    memo = TokenIdMemo(256, run_bytes=32)
    values = [100_000 + i for i in range(200)]

    def body(ids: list[int]) -> bytes:
        return json.dumps({"model": "m", "stream": True, "prompt": ids}).encode()

    for _ in range(4):
        assert answer(body(values), memo) == answer(body(values), None)
    assert memo._prompts  # noted whole: the fourth sight took the shortcut
    hits = memo.hits
    assert answer(body(values), memo)[-1] == values
    assert memo.hits > hits and known_prompt(body(values), memo) is not None
    for at in (0, 1, 100, 198, 199):
        changed = list(values)
        changed[at] += 1  # same digits: the same length of text
        assert known_prompt(body(changed), memo) is None
        assert answer(body(changed), memo)[-1] == changed
    for other in (values[:-1], [*values, 5], [7, *values[1:]]):
        assert answer(body(other), memo)[-1] == other
    assert answer(body(values), memo)[-1] == values


def test_a_known_prompt_is_only_taken_as_the_prompt() -> None:
    """The prompt's text in the wrong place (a string, another field before the real prompt, a field
    holding the stand-in) is not taken for the prompt; the real prompt is read."""
    memo = TokenIdMemo(256, run_bytes=32)
    values = [200_000 + i for i in range(120)]
    text = json.dumps(values)
    plain = json.dumps({"model": "m", "prompt": values}).encode()
    for _ in range(4):
        answer(plain, memo)
    assert known_prompt(plain, memo) is not None
    tricky = [
        f'{{"model": "m", "prompt": {json.dumps(text)}}}',  # the text as a string
        f'{{"model": "m", "meta": {{"prompt": {text}}}, "prompt": [1, 2, 3]}}',
        f'{{"model": "m", "prompt": {text}, "prompt": [4, 5]}}',
        f'{{"model": "m", "prompt": {text}, "prompt": {standin_text()}}}',  # the stand-in as the later key
        f'{{"model": "m", "prompt": {standin_text()}, "prompt": {text}}}',
        f'{{"model": "m", "prompt": {text}, "x": {standin_text()}}}',
        f'{{"model": "m", "x": {standin_text()}, "prompt": {text}}}',
        f'{{"model": "m", "prompt": {text}}}}}',
        f'{{"model": "m", "prompt": {text}, "user": 5}}',
        f'{{"prompt": {text}}}',
        f'{{"model": "m", "prompt": [{text}]}}',
    ]
    for raw in tricky:
        assert answer(raw.encode(), memo) == answer(raw.encode(), None), raw
    # not ASCII: a raw CESU-8 surrogate in a field routing does not read is refused, as without a memo
    for extra in (b'"x": "\xed\xa0\x80"', '"x": "\u00e9t\u00e9"'.encode()):
        raw = b'{"model": "m", ' + extra + b', "prompt": ' + text.encode() + b"}"
        assert answer(raw, memo) == answer(raw, None), raw
        assert answer(raw, memo) == answer(raw, None), raw
    assert answer(plain, memo) == answer(plain, None)


def test_the_standin_has_no_border() -> None:
    """Two occurrences of the stand-in cannot overlap, so counting them finds each."""
    assert not any(PROMPT_STANDIN[:n] == PROMPT_STANDIN[-n:] for n in range(1, len(PROMPT_STANDIN)))
    assert msgspec.json.decode(PROMPT_STANDIN) == [PROMPT_STANDIN.decode()[2:-2]]


def test_whole_prompts_are_bounded_by_the_runs() -> None:
    memo = TokenIdMemo(12, run_bytes=16)
    for n in range(30):
        raw = json.dumps({"model": "m", "prompt": list(range(n * 1000, n * 1000 + 12))}).encode()
        for _ in range(4):
            assert answer(raw, memo)[-1] == list(range(n * 1000, n * 1000 + 12))
        assert memo._prompt_refs == sum(map(len, memo._prompts.values())) <= 12
        assert set(memo._heads) == {runs[0] for runs in memo._prompts.values()}
        assert sum(memo._heads.values()) == len(memo._prompts)
    assert memo._prompts and memo.prompt_evictions > 0


def test_the_collector_exports_the_whole_prompt_evictions() -> None:
    """``kvlb_tokenizer_token_id_memo_prompt_evictions_total`` reads the memo's count at scrape time."""
    memo = TokenIdMemo(12, run_bytes=16)
    for n in range(30):
        raw = json.dumps({"model": "m", "prompt": list(range(n * 1000, n * 1000 + 12))}).encode()
        for _ in range(4):
            answer(raw, memo)
    collector = TokenIdMemoCollector()
    collector.source = lambda: memo
    samples = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert memo.prompt_evictions > 0
    assert samples["kvlb_tokenizer_token_id_memo_prompt_evictions_total"] == memo.prompt_evictions
    assert samples["kvlb_tokenizer_token_id_memo_evictions_total"] == memo.evictions
