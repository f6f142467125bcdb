"""The fleet name of a balancer and of each worker of ``kvlb serve --workers N``
(:func:`balancer.fleet.runtime.instance_name`)."""

from __future__ import annotations

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
