"""The order of a ZMQ publisher's stream (:mod:`balancer.sources.zmq_order`): pure, each transition
and a property over interleavings of live and replayed copies. The sockets around it are tested in
``tests/integration/test_sources_zmq*.py``."""

from __future__ import annotations

from collections.abc import Sequence

from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.sources.zmq_order import (
    MAX_REPLAYED_DIGESTS,
    Action,
    Duplicate,
    FloodLost,
    Gap,
    Live,
    Restarted,
    Resynced,
    ShedRunStarted,
    StreamOrder,
)

OVERFLOW = (ShedRunStarted(), Resynced("overflow"))


def take(order: StreamOrder, seq: int, *, shed: bool = False) -> tuple[Action, ...]:
    """A live message that must be the next batch (its digest its seq; ``shed``: none): its
    actions, then the batch's."""
    digest = None if shed else seq
    actions, verdict = order.live(seq, digest, None, may_replay=True)
    assert verdict is Live.TAKE
    return actions + order.accept(seq, digest)


def test_batches_in_order_are_taken_with_no_action() -> None:
    order = StreamOrder()
    assert order.expected() == 0
    for seq in range(3):
        assert take(order, seq) == ()
    assert order.expected() == 3 and order.last_seq == 2 and order.live_last == 2


def test_the_resume_point_is_wanted_first_and_an_engine_behind_it_restarted() -> None:
    order = StreamOrder(want=5)
    assert order.expected() == 5
    actions, verdict = order.live(3, 3, None, may_replay=True)
    assert actions == (Resynced("restart"),) and verdict is Live.TAKE  # no state yet: no Restarted
    assert order.accept(3, 3) == () and order.expected() == 4


def test_a_gap_asks_a_replay_from_the_next_wanted_seq_and_the_replay_may_deliver_the_message() -> None:
    order = StreamOrder()
    take(order, 0)
    actions, verdict = order.live(3, 3, None, may_replay=True)
    assert actions == (Gap(),) and verdict is Live.REPLAY and order.expected() == 1
    for seq in (1, 2, 3):
        assert order.replayed(seq, seq)
        assert order.accept(seq, seq) == ()
    assert order.delivered(3)
    actions, verdict = order.live(4, 4, None, may_replay=True)
    assert (actions, verdict) == ((), Live.TAKE)


def test_what_a_replay_cannot_fill_resyncs_as_a_gap_when_the_batch_is_taken() -> None:
    order = StreamOrder()
    take(order, 0)
    assert order.live(3, 3, None, may_replay=False) == ((Gap(),), Live.TAKE)
    assert order.accept(3, 3) == (Resynced("gap"),)
    assert order.expected() == 4


def test_a_live_copy_of_a_replayed_batch_is_a_duplicate() -> None:
    order = StreamOrder()
    take(order, 0)
    assert order.replayed(1, 1) and order.accept(1, 1) == ()
    assert not order.replayed(1, 1)  # an old replayed batch is not taken again
    assert order.live(1, 1, None, may_replay=True) == ((Duplicate(),), Live.DUPLICATE)


def test_a_live_seq_that_goes_back_is_a_restarted_publisher_taken_as_a_fresh_start() -> None:
    order = StreamOrder()
    take(order, 0)
    take(order, 1)
    actions, verdict = order.live(1, 99, None, may_replay=True)
    assert actions == (Restarted("restart after seq 1"), Resynced("restart"))
    assert verdict is Live.REPLAY and order.expected() == 0  # replay the new process from 0, no gap counted
    order.replayed(0, 0)
    assert order.accept(0, 0) == () and order.delivered(0) and not order.delivered(1)


def test_a_new_epoch_is_a_restart() -> None:
    order = StreamOrder()
    order.live(0, 0, "a", may_replay=True)
    order.accept(0, 0)
    actions, verdict = order.live(1, 1, "b", may_replay=True)
    assert actions == (Restarted("epoch after seq 0"), Resynced("epoch"))
    assert verdict is Live.REPLAY and order.epoch == "b"


def test_the_first_live_copy_of_a_caught_up_seq_tells_a_duplicate_from_a_restarted_publisher() -> None:
    same = StreamOrder()
    assert same.catch_up_started() == 0
    for seq in (0, 1):
        assert same.replayed(seq, 10 + seq)
        same.accept(seq, 10 + seq)
    same.catch_up_ended()
    assert same.live(1, 11, None, may_replay=True) == ((Duplicate(),), Live.DUPLICATE)

    other = StreamOrder()
    other.catch_up_started()
    for seq in (0, 1):
        other.replayed(seq, 10 + seq)
        other.accept(seq, 10 + seq)
    other.catch_up_ended()
    actions, _ = other.live(1, 99, None, may_replay=True)
    assert actions[:2] == (Restarted("restart after seq 1"), Resynced("restart"))


def test_a_live_seq_below_the_catch_up_start_is_a_restart() -> None:
    order = StreamOrder()
    for seq in range(6):
        take(order, seq)
    disconnected_lost, _ = order.disconnected()
    assert disconnected_lost == (5, 5, None)
    for seq in range(4):
        take(order, seq)  # a new connection's live stream
    assert order.catch_up_started() == 4
    order.catch_up_ended()
    actions, _ = order.live(2, 2, None, may_replay=True)
    assert actions[:2] == (Restarted("restart after seq 3"), Resynced("restart"))


def test_a_run_of_shed_messages_resyncs_once_and_a_decoded_batch_ends_the_run() -> None:
    order = StreamOrder()
    take(order, 0)
    assert order.live(1, None, None, may_replay=True) == ((), Live.TAKE)
    assert order.accept(1, None) == OVERFLOW
    assert take(order, 2, shed=True) == ()  # the same run
    assert order.last_digest is None
    assert take(order, 3) == ()
    assert order.accept(4, None) == OVERFLOW  # a new run
    assert order.shed_run() == ()  # already resynced


def test_a_shed_live_copy_of_a_caught_up_seq_cannot_tell_a_duplicate_and_resyncs() -> None:
    order = StreamOrder()
    order.catch_up_started()
    order.replayed(0, 10)
    order.accept(0, 10)
    order.catch_up_ended()
    assert order.live(0, None, None, may_replay=True) == ((Duplicate(), *OVERFLOW), Live.DUPLICATE)


def test_the_next_live_seq_after_a_dropped_flood_counts_what_went_and_is_taken_without_a_gap() -> None:
    order = StreamOrder()
    take(order, 0)
    assert order.accept(1, None) == OVERFLOW  # the flood's first message, shed in order
    assert order.drop_backlog() == () and order.backlog_dropped
    actions, verdict = order.live(7, 7, None, may_replay=True)
    assert actions == (FloodLost(5),) and verdict is Live.TAKE and not order.backlog_dropped
    assert order.accept(7, 7) == ()


def test_a_flood_dropped_before_its_run_resynced_resyncs_once() -> None:
    order = StreamOrder()
    take(order, 0)
    assert order.drop_backlog() == OVERFLOW
    assert order.drop_backlog() == ()


def test_a_lost_connection_drops_the_stream_and_the_next_batch_is_a_fresh_start_from_zero() -> None:
    order = StreamOrder(want=4)
    assert order.disconnected() == (None, ())  # nothing yet: nothing to drop
    take(order, 4)
    lost, actions = order.disconnected()
    assert lost == (4, 4, None) and actions == (Resynced("disconnect"),)
    assert order.expected() == 0 and order.last_seq is None and order.live_last is None
    assert take(order, 0) == ()  # no restart: the live stream starts again


def caught_up(count: int) -> StreamOrder:
    """A stream whose catch-up replayed seqs ``0..count - 1`` (digest = seq)."""
    order = StreamOrder()
    order.catch_up_started()
    for seq in range(count):
        assert order.replayed(seq, seq)
        order.accept(seq, seq)
    order.catch_up_ended()
    return order


def test_a_catch_up_keeps_its_newest_digests_only() -> None:
    count = MAX_REPLAYED_DIGESTS + 2
    # seq 0's digest was dropped: another payload there can no longer show a restart
    assert caught_up(count).live(0, 99, None, may_replay=True) == ((Duplicate(),), Live.DUPLICATE)
    actions, _ = caught_up(count).live(2, 99, None, may_replay=True)  # kept
    assert actions[0] == Restarted(f"restart after seq {count - 1}")


# Steps of the property below: the publisher publishes its next batch (its live copy queued, or
# lost), the SUB hands over its oldest queued live message, or a poll replays the buffer.
PUBLISH, PUBLISH_LOST, DELIVER, POLL = range(4)


class Shell:
    """A minimal shell: a publisher whose replay buffer holds everything, a FIFO of live copies."""

    def __init__(self) -> None:
        self.order = StreamOrder()
        self.published = 0
        self.queued: list[int] = []
        self.taken: list[int] = []
        self.actions: list[Action] = []

    def apply(self, actions: Sequence[Action]) -> None:
        self.actions.extend(actions)

    def replay(self, start: int) -> None:
        for seq in range(start, self.published):
            if self.order.replayed(seq, seq):
                self.apply(self.order.accept(seq, seq))
                self.taken.append(seq)

    def deliver(self) -> None:
        seq = self.queued.pop(0)
        actions, verdict = self.order.live(seq, seq, None, may_replay=True)
        self.apply(actions)
        if verdict is Live.DUPLICATE:
            return
        if verdict is Live.REPLAY:
            self.replay(self.order.expected())
            if self.order.delivered(seq):
                return
        self.apply(self.order.accept(seq, seq))
        self.taken.append(seq)


@settings(max_examples=examples(1000), deadline=None)
@given(st.lists(st.sampled_from([PUBLISH, PUBLISH_LOST, DELIVER, POLL]), max_size=60), st.booleans())
def test_any_interleaving_of_live_and_replayed_copies_takes_each_batch_once_in_order(
    steps: list[int], catch_up: bool
) -> None:
    shell = Shell()
    if catch_up:
        shell.replay(shell.order.catch_up_started())
        shell.order.catch_up_ended()
    for step in steps:
        if step in (PUBLISH, PUBLISH_LOST):
            if step == PUBLISH:
                shell.queued.append(shell.published)
            shell.published += 1
        elif step == DELIVER and shell.queued:
            shell.deliver()
        elif step == POLL:
            shell.replay(shell.order.expected())
    while shell.queued:
        shell.deliver()
    shell.replay(shell.order.expected())  # a last poll finds what was lost live at the end
    assert shell.taken == list(range(shell.published))
    assert all(isinstance(action, Duplicate | Gap) for action in shell.actions)  # never a resync
    live_seen = sum(1 for step in steps if step == PUBLISH)
    assert sum(isinstance(action, Duplicate) for action in shell.actions) <= live_seen
