"""Deterministic load-test workloads and their registry by name (pure).

``make_workload("tenants", tenants=16).generate(random.Random(seed))`` yields the request stream.
Each workload module documents its sharing pattern and sizes; :mod:`.base` defines what they yield.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from loadtests.workloads.agent import AgentWorkload
from loadtests.workloads.base import (
    ChatMessage,
    PromptFormat,
    RequestSpec,
    Workload,
    poisson_arrivals,
    scale_arrivals,
    uniform_arrivals,
    with_arrivals,
)
from loadtests.workloads.chat import ChatWorkload
from loadtests.workloads.mooncake import MooncakeWorkload, TraceRow, read_trace, replay
from loadtests.workloads.rag import RagWorkload
from loadtests.workloads.tenants import TenantsWorkload
from loadtests.workloads.unique import UniqueWorkload

WORKLOADS: Mapping[str, Callable[..., Workload]] = MappingProxyType(
    {
        TenantsWorkload.name: TenantsWorkload,
        ChatWorkload.name: ChatWorkload,
        RagWorkload.name: RagWorkload,
        AgentWorkload.name: AgentWorkload,
        UniqueWorkload.name: UniqueWorkload,
        MooncakeWorkload.name: MooncakeWorkload,
    }
)
"""Workload classes by name; call one with its size fields as keyword arguments."""


def make_workload(name: str, **params: Any) -> Workload:
    """The workload ``name`` with ``params`` as its fields; ``ValueError`` for an unknown name or field."""
    factory = WORKLOADS.get(name)
    if factory is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    try:
        return factory(**params)
    except TypeError as exc:  # an unknown or missing field
        raise ValueError(f"workload {name!r}: {exc}") from exc


__all__ = [
    "WORKLOADS",
    "AgentWorkload",
    "ChatMessage",
    "ChatWorkload",
    "MooncakeWorkload",
    "PromptFormat",
    "RagWorkload",
    "RequestSpec",
    "TenantsWorkload",
    "TraceRow",
    "UniqueWorkload",
    "Workload",
    "make_workload",
    "poisson_arrivals",
    "read_trace",
    "replay",
    "scale_arrivals",
    "uniform_arrivals",
    "with_arrivals",
]
