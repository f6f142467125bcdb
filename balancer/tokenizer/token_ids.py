"""Token-id prompts decoded from their JSON text or protobuf field, in memoised runs (pure, bounded).

A ``/v1/completions`` prompt of token ids costs most of its decoding in the int objects: for 8,174
ids, ``msgspec`` spends about 40 µs checking the JSON and 150 µs making the ints, packing them as
``array('I')`` 45 µs more, and freeing them later 40 µs. Clients resend the same ids (a shared system
prompt, earlier turns, a retried request), and the same ids come as the same text from the same
client, so :func:`decode_token_ids` cuts the array's text into runs of about :data:`RUN_TEXT_BYTES`
(at the first comma past each multiple of it from the start, so a shared prefix cuts alike) and
looks each run up in a :class:`TokenIdMemo` by an XXH3-128 of its text; only from the first run not
found on is the text decoded (in one call), and the runs seen before are remembered. A prompt of
runs all found costs about 70 µs instead of about 245 µs, and no int is made or freed. Whether a
body goes this way at all is guessed first (:func:`worth_a_lookup`), so that a prompt whose first
run is new costs what it did.

A prompt whose runs were all found is noted whole, as the list of its runs' lookup pairs under a
digest of its whole text. The same prompt sent again (:func:`known_prompt`) is then found by one
digest: its text needs neither the runs' lookups nor ``msgspec``'s check (the caller checks the rest
of the body with the prompt's text replaced by :data:`PROMPT_STANDIN`, then takes its ids with
:func:`take_known`); 8k ids then cost about 20 µs instead of about 140 (in process).

What is accepted stays exactly what the typed decoder accepts: the caller has checked the whole
body as strict JSON (``msgspec``, ASCII); a run is remembered only after its text decoded as
integers in ``[0, 2**32)`` (so it holds digits, commas and whitespace only), and every run of a
prompt is either such a text or decoded as integers itself, so any other element (a float, a
``bool``, a string, a nested array, a negative id) lies in a run that is decoded, and refused. Like
:class:`~balancer.index.hashing.KeyMemo`, a hit trusts the 128-bit digest (and the text's length);
a collision could only change the routing keys of the request, whose own bytes go to the engine (a
whole prompt found trusts it for the text's JSON too: a colliding text that is not JSON would reach
the engine, which refuses it).

A gRPC prompt's ids come as a repeated ``uint32`` field, already checked by protobuf, and kvlb writes
the JSON body itself: :func:`packed_token_ids` keeps runs of the field's packed varints in the same
memo (their digests seeded apart), each with its packed ids and their JSON text, so a prompt sent
before makes no int (8k ids: ``openai_call`` takes about half the CPU) and one never seen costs a
digest of its first ids more (about 10 µs). Here a collision would change the ids the replica gets
too; the 128-bit digest and the run's length are trusted as they are for routing keys.
"""

from __future__ import annotations

import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

import msgspec
import xxhash

_xxh3_128 = xxhash.xxh3_128_intdigest
_IDS_DECODER = msgspec.json.Decoder(list[int])
_IDS_ENCODER = msgspec.json.Encoder()

RUN_TEXT_BYTES = 2048
"""Bytes of JSON text per memoised run (about 340 ids of 5 digits and a separator): a run is cut at
the first comma at least this far past the run's start. Smaller runs share more of a prefix that
ends mid-run but cost a lookup each (about 0.5 µs)."""
WIRE_SEED = 1
"""The XXH3 seed of packed runs' digests, so they never meet those of JSON runs (the same bytes can
be both: the text ``12,5`` is also the varints 49, 50, 44, 53)."""
GUESS_IDS = 64
"""Leading ids whose digest tells whether a gRPC prompt was seen before (:func:`packed_token_ids`)."""
GUESS_SEED = 2
"""The XXH3 seed of those leading ids' digests (noted beside the runs' lookup pairs)."""
_VARINT_END = re.compile(rb"[\x00-\x7f]")
_CONTINUATION = bytes(range(0x80, 0x100))


class TokenIdMemo:
    """The packed ids (``array('I')`` bytes) of recently decoded runs of a prompt's JSON text.

    Looked up by (XXH3-128 of the run's text, its length in bytes). At most ``max_runs`` runs, least
    recently used out first (``evictions`` counts them); a run holds at most ``run_bytes / 2 + 1``
    ids (an id and its comma take two bytes at least), so at most ``4 * max_runs *
    (run_bytes / 2 + 1)`` bytes of ids plus about 200 bytes a run (about 1.5 kB a run of
    5-digit ids). ``max_runs = 0`` turns it off: the whole array is decoded every time. Runs of a
    gRPC prompt's packed varints (:func:`packed_token_ids`) share the bound; each also holds its
    ids' JSON text: about 3.8 kB a run of 3-byte varints, at most about 8.2 kB.

    Whole prompts whose runs were all found (:func:`known_prompt`) are noted as their runs' lookup
    pairs, no ids of their own: at most ``max_runs`` pairs listed in all, least recently used out
    first (``prompt_evictions``). Each run listed holds its own lookup pair (about 140 bytes), each
    prompt about 550 more (tracemalloc: 4.5 kB for a prompt of 8,150 ids, 29 runs): at most about
    2.8 MB at the default.
    """

    __slots__ = (
        "_heads",
        "_prompt_refs",
        "_prompts",
        "_runs",
        "_seen",
        "_seen_before",
        "evictions",
        "hits",
        "max_runs",
        "misses",
        "prompt_evictions",
        "run_bytes",
    )

    def __init__(self, max_runs: int = 4096, run_bytes: int = RUN_TEXT_BYTES) -> None:
        if max_runs < 0:
            raise ValueError(f"max_runs must be >= 0, got {max_runs}")
        if run_bytes <= 0:
            raise ValueError(f"run_bytes must be > 0, got {run_bytes}")
        self.max_runs = max_runs
        self.run_bytes = run_bytes
        """Bytes of text per run (:data:`RUN_TEXT_BYTES`; tests use a few)."""
        # an OrderedDict: ``move_to_end`` and ``popitem(last=False)`` keep the LRU order in O(1)
        self._runs: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        # Runs seen once are only noted (their lookup pair, no ids): a run is kept from its second
        # sight, so prompts never sent again cost a digest each run, not a copy and an eviction.
        # Two generations of at most ``max_runs`` pairs each; the older is dropped when the newer fills.
        self._seen: set[tuple[int, int]] = set()
        self._seen_before: set[tuple[int, int]] = set()
        # Whole prompts: (digest of the array's text, its length) -> its runs' lookup pairs, in order
        self._prompts: OrderedDict[tuple[int, int], tuple[tuple[int, int], ...]] = OrderedDict()
        self._heads: dict[tuple[int, int], int] = {}
        """The first runs' lookup pairs of the prompts in ``_prompts`` -> how many start with each."""
        self._prompt_refs = 0
        """Runs listed by ``_prompts`` in all (at most ``max_runs``)."""
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.prompt_evictions = 0
        """Whole prompts dropped to keep ``_prompts`` within its bound (not exported)."""

    def __len__(self) -> int:
        return len(self._runs)

    def _seen_again(self, ident: tuple[int, int]) -> bool:
        """Whether ``ident`` was noted before; notes it."""
        if ident in self._seen or ident in self._seen_before:
            return True
        self._seen.add(ident)
        if len(self._seen) >= self.max_runs:
            self._seen_before, self._seen = self._seen, set()
        return False

    def _note_prompt(self, ident: tuple[int, int], runs: tuple[tuple[int, int], ...]) -> None:
        """Note a prompt whose runs were all found, under ``ident`` (its text's lookup pair)."""
        prompts = self._prompts
        if len(runs) > self.max_runs or ident in prompts:
            return
        prompts[ident] = runs
        heads = self._heads
        heads[runs[0]] = heads.get(runs[0], 0) + 1
        self._prompt_refs += len(runs)
        while self._prompt_refs > self.max_runs:
            _, dropped = prompts.popitem(last=False)
            self._prompt_refs -= len(dropped)
            self.prompt_evictions += 1
            if heads[dropped[0]] == 1:
                del heads[dropped[0]]
            else:
                heads[dropped[0]] -= 1

    def _remember(self, ident: tuple[int, int], packed: bytes) -> None:
        runs = self._runs
        runs[ident] = packed
        runs.move_to_end(ident)
        if len(runs) > self.max_runs:
            runs.popitem(last=False)
            self.evictions += 1


PROMPT_KEY = b'"prompt"'
"""How a body's prompt key is found for :func:`worth_a_lookup` (a guess: decoding decides)."""


def worth_a_lookup(raw: bytes, memo: TokenIdMemo) -> bool:
    """Whether the body ``raw`` likely holds a token-id prompt whose first run ``memo`` holds or has
    seen once (then noted: the next sight is a lookup). A guess from the text after the first
    ``"prompt"`` (a few byte searches and one digest, about 1 µs): when it is wrong the body is only
    decoded the other way, to the same answer. A prompt new to the memo is decoded by the typed
    decoder in one pass; checking the body first and decoding the ids after would cost it about
    100 µs more (8k ids)."""
    if memo.max_runs == 0:
        return False
    run = _first_run(raw, memo.run_bytes)
    if run is None:
        return False
    bracket, cut = run
    ident = (_xxh3_128(memoryview(raw)[bracket + 1 : cut]), cut - bracket - 1)
    return ident in memo._runs or memo._seen_again(ident)


def _first_run(raw: bytes, run_bytes: int) -> tuple[int, int] | None:
    """Where the guessed prompt of the body ``raw`` starts and its first run ends: ``(bracket,
    cut)``, the ``[`` after the first ``"prompt"`` (within 32 bytes of it) and the first ``,`` at
    least ``run_bytes`` after it; ``None`` when either is missing. A few byte searches."""
    key = raw.find(PROMPT_KEY)
    if key < 0:
        return None
    bracket = raw.find(b"[", key + len(PROMPT_KEY), key + len(PROMPT_KEY) + 32)
    if bracket < 0:
        return None
    cut = raw.find(b",", bracket + 1 + run_bytes)
    return None if cut < 0 else (bracket, cut)


PROMPT_STANDIN = b'["kvlb: a known prompt"]'
"""What :func:`known_prompt`'s caller puts in place of a known prompt's text to check the rest of the
body: a JSON value with no border (no proper prefix of it is also a suffix), so two occurrences
cannot overlap, and one found where the prompt was and nowhere else is the only one."""


def known_prompt(raw: bytes, memo: TokenIdMemo) -> tuple[int, int, tuple[int, int]] | None:
    """Where a prompt noted whole in ``memo`` (its runs all found before) lies in the body ``raw``:
    ``(start, end, ident)``, its text ``raw[start:end]`` from its ``[`` to its ``]`` and the
    text's lookup pair for :func:`take_known`; ``None`` when there is none. Changes nothing in
    ``memo``.

    The text is guessed as :func:`worth_a_lookup` guesses it (after the first ``"prompt"``), and ends
    at the first ``]`` after it: a noted text is an array of ids, which holds no other ``]``. One
    digest of the text (about 1.5 µs for 8k ids), and only when a noted prompt starts with its first
    run (else the cost is one run's digest). That it *is*
    the body's prompt is for the caller to check: the body with :data:`PROMPT_STANDIN` in place of
    ``raw[start:end]`` must decode with the stand-in, found there only, as its prompt."""
    if memo.max_runs == 0 or not memo._prompts:
        return None
    run = _first_run(raw, memo.run_bytes)
    if run is None:
        return None
    start, cut = run
    view = memoryview(raw)
    if (_xxh3_128(view[start + 1 : cut]), cut - start - 1) not in memo._heads:
        return None
    end = raw.find(b"]", cut) + 1
    if end == 0:
        return None
    ident = (_xxh3_128(view[start:end]), end - start)
    return (start, end, ident) if ident in memo._prompts else None


def take_known(ident: tuple[int, int], memo: TokenIdMemo) -> array[int] | None:
    """The ids of the prompt :func:`known_prompt` found under ``ident``, its runs counted as hits
    and moved to the newest end as :func:`decode_token_ids` would move them (the runs end as they
    would after decoding it); ``None``, and no change, when one of its runs was evicted since."""
    runs = memo._prompts.get(ident)
    if runs is None:
        return None
    found = list(map(memo._runs.get, runs))
    if None in found:
        return None
    move = memo._runs.move_to_end
    for run in runs:
        move(run)
    memo.hits += len(runs)
    memo._prompts.move_to_end(ident)
    ids = array("I")
    ids.frombytes(b"".join(cast("list[bytes]", found)))
    return ids


def decode_token_ids(span: bytes, memo: TokenIdMemo) -> array[int] | None:
    """The ids of ``span``, the raw JSON of a prompt, as ``array('I')``; ``None`` unless ``span`` is
    a non-empty array of integers in ``[0, 2**32)``. ``span`` must already be known to be valid JSON
    (it comes from a ``msgspec.Raw`` field of a checked body)."""
    if span[:1] != b"[":
        return None
    end = len(span) - 1  # the closing bracket: a Raw value carries no whitespace around it
    if memo.max_runs == 0:
        ids = _decoded(span)
        return ids if ids else None
    view = memoryview(span)
    runs = memo._runs
    run_bytes = memo.run_bytes
    found: list[bytes] = []
    idents: list[tuple[int, int]] = []
    start = 1
    while start < end:
        cut = span.find(b",", start + run_bytes, end)
        if cut < 0:
            cut = end
        ident = (_xxh3_128(view[start:cut]), cut - start)
        packed = runs.get(ident)
        if packed is None:
            rest = _decode_rest(span, start, end, memo)
            if rest is None or not found:
                return rest if rest else None
            found.append(rest.tobytes())
            idents.clear()
            break
        memo.hits += 1
        runs.move_to_end(ident)  # the order is the LRU order
        found.append(packed)
        idents.append(ident)
        start = cut + 1
    if idents:  # every run found: the next sight of this very text is one digest (known_prompt)
        memo._note_prompt((_xxh3_128(span), len(span)), tuple(idents))
    ids = array("I")
    ids.frombytes(b"".join(found))
    return ids if ids else None


def _decoded(text: bytes) -> array[int] | None:
    """``text``, a JSON array, as ``array('I')``, or ``None`` if an element is not such an id."""
    try:
        return array("I", _IDS_DECODER.decode(text))
    except (msgspec.DecodeError, OverflowError):  # a ValidationError is a DecodeError
        return None


def _decode_rest(span: bytes, start: int, end: int, memo: TokenIdMemo) -> array[int] | None:
    """The ids of ``span[start:end]`` (whole elements), decoded in one call, its runs seen before
    remembered; ``None`` if an element is not an id in range."""
    ids = _decoded(span if start == 1 else b"[" + span[start:])
    if ids is None:
        return None
    view = memoryview(span)
    offset = 0  # ids before ``counted``, the text's position they are counted up to
    counted = start
    while start < end:
        cut = span.find(b",", start + memo.run_bytes, end)
        if cut < 0:
            cut = end
        memo.misses += 1
        ident = (_xxh3_128(view[start:cut]), cut - start)
        if memo._seen_again(ident):
            offset += span.count(b",", counted, start)
            count = span.count(b",", start, cut) + 1
            memo._remember(ident, ids[offset : offset + count].tobytes())
            offset += count
            counted = cut + 1
        start = cut + 1
    return ids


def packed_token_ids(
    ids: Sequence[int], serialized: Callable[[], bytes], memo: TokenIdMemo | None
) -> tuple[array[int], bytes]:
    """``ids``, a non-empty repeated ``uint32`` field of a protobuf message, as ``array('I')`` and as
    the JSON text of their array (the bytes ``msgspec`` writes of them as a list), read through
    ``memo``. ``serialized`` gives the message that holds the field alone, serialized: its tag byte,
    its length and the packed varints (protobuf writes them packed, whatever form the client sent).

    A prompt whose :data:`GUESS_IDS` leading ids ``memo`` has not seen before (then noted, as
    :func:`worth_a_lookup` notes a first run) is read whole: a slice of ``ids``, where the ints are
    made (about 10 µs more than without a memo). Otherwise the varints are cut into runs of about
    ``memo.run_bytes / 2`` bytes (after the first varint ending at least that far past the run's
    start, so a shared prefix cuts alike: 1 kB at the default, about 340 ids of 3 bytes, whose
    packed ids and JSON text take about 3.8 kB; at most 1,025 ids of 1 byte, about 8.2 kB) and each
    run is looked up by an XXH3-128 of its bytes (seeded, :data:`WIRE_SEED`) and its length; a run
    found gives its packed ids and their JSON text, so no int is made. From the first run not found
    on, ``ids`` is read once and the runs seen before are remembered. A serialized message that is
    not that one packed field (unknown fields after it) reads ``ids`` whole, and so does no
    ``memo`` or ``memo.max_runs == 0``. A hit trusts the digest, as :func:`decode_token_ids` does;
    a count of ids found unlike ``len(ids)`` reads ``ids`` whole."""
    if memo is None or memo.max_runs == 0 or not _seen_head(ids, memo):
        return _read_from(ids, 0, b"", 0, None)
    field = serialized()
    start = packed_start(field)
    if start is None:
        return _read_from(ids, 0, b"", 0, None)
    end = len(field)
    view = memoryview(field)
    runs = memo._runs
    run_bytes = max(1, memo.run_bytes // 2)
    packs: list[bytes | memoryview] = []
    texts: list[bytes | memoryview] = []
    index = 0  # ids before ``start``
    while start < end:
        cut = _run_end(field, start, end, run_bytes)
        ident = (_xxh3_128(view[start:cut], WIRE_SEED), cut - start)
        found = runs.get(ident)
        if found is None:
            rest, rest_text = _read_from(ids, index, field, start, memo)
            if not packs:
                return rest, rest_text
            packs.append(rest.tobytes())
            texts.append(memoryview(rest_text)[1:-1])
            break
        memo.hits += 1
        runs.move_to_end(ident)  # the order is the LRU order
        count = int.from_bytes(found[:4], "little")
        run = memoryview(found)
        packs.append(run[4 : 4 + 4 * count])
        texts.append(run[4 + 4 * count :])
        index += count
        start = cut
    packed = array("I")
    packed.frombytes(b"".join(packs))
    if len(packed) != len(ids):
        return _read_from(ids, 0, b"", 0, None)
    return packed, b"[" + b",".join(texts) + b"]"


def _seen_head(ids: Sequence[int], memo: TokenIdMemo) -> bool:
    """Whether ``memo`` noted the prompt's leading ids before; notes them."""
    head = array("I", ids[:GUESS_IDS]).tobytes()
    return memo._seen_again((_xxh3_128(head, GUESS_SEED), len(head)))


def packed_start(field: bytes) -> int | None:
    """Where the packed varints of ``field``, a serialized message, start if it holds one packed field
    1 and nothing else (its tag byte, its length, the varints to the end); else ``None``."""
    if field[:1] != b"\x0a":
        return None
    header = _VARINT_END.search(field, 1, 6)
    if header is None:
        return None
    start = header.end()
    length = 0
    for shift, byte in enumerate(field[1:start]):
        length |= (byte & 0x7F) << (7 * shift)
    return start if length == len(field) - start else None


def _run_end(field: bytes, start: int, end: int, run_bytes: int) -> int:
    """Where the run of varints from ``start`` ends: after the first varint ending at least
    ``run_bytes`` past ``start``, or at ``end``."""
    last = _VARINT_END.search(field, start + run_bytes - 1, end)
    return end if last is None else last.end()


def _read_from(
    ids: Sequence[int], index: int, field: bytes, start: int, memo: TokenIdMemo | None
) -> tuple[array[int], bytes]:
    """``ids[index:]`` packed and as JSON, read in one slice; the runs of ``field`` from ``start``
    (where those ids begin) are counted as misses and those seen before remembered (as a 4-byte
    count, the packed ids, their JSON text)."""
    rest = ids[index:]  # a list from a protobuf field
    packed = array("I", rest)
    text = _IDS_ENCODER.encode(rest)
    if memo is None:
        return packed, text
    view = memoryview(field)
    end = len(field)
    run_bytes = max(1, memo.run_bytes // 2)
    offset = 0  # ids of ``rest`` before ``start``
    while start < end:
        cut = _run_end(field, start, end, run_bytes)
        count = len(field[start:cut].translate(None, _CONTINUATION))
        memo.misses += 1
        ident = (_xxh3_128(view[start:cut], WIRE_SEED), cut - start)
        if memo._seen_again(ident):
            run_text = _IDS_ENCODER.encode(rest[offset : offset + count])[1:-1]
            run = packed[offset : offset + count].tobytes()
            memo._remember(ident, b"".join((count.to_bytes(4, "little"), run, run_text)))
        offset += count
        start = cut
    return packed, text
