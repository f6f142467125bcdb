"""Replica health: :mod:`~balancer.health.book` (pure per-replica state: routable, failures, probes
due) and :mod:`~balancer.health.prober` (the I/O loop that probes a replica and reports to it)."""
