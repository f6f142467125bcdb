"""The settings' checks across list entries (pure): code, not tables, each listed in :data:`ACROSS`
with its description next to it, which the configuration reference prints (section "Rules across
settings"). A model or a replica id given twice, two replicas on one event endpoint.

Each runs on the whole :class:`~balancer.config.settings.Settings`, after every entry's own rules
(:func:`balancer.config.rules.check_rules`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from balancer.errors import ConfigError

if TYPE_CHECKING:
    from balancer.config.settings import ReplicaConfig, Settings


def endpoint_for_rank(endpoint: str, dp_rank: int) -> str:
    """The endpoint of DP rank ``dp_rank``: TCP port + rank; ``ipc://`` paths get ``_dp{rank}``."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        if parts.port is None:
            raise ConfigError(f"endpoint {endpoint!r} has no port")
        host = endpoint[len("tcp://") : endpoint.rindex(":")]
        return f"tcp://{host}:{parts.port + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"


@dataclass(frozen=True, slots=True)
class Across:
    """A check that compares list entries with one another."""

    name: str
    """Its name in a setting's entry of the reference (``unique replica id``)."""
    paths: tuple[str, ...]
    """The settings it reads."""
    text: str
    """The rule in words (Markdown), as the reference prints it."""
    check: Callable[[Settings], None]
    """Raises :class:`ConfigError` naming the entry that breaks it."""


def unique_models(settings: Settings) -> None:
    """Each pool's ``model`` appears once."""
    models: set[str] = set()
    for pool in settings.pools:
        if pool.model in models:
            raise ConfigError(f"pools: model {pool.model!r} appears twice")
        models.add(pool.model)


def unique_replica_ids(settings: Settings) -> None:
    """Each replica ``id`` appears once, across every pool."""
    seen: set[str] = set()
    for pool in settings.pools:
        for replica in pool.replicas:
            if replica.id in seen:
                raise ConfigError(f"pools[{pool.model}].replicas: id {replica.id!r} appears twice")
            seen.add(replica.id)


def event_endpoint_claims(settings: Settings) -> None:
    """No two replicas of pools with ``kv_events`` connect to one event endpoint."""
    claimed: dict[str, tuple[str, str]] = {}
    for pool in settings.pools:
        if pool.kv_events:
            for replica in pool.replicas:
                claim_event_endpoints(replica, claimed)


def claim_event_endpoints(replica: ReplicaConfig, claimed: dict[str, tuple[str, str]]) -> None:
    """Record the ZMQ endpoints ``replica``'s event sources connect to (events and replay, every DP
    rank) in ``claimed`` (endpoint → replica id, which claim); raises :class:`ConfigError` when
    another replica claimed one already: one engine's events would be credited to both. Endpoints
    are compared as written (``localhost`` and ``127.0.0.1`` differ). Ranks of one replica that run
    into each other (events rank 1 on the replay port) are left to the sources, which say so at
    run time (a peer that refuses the handshake): refusing them here would drop a Kubernetes pod
    whose rank 0 works."""
    for kind, endpoint in (("events", replica.events), ("replay", replica.replay)):
        if endpoint is None:
            continue
        for rank in range(replica.dp_size):
            address = endpoint_for_rank(endpoint, rank).lower()
            who = f"replica {replica.id} rank {rank} {kind}"
            owner, other = claimed.setdefault(address, (replica.id, who))
            if owner != replica.id:
                raise ConfigError(
                    f"{who} endpoint {address} is also {other}'s: each engine rank publishes on its "
                    "own ports (rank r on port + r), so one engine's events would be credited to "
                    "two replicas; check the replicas' events, replay and dp_size"
                )


ACROSS: tuple[Across, ...] = (
    Across("unique model", ("pools[].model",), "Each pool's `model` appears once.", unique_models),
    Across(
        "unique replica id",
        ("pools[].replicas[].id",),
        "Each replica `id` appears once, across every pool.",
        unique_replica_ids,
    ),
    Across(
        "one replica per event endpoint",
        (
            "pools[].kv_events",
            "pools[].replicas[].events",
            "pools[].replicas[].replay",
            "pools[].replicas[].dp_size",
        ),
        "No two replicas of pools with `kv_events` connect to one event endpoint: the `events` and"
        " `replay` endpoints of each DP rank (rank r: port + r, or an `ipc://` path + `_dp<r>`),"
        " compared as written, belong to one replica (else one engine's events would be credited to"
        " two). Ranks of one replica that run into each other are reported by the event sources at"
        " run time.",
        event_endpoint_claims,
    ),
)
"""The checks across list entries, in the order :meth:`Settings.validate` runs them (after each
entry's own rules)."""
