"""The routing policy in force and its runtime changes (no I/O): ``PUT /admin/policy``, the gRPC
admin RPCs and the fleet's shared policy (Redis) all go through :class:`PolicyControl`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from balancer.errors import BalancerError
from balancer.policy import Policy, PolicyWeights, make_policy


class PolicyCommitError(BalancerError):
    """A policy change could not reach the fleet (Redis), so it was not applied anywhere (503)."""


@dataclass(frozen=True, slots=True)
class PolicyView:
    """The policy in force, as ``GET /admin/policy`` shows it."""

    name: str
    weights: PolicyWeights
    version: int
    """Starts at 1 and increments on every change."""
    updated_by: str
    updated_at_wall: float
    actor: str | None = None
    """Who said they made the change (``x-kvlb-actor``); ``None`` for the configured policy. Kept
    with the policy in Redis, so the balancers that adopt it audit it with the same actor."""
    reason: str | None = None
    """Why (the change's ``reason``), kept likewise; ``None`` when none was given."""

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "weights": self.weights.to_dict(),
            "version": self.version,
            "updated_by": self.updated_by,
            "updated_at": self.updated_at_wall,
        }


class PolicyControl:
    """The runtime-tunable policy: its name, weights and version, and one instance per pool
    (policies are stateless: ``round_robin``'s rotation is each pool's router's, :class:`RouteRequest
    <balancer.policy.base.RouteRequest>`)."""

    def __init__(self, name: str, weights: PolicyWeights, wall_now: float) -> None:
        make_policy(name)  # validates the name
        self.view = PolicyView(name, weights, 1, "config", wall_now)
        self._instances: dict[str, Policy] = {}
        self.committer: Callable[[PolicyView], Awaitable[PolicyView]] | None = None
        """Set by the fleet (Redis): stores a change for every balancer before :meth:`change`
        applies it here, and returns it as stored (the fleet's version); raises
        :class:`PolicyCommitError` when it could not."""

    def policy_for(self, model: str) -> Policy:
        policy = self._instances.get(model)
        if policy is None:
            policy = self._instances[model] = make_policy(self.view.name)
        return policy

    async def change(
        self,
        name: str | None,
        weights: PolicyWeights,
        who: str,
        wall_now: float,
        actor: str | None = None,
        reason: str | None = None,
    ) -> dict[str, tuple[object, object]]:
        """Apply a validated change; returns ``{field: (old, new)}`` (empty: nothing changed, and the
        version stays). With a :attr:`committer` (the fleet) it is applied here only once the
        committer stored it: :class:`PolicyCommitError` when it could not, and nothing changed.
        Raises :class:`ConfigError` for an unknown policy name."""
        view, changes = self._proposal(name, weights, who, wall_now, actor, reason)
        if view is not None:
            self._install(view if self.committer is None else await self.committer(view))
        return changes

    def _proposal(
        self,
        name: str | None,
        weights: PolicyWeights,
        who: str,
        wall_now: float,
        actor: str | None,
        reason: str | None,
    ) -> tuple[PolicyView | None, dict[str, tuple[object, object]]]:
        old = self.view
        new_name = old.name if name is None else name
        if new_name != old.name:
            make_policy(new_name)
        changes = differences(old.name, old.weights, new_name, weights)
        if not changes:
            return None, changes
        return PolicyView(new_name, weights, old.version + 1, who, wall_now, actor, reason), changes

    def _install(self, view: PolicyView) -> None:
        if view.name != self.view.name:
            make_policy(view.name)
            self._instances.clear()
        self.view = view

    def adopt(self, view: PolicyView) -> bool:
        """Install a view decided elsewhere (another balancer, through Redis) without committing it;
        ``False`` when it is the one in force. Raises :class:`ConfigError` for an unknown policy
        name."""
        if view == self.view:
            return False
        self._install(view)
        return True


def differences(
    old_name: str, old: PolicyWeights, new_name: str, new: PolicyWeights
) -> dict[str, tuple[object, object]]:
    """``{field: (old, new)}`` of every field that differs (``name`` and each weight)."""
    changes: dict[str, tuple[object, object]] = {}
    if new_name != old_name:
        changes["name"] = (old_name, new_name)
    before, after = old.to_dict(), new.to_dict()
    changes.update({k: (before[k], after[k]) for k in after if before[k] != after[k]})
    return changes
