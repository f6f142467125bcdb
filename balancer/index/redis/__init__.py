"""The Redis side of the prefix index (fleet mode): several balancers share one index through Redis.

* :mod:`~balancer.index.redis.client`: the client (single server or Cluster) and the error set.
* :mod:`~balancer.index.redis.schema`: key names and value encodings (one place for the layout).
* :mod:`~balancer.index.redis.scripts`: the Lua scripts that apply events and read holders.
* :mod:`~balancer.index.redis.plan`: events → bounded script calls (pure).
* :mod:`~balancer.index.redis.index`: ``RedisIndex``, the ``PrefixIndex`` backend over Redis.
* :mod:`~balancer.index.redis.stream`: the applied-batch stream that mirrors follow.
* :mod:`~balancer.index.redis.mirror`: ``Mirror``, an in-memory copy fed by that stream (what routing reads).
* :mod:`~balancer.index.redis.lease`: the per-replica ingest lease.
"""
