"""OpenAI streaming-response parsing into a request record (pure: times are passed in).

:class:`StreamState` takes the bytes of one ``/v1/chat/completions`` or ``/v1/completions`` stream as
they arrive, with the monotonic time of each chunk, splits them into events with the service's own
SSE parser (:class:`balancer.upstream.sse.SseEvents`) and keeps what a record needs: the time of
every content chunk, the last ``usage`` object, whether ``data: [DONE]`` came, and an error event if
one did. :meth:`StreamState.record` then builds the :class:`~loadtests.stats.RequestRecord`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from balancer.upstream.sse import DONE, SseEvents
from loadtests.stats import Outcome, RequestRecord
from loadtests.workloads.base import RequestSpec

ERROR_TEXT_CHARS = 300
"""Error texts kept in records are cut to this many characters."""


@dataclass(slots=True)
class StreamState:
    """Mutable state of one request while it streams; ``start`` is its send time (monotonic seconds)."""

    start: float
    outcome: Outcome = "error"
    status: int | None = None
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    usage: Mapping[str, Any] | None = None
    replica: str | None = None
    predicted_cached_tokens: int | None = None
    """kvlb's ``x-kvlb-cached-tokens`` header (``None`` from peers)."""
    done: bool = False
    events: SseEvents = field(default_factory=SseEvents)

    def fail(self, outcome: Outcome, error: str) -> None:
        self.outcome = outcome
        self.error = error[:ERROR_TEXT_CHARS]

    def feed(self, chunk: bytes, now: float) -> bool:
        """Take the next bytes of the stream; ``True`` when it is over (``[DONE]`` or an error event).

        Raises ``ValueError`` (``json.JSONDecodeError``) on an event whose data is not JSON, and
        :class:`~balancer.errors.UpstreamError` on an event longer than the parser's bound.
        """
        return any(self._take(data, now) for data in self.events.feed(chunk))

    def end(self, now: float) -> None:
        """At the end of the body: take a last event that came without its blank line."""
        for data in self.events.close():
            self._take(data, now)

    def _take(self, data: bytes, now: float) -> bool:
        if data.strip() == DONE:
            self.done = True
            return True
        self.absorb(json.loads(data), now)
        return self.error is not None

    def absorb(self, event: Any, now: float) -> None:
        """Take one JSON object: a stream chunk, or a whole non-streamed answer."""
        if not isinstance(event, Mapping):
            raise ValueError(f"expected a JSON object, got {type(event).__name__}")
        if event.get("error") is not None:
            self.fail("error", f"server error: {json.dumps(event['error'])}")
            return
        if _has_content(event.get("choices")):
            self.chunk_times.append(now)
        if isinstance(event.get("usage"), Mapping):
            self.usage = event["usage"]

    def settle(self) -> None:
        """At the end of a 200 response: ``ok`` if it finished cleanly, else an ``error``."""
        if self.error is not None:
            return
        if self.done:
            self.outcome = "ok"
        else:
            self.fail("error", "stream ended without data: [DONE]")

    def record(
        self, spec: RequestSpec, *, run_start: float, end: float, scheduled_s: float | None
    ) -> RequestRecord:
        """The record of this request, times relative to ``run_start`` (monotonic seconds)."""
        times = self.chunk_times
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        return RequestRecord(
            request_id=spec.request_id,
            outcome=self.outcome,
            start_s=self.start - run_start,
            session_id=spec.session_id,
            tags=spec.tags,
            scheduled_s=scheduled_s,
            status=self.status,
            error=self.error,
            ttft_s=times[0] - self.start if times else None,
            e2e_s=end - self.start,
            itl_s=tuple(later - earlier for earlier, later in itertools.pairwise(times)),
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_int_or_none(details.get("cached_tokens"))
            if isinstance(details, Mapping)
            else None,
            replica=self.replica,
            predicted_cached_tokens=self.predicted_cached_tokens,
        )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _has_content(choices: Any) -> bool:
    """Whether choices carry generated text: chat ``delta``/``message``, or completions ``text``."""
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, Mapping):
            continue
        if choice.get("text"):
            return True
        for key in ("delta", "message"):
            part = choice.get(key)
            if isinstance(part, Mapping) and (part.get("content") or part.get("reasoning_content")):
                return True
    return False
