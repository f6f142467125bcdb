"""The catch-up's merge rule (pure, ``balancer.sources.zmq_order``): when the publisher's buffer no
longer reaches back to the next wanted seq, the live messages queued below the answer's first seq
are taken first, the first at or above it is held for after the answer."""

from __future__ import annotations

from collections.abc import Iterable

from balancer.sources.zmq_order import Queued, StreamOrder, queued_live, reads_queued_live


def merge(expected: int, answer_first: int, queued: Iterable[int]) -> tuple[list[int], int | None]:
    """The rule applied as the replays apply it: the queued seqs taken before the answer, and the
    one held for after it (``None``: none)."""
    before: list[int] = []
    if not reads_queued_live(expected, answer_first):
        return before, None
    for seq in queued:
        if queued_live(seq, answer_first) is Queued.AFTER:
            return before, seq
        before.append(seq)
    return before, None


def test_an_answer_from_the_wanted_seq_reads_nothing_queued_first() -> None:
    assert not reads_queued_live(0, 0)
    assert not reads_queued_live(5, 5)
    assert not reads_queued_live(5, 3)  # the answer reaches back further still
    assert merge(5, 5, [7, 8]) == ([], None)


def test_an_answer_above_the_wanted_seq_reads_the_queued_live_first() -> None:
    assert reads_queued_live(0, 1)
    assert reads_queued_live(5, 9)


def test_a_queued_message_below_the_answers_first_seq_goes_before_it() -> None:
    assert queued_live(8, 9) is Queued.BEFORE
    assert queued_live(0, 9) is Queued.BEFORE


def test_the_first_at_or_above_the_answers_first_seq_is_held() -> None:
    assert queued_live(9, 9) is Queued.AFTER
    assert queued_live(10, 9) is Queued.AFTER


def test_the_older_live_messages_first_then_the_first_newer_held() -> None:
    # the buffer starts at 10, the stream wants 4: live 6..9 are older, 10 waits for the answer,
    # what follows it stays queued
    assert merge(4, 10, [6, 7, 8, 9, 10, 11]) == ([6, 7, 8, 9], 10)
    assert merge(4, 10, [12, 13]) == ([], 12)
    assert merge(4, 10, [5, 6]) == ([5, 6], None)  # all older, none held
    assert merge(4, 10, []) == ([], None)


def test_the_rule_reads_the_orders_next_wanted_seq() -> None:
    order = StreamOrder(want=3)
    assert reads_queued_live(order.expected(), 7)
    assert not reads_queued_live(order.expected(), 3)
    order.accept(3, 111)
    assert not reads_queued_live(order.expected(), 4)  # now the answer starts where it is wanted
    assert reads_queued_live(order.expected(), 5)
