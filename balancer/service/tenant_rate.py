"""The per-tenant request-rate limit checked before admission (pure core: no clock, no I/O).

Each tenant (the value of the tenant header, cut to :data:`~balancer.service.admission.TENANT_CHARS`
characters; no header: the default tenant) has a **token bucket** of ``burst`` requests refilled at
``rate_per_s``: a request takes one token or is refused with the time until one is back (the
shell answers 429 with ``Retry-After``). The bucket is kept as one number, its *theoretical arrival
time* (GCRA, the token bucket's equivalent form): ``tat`` is when the bucket would be full again,
so the tokens left at ``now`` are ``burst - (tat - now) × rate_per_s``, a request is let in while
``max(tat, now) + 1/rate_per_s - now ≤ burst/rate_per_s`` and refused otherwise, with that
difference as its wait. A refusal changes no bucket: a tenant that keeps sending while refused is
let in again at ``rate_per_s`` exactly, however fast it sends.

**The table is bounded** (``max_tenants`` buckets, least recently used first out, each at most
:data:`BUCKET_BYTES`): a tenant with no bucket in the table (seen for the first time, or dropped to
make room) is a *newcomer*, and a newcomer's request takes its token from one bucket **shared by
all newcomers** (``new_rate_per_s``, ``new_burst``) before it gets a bucket of its own (its request is
counted in both). So made-up tenant values, a new one on each request, are together held to that
one bucket: they cannot pass the limit by being new, nor grow the table past its bound, and they
push out only the least recently seen tenants (one per newcomer let in, ``on_evict``); a tenant
sending steadily keeps its bucket. What it costs: a newcomer arriving while made-up values drain the
newcomers' bucket is refused until its turn there (its wait says when), and a service with more
active tenants than the table holds sends the ones pushed out through the newcomers' bucket again.
The default tenant's bucket is its own and never dropped.

Time is the caller's (``now``, seconds of a monotonic clock).

**With ``kvlb serve --workers N``** the buckets are the service's: each worker keeps its own table,
but :meth:`TenantRates.check` is given the latest time the other workers set for the tenant's bucket
(and for the newcomers' bucket), ``peer_tat``, and starts from the later of its own and that one; a
tenant with a bucket time elsewhere is no newcomer here. The times are those of the host's monotonic
clock, which every process of the host shares, so the buckets' arithmetic stays that of one bucket.
:class:`SharedRates` carries them between the workers (through the shared load table,
:mod:`balancer.load.share`, by hooks: nothing here does I/O). Two workers letting a request of one
tenant in at the same instant both start from the same time: the service lets at most one request
per other worker too many in per such race.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from balancer.service.admission import DEFAULT_TENANT_KEY, TENANT_CHARS, tenant_key

BUCKET_BYTES = 784
"""Most bytes one tenant's bucket holds in the table: its key (a ``str`` of at most
:data:`~balancer.service.admission.TENANT_CHARS` characters, 4 B each at most: 588 B with its
header), its time (a ``float``, 24 B) and the ordered dict's entry (node, hash slot and entry:
about 170 B with the table's spare room). Checked with ``tracemalloc`` in
``tests/unit/test_tenant_rate.py``."""

SLACK_S = 1e-9
"""Rounding allowed when a bucket's debt is compared with its depth (seconds): ``burst`` requests at
once from a full bucket add up ``burst`` times ``1/rate_per_s``, which floats may round above the
depth."""


class TenantRates:
    """The buckets of every tenant seen lately, the default tenant's and the newcomers' shared one."""

    __slots__ = (
        "_buckets",
        "_default_tat",
        "_new_interval_s",
        "_new_tat",
        "_new_tolerance_s",
        "burst",
        "interval_s",
        "max_tenants",
        "new_burst",
        "new_rate_per_s",
        "on_evict",
        "rate_per_s",
        "taken_new_tat",
        "taken_tat",
        "tolerance_s",
    )

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        max_tenants: int,
        new_rate_per_s: float | None = None,
        on_evict: Callable[[], None] | None = None,
        new_burst: int | None = None,
    ) -> None:
        if rate_per_s <= 0 or burst < 1 or max_tenants < 1:
            raise ValueError("rate_per_s must be > 0, burst and max_tenants >= 1")
        new_rate = rate_per_s if new_rate_per_s is None else new_rate_per_s
        new_depth = burst if new_burst is None else new_burst
        if new_rate <= 0 or new_depth < 1:
            raise ValueError("new_rate_per_s must be > 0, new_burst >= 1")
        self.rate_per_s = rate_per_s
        """Requests a second a tenant's bucket refills by."""
        self.burst = burst
        """Requests a full bucket lets in at once."""
        self.max_tenants = max_tenants
        """Buckets kept in the table (the default tenant's and the newcomers' aside)."""
        self.new_rate_per_s = new_rate
        """Requests a second the newcomers' shared bucket refills by."""
        self.new_burst = new_depth
        """Requests the newcomers' bucket lets in at once (default ``burst``)."""
        self.on_evict = on_evict
        """Called for each bucket dropped to make room for a newcomer's."""
        self.interval_s = 1.0 / rate_per_s
        self.tolerance_s = burst / rate_per_s
        self._new_interval_s = 1.0 / new_rate
        self._new_tolerance_s = new_depth / new_rate
        self._buckets: collections.OrderedDict[str, float] = collections.OrderedDict()
        """Tenant → theoretical arrival time, least recently seen first."""
        self._default_tat = -math.inf
        self._new_tat = -math.inf
        self.taken_tat = -math.inf
        """The tenant's bucket time set by the last request let in (to publish to the other workers)."""
        self.taken_new_tat = -math.inf
        """The newcomers' bucket time set by the last request let in, if it was a newcomer's; else
        ``-inf``."""

    @property
    def tenants(self) -> int:
        """Buckets in the table now (the default tenant's and the newcomers' aside)."""
        return len(self._buckets)

    def check(
        self, name: str | None, now: float, peer_tat: float = -math.inf, peer_new_tat: float = -math.inf
    ) -> float:
        """Take one token of ``name``'s bucket at ``now``: ``0.0`` (let in; :attr:`taken_tat` and
        :attr:`taken_new_tat` say what it set), or the seconds until its bucket (a newcomer's: the
        newcomers' bucket) has a token again (refused: nothing changed but the tenant's place as the
        most recently seen). ``peer_tat``, ``peer_new_tat``: the latest times the other workers set
        for the tenant's bucket and the newcomers' (``-inf``: none); a tenant with one is no
        newcomer."""
        interval = self.interval_s
        if not name:
            tat = max(self._default_tat, peer_tat, now) + interval
            wait = tat - now - self.tolerance_s
            if wait > SLACK_S:
                return wait
            self._default_tat = self.taken_tat = tat
            self.taken_new_tat = -math.inf
            return 0.0
        key = name if len(name) <= TENANT_CHARS else name[:TENANT_CHARS]
        buckets = self._buckets
        held = buckets.get(key)
        if held is not None or peer_tat > -math.inf:
            if held is not None:
                buckets.move_to_end(key)
                tat = max(held, peer_tat, now) + interval
            else:
                tat = max(peer_tat, now) + interval
            wait = tat - now - self.tolerance_s
            if wait > SLACK_S:
                return wait
            if held is None:
                self._make_room()
            buckets[key] = self.taken_tat = tat
            self.taken_new_tat = -math.inf
            return 0.0
        new_tat = max(self._new_tat, peer_new_tat, now) + self._new_interval_s
        wait = new_tat - now - self._new_tolerance_s
        if wait > SLACK_S:
            return wait
        self._new_tat = self.taken_new_tat = new_tat
        self._make_room()
        buckets[key] = self.taken_tat = now + interval
        return 0.0

    def _make_room(self) -> None:
        """Drop the least recently seen bucket if the table is full (for a new one)."""
        if len(self._buckets) >= self.max_tenants:
            self._buckets.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict()

    def known(self, name: str | None) -> bool:
        """Whether ``name`` has a bucket of its own (the default tenant always does): a refusal of one
        that has none was the newcomers' bucket's."""
        return not name or name[:TENANT_CHARS] in self._buckets


def per_worker(value: float, workers: int) -> float:
    """``value`` (a rate) divided among ``workers`` processes that each count their own requests (the
    buckets not shared: ``kvlb serve --workers N`` without its load table)."""
    return value / max(1, workers)


def burst_per_worker(burst: int, workers: int) -> int:
    """A bucket's depth divided among ``workers`` (rounded up: at least 1, so that every worker lets a
    request in)."""
    return max(1, math.ceil(burst / max(1, workers)))


NEW_TENANTS_KEY = tenant_key("\0new")
"""The newcomers' shared bucket's key between workers (no header value hashes to it)."""

MAX_KEY_MEMO = 65_536
"""Tenant names :class:`SharedRates` remembers the key of before it starts again."""


class SharedRates:
    """Carries the buckets' times between the workers of ``kvlb serve --workers N`` (see the module
    doc) through two hooks keyed by :func:`~balancer.service.admission.tenant_key`: ``peer_tat``
    (the latest time the other workers published, ns of the monotonic clock; 0: none) and
    ``publish`` (this worker's time, ns). No I/O of its own."""

    __slots__ = ("_keys", "peer_tat", "publish")

    def __init__(self, peer_tat: Callable[[int], int], publish: Callable[[int, int], None]) -> None:
        self.peer_tat = peer_tat
        self.publish = publish
        self._keys: dict[str, int] = {}

    def key(self, name: str | None) -> int:
        """``name``'s key (the default tenant's for none), remembered for at most
        :data:`MAX_KEY_MEMO` names."""
        if not name:
            return DEFAULT_TENANT_KEY
        name = name[:TENANT_CHARS]
        key = self._keys.get(name)
        if key is None:
            if len(self._keys) >= MAX_KEY_MEMO:
                self._keys.clear()
            key = self._keys[name] = tenant_key(name)
        return key

    def check(self, rates: TenantRates, name: str | None, now: float) -> float:
        """:meth:`TenantRates.check` from the later of this worker's and the others' bucket times,
        publishing what it set when the request is let in."""
        key = self.key(name)
        peer_ns = self.peer_tat(key)
        new_ns = self.peer_tat(NEW_TENANTS_KEY) if name and not peer_ns and not rates.known(name) else 0
        wait = rates.check(
            name, now, peer_ns / 1e9 if peer_ns else -math.inf, new_ns / 1e9 if new_ns else -math.inf
        )
        if not wait:
            self.publish(key, math.floor(rates.taken_tat * 1e9))
            if rates.taken_new_tat > -math.inf:
                self.publish(NEW_TENANTS_KEY, math.floor(rates.taken_new_tat * 1e9))
        return wait
