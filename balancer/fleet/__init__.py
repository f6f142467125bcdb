"""The fleet: several balancers sharing one Redis index (see ``docs/redis-fleet.md``).

Only used when ``redis.url`` is set; with no Redis the balancer runs embedded, in one process.
"""
