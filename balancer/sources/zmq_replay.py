"""The replay client of a ZMQ source (does I/O): one request to the engine's replay ROUTER, its answer.

:class:`~balancer.sources.zmq_sub.ZmqEventSource`'s replays
(:class:`~balancer.sources.zmq_replay_merge.ReplayMerge`) ask the publisher's replay socket for the
batches it still holds from a seq (at a new connection, for a gap, when the live stream is silent).
This module is the exchange itself, over a DEALER kept between requests: the request
``[b"", seq8]``, the replies ``[b"", seq8, payload]`` (SGLang) or ``[b"", topic, seq8, payload]``
(vLLM ≥ 0.32) read frame by frame up to ``MAX_MESSAGE_FRAMES``, until the end marker (seq ``-1``),
bounded by ``replay_timeout_s`` and ``replay_max_batches``, ended early when the engine goes away
(:mod:`balancer.sources.replay_watch`). What a reply means for the stream (its seq, duplicates,
gaps) is the caller's: each reply goes to its ``on_reply``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from balancer.errors import EventDecodeError
from balancer.sources.read_ahead import MAX_MESSAGE_FRAMES
from balancer.sources.replay_watch import EngineGone

if TYPE_CHECKING:  # the parts import this module (zmq_messages reads SEQ_BYTES here)
    from balancer.sources.zmq_parts import ZmqSourceParts

SEQ_BYTES = 8
REPLAY_END = (-1).to_bytes(SEQ_BYTES, "big", signed=True)

REPLAY_SILENT = (
    "the replay endpoint {endpoint} did not answer within {timeout_s:g} s (nothing listens there, "
    "or it is not the engine's replay ROUTER): lost batches resync the rank instead"
)
"""The ``last_error`` of a source whose replay request went unanswered."""


async def recv_reply(dealer: zmq.asyncio.Socket, first: zmq.Frame) -> list[bytes]:
    """One replay reply from its ``first`` frame (awaited by the caller, which may give up on it:
    ZMQ delivers a message's frames together, so the rest are there once the first is), read frame
    by frame up to ``MAX_MESSAGE_FRAMES`` (a reply has 3 or 4); raises ``EventDecodeError("frame")``
    for a longer one, whose other frames are left unread (the replay then ends unclean, and its
    DEALER is closed with them)."""
    frames: list[zmq.Frame] = [first]
    while frames[-1].more:
        if len(frames) == MAX_MESSAGE_FRAMES:
            raise EventDecodeError("frame", f"replay reply of more than {MAX_MESSAGE_FRAMES} frames")
        frames.append(await dealer.recv(copy=False))
    return [frame.bytes for frame in frames]


def is_replay_end(frames: Sequence[bytes]) -> bool:
    """The end of a replay: ``[b"", seq -1, b""]`` (SGLang) or ``[b"", b"", seq -1, b""]`` (vLLM)."""
    return len(frames) in (3, 4) and frames[0] == b"" and frames[-2] == REPLAY_END and frames[-1] == b""


class ReplayClient:
    """The replay requests of one source (one replica, one DP rank); lives on the ingest loop.

    Its problems are the source's: they go to the source's counters, warnings and log (so they read
    as the source's, under its logger), a reply of too many frames to its message reader."""

    def __init__(self, parts: ZmqSourceParts, endpoint: str, *, ctx: zmq.asyncio.Context) -> None:
        """``parts``: the source's; ``endpoint``: the publisher's replay socket."""
        self.replica = parts.replica
        self.dp_rank = parts.dp_rank
        self.endpoint = endpoint
        self._ctx = ctx
        self._settings = parts.settings
        self._watch = parts.watch
        self._counters = parts.counters
        self._warnings = parts.warnings
        self._log = parts.log
        self._decode_failed = parts.messages.decode_failed
        self._dealer: zmq.asyncio.Socket | None = None
        """The replay DEALER, kept between requests (:meth:`_replay_dealer`)."""

    async def request(
        self, start_seq: int, on_reply: Callable[[list[bytes]], Awaitable[None]]
    ) -> tuple[bool, bool]:
        """Ask for every batch from ``start_seq``; each reply before the end marker goes to
        ``on_reply`` (within the time budget). Returns whether the answer was complete (its end
        marker arrived) and whether it was abandoned because the engine went away
        (:class:`EngineGone`). A timeout, a reply of too many frames or a socket error end it
        unclean (said here); only ``ETERM`` is raised."""
        dealer = self._replay_dealer()
        complete = False
        abandoned = False
        subject = f"{self.replica}/{self.dp_rank}"
        try:
            async with asyncio.timeout(self._settings.replay_timeout_s):
                # A DEALER with no peer yet holds the send: keep it inside the time budget.
                request = [b"", start_seq.to_bytes(SEQ_BYTES, "big")]
                await self._watch.until_gone(dealer.send_multipart(request))
                for _ in range(self._settings.replay_max_batches):
                    first = await self._watch.until_gone(dealer.recv(copy=False))
                    frames = await recv_reply(dealer, first)
                    if is_replay_end(frames):
                        complete = True
                        self._warnings.resolved("replay_timeout", subject)
                        break
                    await on_reply(frames)
        except EngineGone as gone:
            abandoned = True
            self._log.info(
                "replica %s rank %d: replay from %d abandoned: the engine went away (%s)",
                self.replica,
                self.dp_rank,
                start_seq,
                gone.why,
            )
        except TimeoutError:
            timeout_s = self._settings.replay_timeout_s
            text = REPLAY_SILENT.format(endpoint=self.endpoint, timeout_s=timeout_s)
            self._counters.note_error(text, time.time())
            self._warnings.warning(
                "replay_timeout",
                subject,
                "replica %s rank %d: replay from %d: %s",
                self.replica,
                self.dp_rank,
                start_seq,
                text,
            )
        except EventDecodeError as exc:  # a reply of too many frames: the DEALER goes with its rest
            self._decode_failed(exc)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise
            self._warnings.warning(
                "replay_failed",
                subject,
                "replica %s rank %d: replay failed: %s",
                self.replica,
                self.dp_rank,
                exc,
            )
        finally:
            if not complete:  # an answer may still be on its way: it must not be read as the next one
                self.close()
        return complete, abandoned

    def _replay_dealer(self) -> zmq.asyncio.Socket:
        """The DEALER of this source's replay requests, kept between them: a poll costs one request
        and its answer, not a TCP connection and a ZMTP handshake on both sides (about half the
        event loop's CPU per poll and a third of the process's, ``loadtests/bench/replay_poll.py``).
        Closed after any exchange that did not end with the end marker (its answer may still come),
        and with the SUB (a lost connection, an error, shutdown)."""
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self._settings.max_message_bytes)
            dealer.setsockopt(
                zmq.RECONNECT_IVL_MAX, max(1, int(self._settings.publisher_reconnect_max_s * 1000))
            )
            dealer.connect(self.endpoint)
            self._dealer = dealer
        return self._dealer

    def close(self) -> None:
        """Close the DEALER (a fresh one serves the next request)."""
        dealer, self._dealer = self._dealer, None
        if dealer is not None:
            dealer.close(linger=0)
