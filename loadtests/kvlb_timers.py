"""kvlb's routing timers on the emulated fleet's model time (pure: the mapping, no I/O).

The emulated engines run ``time_scale`` model seconds per wall second (``--time-scale 0.25``: one
model second takes 4 wall seconds), but ``kvlb serve`` reads the wall clock. Left alone, each of its
timers is ``time_scale`` times as long in model time as its setting says: at 0.25 the 2 s
``limits.speculative_ttl_s`` lasts 0.5 model seconds, where the simulator's kvlb
(:class:`loadtests.simulate.SimConfig`) holds its entries 2 model seconds. :func:`model_time_sets`
gives the ``kvlb serve --set`` overrides that put every timer that changes a routing decision on
model time (its default divided by ``time_scale``), except those the user set: the user's value
wins.

The timers that change where a request goes (docs/loadtest.md, "kvlb's timers on the fleet"):

- ``limits.speculative_ttl_s`` (2 s): a routed request's blocks count as held on its replica this
  long after its first token, until the engine's events confirm them (the simulator's
  ``speculative_ttl_s``).
- ``timeouts.first_byte_s`` (60 s): the same entries' life before the first token (the router's
  ``pending_ttl_s``, the simulator's ``pending_ttl_s``), and the wait for a first byte before a
  retry on another replica.
- ``scrape_interval_s`` (1 s): how fresh the engines' scraped queue gauges are (the simulator's
  ``scrape_interval_s``); the scraped stats' staleness bound follows it (``max(5, 3 × interval)``).
- ``limits.gap_hold_s`` (0.5 s) and ``limits.gap_keep_s`` (2 s): how long a cache's blocks stay
  suspect after an event gap; they act only after a gap (the simulator has none). Both are bounded
  at 60 s by the settings' validation, so the scaled value is capped there.
- ``limits.queue_timeout_s`` (2 s): how long a request waits for admission at
  ``limits.max_inflight`` (or with every replica at ``limits.max_inflight_per_replica``) before a
  503. It decides no placement, but it decides whether a request is served: a confirmation whose
  schedule holds about ``max_inflight`` requests in flight (``agent`` near its capacity) reaches it,
  and on wall time it would give the fleet a quarter of a real deployment's wait at 0.25.

One policy weight is in seconds too, ``ramp_memory_s`` (the credit ramp's memory, docs/policies.md):
the policy advances its average by the load snapshot's ``now``, the shell's wall clock on the
fleet. :func:`model_time_weights` divides it by ``time_scale`` in each kvlb router's own weights
(the router string's value, else the default), so ``kvlb:cost+ramp_memory_s=0.2`` at
``--time-scale 0.5`` averages over 0.2 model seconds, as the simulator's router does; a
``--kvlb-set policy.weights...`` given by the user is applied after them and wins.

Left on wall time, because they change no decision on a healthy fleet and the simulator has none:
``health_interval_s`` (probes; a replica leaves only when probes fail), the upstream connect and
idle timeouts, and the load tracker's ``max_age_s`` (900 s, a leak guard; the load accounting has
no decay).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from balancer.config.settings import Settings
from balancer.policy.base import PolicyWeights

MODEL_TIME_SETTINGS: tuple[str, ...] = (
    "limits.speculative_ttl_s",
    "timeouts.first_byte_s",
    "scrape_interval_s",
    "limits.gap_hold_s",
    "limits.gap_keep_s",
    "limits.queue_timeout_s",
)
"""The ``kvlb serve`` settings (dotted ``--set`` names) that :func:`model_time_sets` scales."""

MODEL_TIME_WEIGHTS: tuple[str, ...] = ("ramp_memory_s",)
"""The policy weights in seconds that :func:`model_time_weights` scales."""

SETTING_CAPS_S: dict[str, float] = {"limits.gap_hold_s": 60.0, "limits.gap_keep_s": 60.0}
"""Upper bounds the settings' validation puts on some of them (seconds)."""


@dataclass(frozen=True, slots=True)
class KvlbFleetSets:
    """The ``kvlb serve --set`` overrides of one fleet run: the user's and the model-time ones."""

    user: tuple[str, ...]
    """``--kvlb-set`` as given, in order."""
    model_time: tuple[str, ...]
    """The scaled timers (``NAME=VALUE``) added for the names the user did not set."""
    weight_time_scale: float = 1.0
    """The time scale :func:`model_time_weights` applies to each kvlb router's weights in seconds
    (1: as given, with ``--kvlb-wall-timers`` or at time scale 1)."""

    @property
    def all(self) -> tuple[str, ...]:
        """Every override, the user's first (no name appears in both)."""
        return (*self.user, *self.model_time)


def set_name(item: str) -> str:
    """The dotted name of a ``NAME=VALUE`` override (the whole item when it has no ``=``)."""
    return item.split("=", 1)[0].strip()


def default_seconds(name: str) -> float:
    """kvlb's default of the dotted setting ``name`` (seconds)."""
    value: object = Settings()
    for part in name.split("."):
        value = getattr(value, part)
    if not isinstance(value, int | float):
        raise TypeError(f"{name} is not a number of seconds: {value!r}")
    return float(value)


def model_time_sets(time_scale: float, user_sets: Sequence[str] = ()) -> tuple[str, ...]:
    """``NAME=VALUE`` overrides that put kvlb's routing timers on model time at ``time_scale``
    (emulator model seconds per wall second, > 0): each of :data:`MODEL_TIME_SETTINGS` not named in
    ``user_sets`` at its default / ``time_scale``, capped by :data:`SETTING_CAPS_S`. Empty at 1."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if time_scale == 1.0:
        return ()
    given = {set_name(item) for item in user_sets}
    sets = []
    for name in MODEL_TIME_SETTINGS:
        if name in given:
            continue
        value = min(default_seconds(name) / time_scale, SETTING_CAPS_S.get(name, float("inf")))
        sets.append(f"{name}={value:g}")
    return tuple(sets)


def model_time_weights(weights: Mapping[str, float | None], time_scale: float) -> dict[str, float | None]:
    """A kvlb router's policy ``weights`` (the router string's overrides) with each weight of
    :data:`MODEL_TIME_WEIGHTS` on model time at ``time_scale`` (> 0): its value, or the
    :class:`~balancer.policy.base.PolicyWeights` default when ``weights`` does not name it, divided
    by ``time_scale``; ``None`` and 0 (off) stay as they are. A copy of ``weights`` at 1."""
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    scaled = dict(weights)
    if time_scale == 1.0:
        return scaled
    defaults = PolicyWeights()
    for name in MODEL_TIME_WEIGHTS:
        value = scaled.get(name, getattr(defaults, name))
        if value:
            scaled[name] = value / time_scale
    return scaled


def fleet_sets(time_scale: float, user_sets: Sequence[str], *, wall_timers: bool = False) -> KvlbFleetSets:
    """The overrides of a fleet run's kvlb: ``user_sets`` plus, unless ``wall_timers``, the model-time
    timers of :func:`model_time_sets` and the time scale of :func:`model_time_weights`."""
    if wall_timers:
        return KvlbFleetSets(user=tuple(user_sets), model_time=())
    scaled = model_time_sets(time_scale, user_sets)
    return KvlbFleetSets(user=tuple(user_sets), model_time=scaled, weight_time_scale=time_scale)


def fleet_sets_of(args: argparse.Namespace) -> KvlbFleetSets:
    """:func:`fleet_sets` from a command's ``--time-scale``, ``--kvlb-set`` and
    ``--kvlb-wall-timers`` (``kvlb capacity`` and ``kvlb loadtest`` take all three)."""
    return fleet_sets(args.time_scale, args.kvlb_set, wall_timers=args.kvlb_wall_timers)


WALL_TIMERS_HELP = (
    "fleet: leave kvlb's timers on wall time (by default, at a --time-scale other than 1, every "
    "routing timer — limits.speculative_ttl_s, timeouts.first_byte_s, scrape_interval_s, "
    "limits.gap_hold_s, limits.gap_keep_s, and the admission wait limits.queue_timeout_s — is set to "
    "its default / time scale, and so is each kvlb router's policy weight ramp_memory_s, so it lasts "
    "as long in model time as on real engines; a name given with --kvlb-set keeps the user's value)"
)
"""The help of ``--kvlb-wall-timers`` (``kvlb capacity`` and ``kvlb loadtest``)."""
