"""What sharing ``limits.max_inflight_per_tenant`` between workers costs an admission (``python -m
loadtests.tenant_share_cost``).

Two workers' rows of a real shared-memory load table (:class:`balancer.load.share.LoadTable`) in
this one process: the other worker holds ``--tenants`` tenants in flight (one tenant slot each), and
an :class:`~balancer.service.admission.Admission` is wired to this worker's row as ``kvlb serve
--workers 2`` wires it. Each case is timed with :mod:`timeit` (the best of ``--repeat`` runs of
``--number`` calls) and printed in µs per call, as one JSON object:

* ``request_one_worker``: one request's admission without workers (the tenant looked up, a slot
  taken and given back: ``tenant``, ``try_enter``, ``leave``);
* ``request_global_shared``: the same with the global count shared (``peers``, ``on_change``: the
  wiring when the tenant cap is ``max_inflight``);
* ``request_tenant_shared``: the same with the tenant's count shared too (``tenant_peers``,
  ``on_tenant_change``), for a tenant with another request in flight (its entry stays);
* ``request_tenant_shared_new``: the same for a tenant with nothing else in flight (its entry made
  and dropped, its slot taken and freed);
* ``request_tenant_shared_peer_busy``: ``request_tenant_shared`` when the other worker changed a
  tenant's count since the last check (so the check reads its tenant slots again), less the time
  of that change (``peer_publish``);
* ``peer_read_unchanged`` and ``peer_read_changed``: the other worker's count of one tenant
  (``LoadShare.peer_tenant_admitted``) with its slots unchanged since the last read, and changed
  (less ``peer_publish``);
* ``rate_one_worker``: one request's check of ``limits.tenant_rate_per_s``
  (:meth:`~balancer.service.tenant_rate.TenantRates.check`, a rate that never refuses) without
  workers; ``rate_shared``: the same through
  :class:`~balancer.service.tenant_rate.SharedRates` (the other workers' bucket time read, this
  worker's published), and ``rate_shared_peer_busy`` when the other worker changed its tenant slots
  since the last check (less ``peer_publish``). Only on a tree whose buckets are shared.

On a tree without tenant slots (an exported older commit, for an A/B run with this file run by
path) only the first two cases are timed. Bounded: ``--number`` at most 1,000,000, ``--repeat`` at
most 50.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

from balancer.load import share
from balancer.service import admission, tenant_rate
from balancer.service.admission import Admission, AdmissionLimits


def best_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """µs per call of ``fn``: the best of ``repeat`` runs of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def request(gate: Admission, name: str) -> Callable[[], None]:
    def one() -> None:
        tenant = gate.tenant(name)
        gate.try_enter(0, tenant)
        gate.leave(0, tenant)

    return one


def measure(tenants: int, number: int, repeat: int) -> dict[str, Any]:
    tenant_slots = hasattr(share.LoadShare, "publish_tenant")
    sizes: tuple[int, ...] = (1024, tenants) if tenant_slots else (1024,)
    table = share.LoadTable(2, *sizes)
    here = share.LoadShare(table.name, 0, 2, *sizes, track=True)
    other = share.LoadShare(table.name, 1, 2, *sizes, track=True)
    out: dict[str, Any] = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_1m": round(os.getloadavg()[0], 2),
        "tenant_slots": tenant_slots,
    }

    def gate(global_shared: bool, tenant_shared: bool) -> Admission:
        made = Admission(AdmissionLimits(1024, 128, 2.0, max_inflight_per_tenant=8))
        if global_shared:
            made.on_change = here.publish_admitted
            made.peers = here.peer_admitted
        if tenant_shared:
            made.on_tenant_change = here.publish_tenant
            made.tenant_peers = here.peer_tenant_admitted
        return made

    try:
        out["request_one_worker"] = best_us(request(gate(False, False), "x"), number, repeat)
        out["request_global_shared"] = best_us(request(gate(True, False), "x"), number, repeat)
        if tenant_slots:
            tenant_key: Callable[[str], int] = admission.tenant_key
            keys = [tenant_key(f"t{i}") for i in range(tenants)]
            for key in keys:
                other.publish_tenant(key, 1)
            asked = keys[len(keys) // 2]
            counts = [1]

            def peer_publish() -> None:
                counts[0] = 3 - counts[0]
                other.publish_tenant(keys[0], counts[0])

            def peer_read() -> None:
                here.peer_tenant_admitted(asked)

            def peer_read_changed() -> None:
                peer_publish()
                peer_read()

            held = gate(True, True)
            assert held.try_enter(0, held.tenant("y"))  # "y" keeps an entry: one request in flight
            one = request(held, "y")

            def busy() -> None:
                peer_publish()
                one()

            publish = out["peer_publish"] = best_us(peer_publish, number, repeat)
            out["peer_read_unchanged"] = best_us(peer_read, number, repeat)
            out["peer_read_changed"] = best_us(peer_read_changed, number, repeat) - publish
            out["request_tenant_shared"] = best_us(one, number, repeat)
            out["request_tenant_shared_new"] = best_us(request(gate(True, True), "x"), number, repeat)
            out["request_tenant_shared_peer_busy"] = best_us(busy, number, repeat) - publish
            if hasattr(tenant_rate, "SharedRates"):
                now = time.monotonic()

                def rates() -> tenant_rate.TenantRates:
                    return tenant_rate.TenantRates(1e9, 10**9, 1024)

                plain, local = rates(), rates()
                shared = tenant_rate.SharedRates(here.peer_tenant_tat, here.publish_tenant_tat)
                out["rate_one_worker"] = best_us(lambda: plain.check("y", now), number, repeat)
                out["rate_shared"] = best_us(lambda: shared.check(local, "y", now), number, repeat)

                def rate_busy() -> None:
                    peer_publish()
                    shared.check(local, "y", now)

                out["rate_shared_peer_busy"] = best_us(rate_busy, number, repeat) - publish
    finally:
        here.close()
        other.close()
        table.close()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--tenants", type=int, default=64, help="tenants in flight on the other worker")
    parser.add_argument("--number", type=int, default=20_000, help="calls per timed run (≤ 1,000,000)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per case (≤ 50)")
    args = parser.parse_args(argv)
    if not (1 <= args.tenants <= 65_536 and 1 <= args.number <= 1_000_000 and 1 <= args.repeat <= 50):
        parser.error("--tenants 1..65536, --number 1..1000000, --repeat 1..50")
    result = measure(args.tenants, args.number, args.repeat)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
