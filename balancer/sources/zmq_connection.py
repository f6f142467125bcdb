"""The SUB's connection to its publisher (does I/O): the socket, its monitor, what is wrong with it.

:class:`~balancer.sources.zmq_sub.ZmqEventSource` reads its publisher's stream on a SUB that this
module opens (:func:`open_sub`) with a monitor that exists before the connect, so that no
connection, and so no catch-up, is missed. :class:`SubConnection` keeps what the monitor said of
the current connection and says what is wrong with the events endpoint:

* A connection counts once its ZMQ handshake with a PUB succeeded (``EVENT_HANDSHAKE_SUCCEEDED``;
  :attr:`SourceStatus.connected`), and the source's catch-up waits for it.
* A peer that takes the TCP connection but drops it before the handshake is no PUB (the replay
  ROUTER given as ``events``, the two swapped): said (:data:`HANDSHAKE_REFUSED`), and retried after
  the reconnect backoff (:class:`HandshakeRefused`). A refused connect (nothing listens) is said
  too (:data:`CONNECT_REFUSED`); both become the source's ``last_error`` (``/admin/replicas``) and
  a warning, the first at once, then once a minute.

What a dropped connection means for the stream (the rank's blocks dropped, a catch-up at the next
connection) is the source's; the exceptions here tell its run loop how to open the next SUB.
"""

from __future__ import annotations

import time
from typing import NoReturn

import zmq
import zmq.asyncio
from zmq.utils.monitor import _MonitorMessage, parse_monitor_message

from balancer.sources.replay_watch import ReplayWatch
from balancer.sources.zmq_parts import ZmqSourceParts
from balancer.sources.zmq_settings import ZmqSourceSettings


class ReopenSub(Exception):
    """The SUB lost its publisher: open a fresh socket (libzmq does not reconnect a connection it
    dropped for a protocol error, such as a message over ``ZMQ_MAXMSGSIZE``)."""


class DropBacklog(ReopenSub):
    """A flood: close the SUB, so libzmq drops what it still holds, and open a fresh one."""


class HandshakeRefused(Exception):
    """The peer took the TCP connection but not the ZMQ handshake (it is no PUB): open a fresh
    SUB after the reconnect backoff (libzmq does not retry after that protocol error)."""


HANDSHAKE_REFUSED = (
    "{endpoint} accepted the TCP connection but refused the ZMQ handshake: it is not a PUB socket "
    "(is it the replay endpoint, or the two swapped? the events endpoint is the engine's PUB, the "
    "replay endpoint its ROUTER), or not ZMQ at all"
)
"""The ``last_error`` of a source whose events endpoint answers, but not as a publisher."""
CONNECT_REFUSED = (
    "nothing accepts connections at {endpoint} (retrying): check that the engine publishes KV "
    "events (SGLang --kv-events-config / vLLM --kv-events-config with publisher zmq) on this "
    "host and port, and that the port is this replica's events (+ its DP rank)"
)
"""The ``last_error`` of a source whose events endpoint refuses connections (or an engine down)."""


def open_sub(
    ctx: zmq.asyncio.Context, endpoint: str, topic: bytes, settings: ZmqSourceSettings
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A SUB connected to ``endpoint`` and its monitor; the monitor exists before the connect, so
    that no connection (and its catch-up) is missed."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, settings.rcvhwm)
    sub.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
    sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(settings.publisher_reconnect_max_s * 1000)))
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    )
    sub.connect(endpoint)
    return sub, monitor


async def next_monitor_event(monitor: zmq.asyncio.Socket, watch: ReplayWatch) -> _MonitorMessage | None:
    """The next connection event of the SUB: first those a replay read while it waited (they are
    older than the rest, :attr:`ReplayWatch.stash`), then the monitor's; ``None`` when none is
    queued."""
    if watch.stash:
        return watch.stash.popleft()
    try:
        return parse_monitor_message(await monitor.recv_multipart(zmq.NOBLOCK))
    except zmq.Again:
        return None


class SubConnection:
    """What the monitor said of the current SUB's connection, and the events endpoint's problems
    (they go to the source's counters, warnings and logger)."""

    def __init__(self, parts: ZmqSourceParts, endpoint: str) -> None:
        """``parts``: the source's; ``endpoint``: the publisher's events endpoint."""
        self.replica = parts.replica
        self.dp_rank = parts.dp_rank
        self.endpoint = endpoint
        self._counters = parts.counters
        self._warnings = parts.warnings
        self._log = parts.log
        self.handshaken = False
        """The SUB's connection completed its ZMQ handshake with a PUB (``EVENT_HANDSHAKE_SUCCEEDED``):
        the connection this source counts as connected (``SourceStatus.connected``)."""

    def connect_refused(self) -> None:
        """``EVENT_CONNECT_RETRIED``: nothing listens at the events endpoint (ZMQ retries by itself)."""
        self._problem("zmq_connect_refused", CONNECT_REFUSED)

    def _problem(self, cause: str, template: str) -> None:
        """A problem with the events endpoint itself: ``template`` (naming the endpoint) becomes the
        source's ``last_error`` and a warning under ``cause`` (once, then once a minute). A refused
        connect (``zmq_connect_refused``, ZMQ retries by itself) means nothing listens there: a wrong
        port, an engine without KV events, or one down or still starting."""
        text = template.format(endpoint=self.endpoint)
        self._counters.note_error(text, time.time())
        subject = f"{self.replica}/{self.dp_rank}"
        self._warnings.warning(cause, subject, "replica %s rank %d: %s", self.replica, self.dp_rank, text)

    def refused_handshake(self) -> NoReturn:
        """The TCP connection dropped before a ZMQ handshake with a PUB: the peer is another
        socket type (a ROUTER: the replay endpoint; a SUB) or no ZMQ; nothing was received, so
        there is no stream state to drop. The SUB is reopened after the backoff."""
        self._counters.transport_errors += 1
        self._problem("zmq_handshake_refused", HANDSHAKE_REFUSED)
        raise HandshakeRefused

    def problems_over(self) -> None:
        """A handshake succeeded: the next refusal warns at once again."""
        subject = f"{self.replica}/{self.dp_rank}"
        for cause in ("zmq_connect_refused", "zmq_handshake_refused"):
            self._warnings.resolved(cause, subject)
        if self._counters.last_error in (
            CONNECT_REFUSED.format(endpoint=self.endpoint),
            HANDSHAKE_REFUSED.format(endpoint=self.endpoint),
        ):
            self._log.info(
                "replica %s rank %d: connected to the publisher at %s",
                self.replica,
                self.dp_rank,
                self.endpoint,
            )
