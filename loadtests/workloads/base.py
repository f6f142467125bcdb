"""What a workload yields, and the arrival-time helpers (pure).

A workload is a frozen dataclass of sizes with a ``generate(rng)`` method that yields
:class:`RequestSpec` s. All randomness comes from the ``random.Random`` passed in, so one seed gives
one request stream, byte for byte. Specs carry either OpenAI chat ``messages`` (sent to
``/v1/chat/completions``) or ``prompt_token_ids`` (sent to ``/v1/completions`` with the id list as
``prompt``). ``arrival_s`` is the offset from the start of an open-loop run; workloads without a
time base leave it ``None`` and a run gives them one with :func:`with_arrivals` and
:func:`poisson_arrivals`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Protocol

PromptFormat = Literal["chat", "tokens"]
"""``chat``: OpenAI chat messages of word text. ``tokens``: the same chat as toy token ids."""

PROMPT_FORMATS: tuple[PromptFormat, ...] = ("chat", "tokens")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One OpenAI chat message with plain-text content."""

    role: str
    content: str

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload, before it is sent. Exactly one of ``messages`` and ``prompt_token_ids``."""

    request_id: str
    """Unique within the workload's stream (``<workload>-<n>``)."""

    max_tokens: int
    """Completion length asked for, in tokens (at least 1)."""

    messages: tuple[ChatMessage, ...] | None = None
    """Chat messages; the request goes to ``/v1/chat/completions``."""

    prompt_token_ids: tuple[int, ...] | None = None
    """Prompt as token ids; the request goes to ``/v1/completions`` with ``prompt`` = this list."""

    arrival_s: float | None = None
    """Send time as an offset from the run's start, in seconds (open loop); ``None``: no time base."""

    session_id: str | None = None
    """Requests of one session are sent in order, one at a time, by the closed-loop driver."""

    tags: tuple[tuple[str, str], ...] = ()
    """Labels for reports (tenant, document ids, turn...), as ordered (name, value) pairs."""

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError(f"{self.request_id}: give exactly one of messages and prompt_token_ids")
        if self.max_tokens < 1:
            raise ValueError(f"{self.request_id}: max_tokens must be at least 1, got {self.max_tokens}")
        if self.arrival_s is not None and self.arrival_s < 0:
            raise ValueError(f"{self.request_id}: arrival_s must be >= 0, got {self.arrival_s}")

    @property
    def path(self) -> str:
        """The OpenAI endpoint path this request goes to."""
        return CHAT_PATH if self.messages is not None else COMPLETIONS_PATH

    def tag(self, name: str) -> str | None:
        """The value of tag ``name``, or ``None``."""
        return dict(self.tags).get(name)

    def body(self, model: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The streaming JSON body (``stream_options.include_usage`` on); ``extra`` fields are merged last."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens}
        if self.messages is not None:
            body["messages"] = [message.to_json() for message in self.messages]
        else:
            body["prompt"] = list(self.prompt_token_ids or ())
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if extra:
            body.update(extra)
        return body


class Workload(Protocol):
    """A deterministic stream of requests: the same ``rng`` state gives the same specs."""

    name: ClassVar[str]

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]: ...


def make_tags(**values: object) -> tuple[tuple[str, str], ...]:
    """Tags from keyword arguments, values as strings, in the order given."""
    return tuple((name, str(value)) for name, value in values.items())


def check_positive(owner: str, **sizes: float) -> None:
    """Raise ``ValueError`` naming the first size that is not > 0."""
    for name, value in sizes.items():
        if not value > 0:
            raise ValueError(f"{owner}: {name} must be > 0, got {value}")


def check_format(owner: str, prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"{owner}: prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")


def poisson_arrivals(rate_per_s: float, rng: random.Random, start_s: float = 0.0) -> Iterator[float]:
    """Endless arrival offsets of a Poisson process of ``rate_per_s`` (exponential gaps), from ``start_s``."""
    check_positive("poisson_arrivals", rate_per_s=rate_per_s)
    now_s = start_s
    while True:
        now_s += rng.expovariate(rate_per_s)
        yield now_s


def uniform_arrivals(rate_per_s: float, start_s: float = 0.0) -> Iterator[float]:
    """Endless evenly spaced arrival offsets, ``1 / rate_per_s`` apart (a fixed schedule)."""
    check_positive("uniform_arrivals", rate_per_s=rate_per_s)
    n = 0
    while True:
        yield start_s + n / rate_per_s
        n += 1


def with_arrivals(specs: Iterable[RequestSpec], arrivals: Iterable[float]) -> Iterator[RequestSpec]:
    """``specs`` with ``arrival_s`` taken from ``arrivals`` in order; stops when either runs out."""
    for spec, arrival_s in zip(specs, arrivals, strict=False):
        yield replace(spec, arrival_s=arrival_s)


def scale_arrivals(specs: Iterable[RequestSpec], time_scale: float) -> Iterator[RequestSpec]:
    """``specs`` with every ``arrival_s`` multiplied by ``time_scale`` (< 1 compresses the schedule)."""
    check_positive("scale_arrivals", time_scale=time_scale)
    for spec in specs:
        if spec.arrival_s is None:
            yield spec
        else:
            yield replace(spec, arrival_s=spec.arrival_s * time_scale)
