"""The load tools' child processes: the emulated fleet, ``kvlb serve`` and the peers (I/O).

- :mod:`loadtests.fleet.processes`: a load test's processes (``kvlb loadtest``, ``kvlb capacity
  --confirm``, the what-if tools): the emulated fleet, kvlb and the peer routers, and the fleet's
  admin calls (flush, stats, caught up).
- :mod:`loadtests.fleet.emulator_child`: one child of that fleet (``python -m
  loadtests.fleet.emulator_child``), ``kvlb emulate`` with the overrides a load test needs.
- :mod:`loadtests.fleet.child_process`: one child process (start with a bounded wait for its JSON
  announcement, stop by SIGTERM then SIGKILL, stderr tail), used by all of the above, ``kvlb demo``,
  ``kvlb bench overhead`` and the fault runs.

The fault runs' processes are :mod:`loadtests.faults.procs` (fixed ports, restarts, signals), built on
:mod:`loadtests.fleet.child_process`.
"""
