"""The fleet name of a balancer and of each worker of ``kvlb serve --workers N``
(:func:`balancer.fleet.runtime.instance_name`), and what ``/readyz`` says of a failing Redis
(:func:`balancer.fleet.redis_checks.redis_trouble`)."""

from __future__ import annotations

from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    RedisClusterException,
    ResponseError,
    TimeoutError,
)

from balancer.fleet.redis_checks import database_missing, redis_trouble, url_database
from balancer.fleet.runtime import instance_name


def test_each_worker_of_a_configured_instance_is_a_member_of_its_own() -> None:
    """Until 2026-12-01 every worker took ``redis.instance_id`` as it was: the workers held the same
    leases together (each ingesting the replica) and the fleet counted them as one member."""
    names = {instance_name("pod-a", worker, lambda: "unused") for worker in (0, 1, 2)}
    assert names == {"pod-a-w0", "pod-a-w1", "pod-a-w2"}
    assert instance_name("pod-a", None, lambda: "unused") == "pod-a"


def test_without_a_configured_instance_the_default_is_used() -> None:
    assert instance_name(None, None, lambda: "host-12-ab") == "host-12-ab"
    assert instance_name(None, 1, lambda: "host-12-ab") == "host-12-ab-w1"


def test_readyz_tells_a_refusing_redis_from_an_unreachable_one() -> None:
    """Until 2026-12-01 ``/readyz`` said ``redis unreachable`` for a wrong password or an OOM too."""
    assert redis_trouble(ConnectionError("Error 111 connecting to 127.0.0.1:6390")) == "redis unreachable"
    assert redis_trouble(TimeoutError("Timeout reading")) == "redis unreachable"
    no_node = RedisClusterException(
        "Redis Cluster cannot be connected. Please provide at least one reachable node"
    )
    assert redis_trouble(no_node) == "redis unreachable"
    assert redis_trouble(None) == "redis unreachable"  # only the mirrors failed: nothing to quote
    wrong = redis_trouble(AuthenticationError("invalid username-password pair or user is disabled."))
    assert wrong == "redis refuses kvlb's calls (invalid username-password pair or user is disabled.)"
    oom = redis_trouble(
        ResponseError("OOM command not allowed when used memory > 'maxmemory'.\n" + "x" * 500)
    )
    assert oom.startswith("redis refuses kvlb's calls (OOM command not allowed") and len(oom) < 200


def test_the_url_s_database_is_read_as_redis_py_reads_it() -> None:
    assert [url_database(u) for u in ("redis://h:1", "redis://h:1/", "redis://h:1/3", "rediss://h/12")] == [
        0, 0, 3, 12,
    ]  # fmt: skip
    assert url_database("redis://h:1?db=5") == 5
    refused = redis_trouble(ResponseError("DB index is out of range"), database=9)
    assert refused == "redis refuses kvlb's calls (redis.url: database 9 is not on the server)"
    assert database_missing(9, 4) == (
        "redis.url: database 9 is not on the server (DB index is out of range): the server has 4 "
        "(0..3; its `databases` setting)"
    )
