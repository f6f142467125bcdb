"""The ``/admin/whatif`` replay measured: how well it predicts, and what it costs.

- :mod:`loadtests.whatif.check` (I/O): ``kvlb loadtest --whatif NAME=VALUE ...``, the prediction
  against a real run of the same stream on one emulated fleet.
- :mod:`loadtests.whatif.latency` (I/O; ``python -m loadtests.whatif.latency``): whether a replay
  slows a live kvlb's routing down.
- :mod:`loadtests.whatif.micro` (in process; ``python -m loadtests.whatif.micro``): what recording a
  decision and replaying the ring cost.

See ``docs/operations.md``.
"""
