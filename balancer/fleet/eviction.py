"""Whether the fleet's Redis may evict kvlb's keys: its ``maxmemory-policy`` (pure :func:`eviction_risk`;
:func:`read_policies` is one ``INFO memory``, I/O).

kvlb bounds its index itself (``limits.index_capacity_blocks``) and needs Redis to refuse writes when
full (``noeviction``), never to drop keys: a Redis that evicts removes, from the coldest first, index
keys (the mirrors, fed by the stream, still hold them), and under any policy eventually the keys that
fence and order the writers (generations, positions, entry counters, leases; the ``volatile-*``
policies evict exactly the leases, which carry a TTL). kvlb then recovers as after a data loss
(docs/redis-fleet.md, "Redis outage"), again and again. The runtime checks the policy at start and
every minute and says so in the log and in ``/readyz``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from balancer.index.redis.client import RedisClient

SAFE_POLICY = "noeviction"


def eviction_risk(policies: Collection[str]) -> str | None:
    """The ``/readyz`` reason for evicting policies among ``policies`` (one per server read), or
    ``None`` when every one is ``noeviction`` (or none could be read)."""
    evicting = sorted({p for p in policies if p != SAFE_POLICY})
    if not evicting:
        return None
    return (
        f"redis maxmemory-policy {'/'.join(evicting)}: a full Redis evicts kvlb's keys (leases, positions, "
        "index) instead of refusing writes; set noeviction"
    )


async def read_policies(client: RedisClient) -> set[str]:
    """The ``maxmemory_policy`` of the server (or, for a cluster client, of the node(s) ``INFO`` went
    to); Redis errors propagate."""
    info: Mapping[str, Any] = await client.info("memory")
    if "maxmemory_policy" in info:
        return {str(info["maxmemory_policy"])}
    return {str(node["maxmemory_policy"]) for node in info.values() if isinstance(node, Mapping)}
