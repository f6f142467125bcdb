"""Fault runs with real processes: the harness of ``tests/faults`` and the soak of ``kvlb loadtest``.

- :mod:`loadtests.faults.procs` (I/O): ``kvlb emulate`` replicas and ``kvlb serve`` as child processes.
- :mod:`loadtests.faults.rig` (I/O): a running fleet, and its index compared with the engines'.
- :mod:`loadtests.faults.load` (I/O): steady load and the classification of every request's outcome.
- :mod:`loadtests.faults.scenarios` (I/O): the replica faults and the one-scenario runner.
- :mod:`loadtests.faults.soak` (I/O): ``kvlb loadtest --duration``: faults in turn, resources sampled.
- :mod:`loadtests.faults.soak_report`: flat-line verdicts (pure) and the soak's report files.
"""
