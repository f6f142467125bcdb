"""Fleet-scale simulator: the service's routing code over modelled replicas, on virtual time.

``des`` (event loop), ``replica_model`` (fast event-level replica) with ``block_cache`` (the
emulator's prefix cache at block level) and ``step_model`` (the emulator's scheduler), ``routing``
(PoolRouter with candidate pruning), ``sources`` (workloads, tiled traces), ``fleet`` (the wiring)
and ``report`` (records, summary, comparison). See ``docs/simulate.md``.
"""

from loadtests.simulate.simulation import SimConfig, SimResult, Simulation, simulate
from loadtests.simulate.sources import SimRequest, trace_requests, workload_requests

__all__ = [
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Simulation",
    "simulate",
    "trace_requests",
    "workload_requests",
]
