"""Why a pool's replica was not a candidate of a decision (pure): one small code per reason.

:meth:`PoolRouter.candidates <balancer.routing.router.PoolRouter.candidates>` knows why it leaves a
replica out (the health book's reason, the in-flight cap, a retry's exclusion) while it picks the
candidates; the plan keeps each left-out replica with a code from :data:`LEFT_OUT_REASONS` (a small
int: a decision record holds ``(replica, code)`` pairs, not a string per replica), and
``GET /admin/decisions/{id}`` names them again with :func:`reason_name`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from balancer.types import ReplicaId

LEFT_OUT_REASONS: tuple[str, ...] = (
    "unknown",
    "draining",
    "failing health probes",
    "serves another model",
    "breaker open",
    "breaker trial in flight",
    "full",
    "already tried",
)
"""Every reason a replica is left out, indexed by its code. The first six are the health book's
(:meth:`HealthBook.unroutable_reason <balancer.health.book.HealthBook.unroutable_reason>`);
``full``: at ``limits.max_inflight_per_replica`` (every worker's requests counted); ``already
tried``: excluded by the request itself (a retry after that replica failed, or filled while it was
planned). Codes are only ever appended (a record keeps them)."""

_CODE_OF: Mapping[str, int] = {reason: code for code, reason in enumerate(LEFT_OUT_REASONS)}
FULL = _CODE_OF["full"]
ALREADY_TRIED = _CODE_OF["already tried"]

LeftOut = tuple[tuple[ReplicaId, int], ...]
"""The replicas a decision left out, each with its reason's code, in the pool's order."""


def reason_code(reason: str | None) -> int:
    """The code of a health reason (``unknown``'s for ``None`` or a reason not listed)."""
    return _CODE_OF.get(reason or "unknown", 0)


def reason_name(code: int) -> str:
    """The words of ``code`` (``unknown`` for a code this release does not know)."""
    return LEFT_OUT_REASONS[code] if 0 <= code < len(LEFT_OUT_REASONS) else "unknown"


def left_out_names(left_out: Iterable[tuple[str, int]]) -> dict[str, str]:
    """``{replica: reason}`` of a decision's left-out replicas (JSON-able)."""
    return {replica: reason_name(code) for replica, code in left_out}
