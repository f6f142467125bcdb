"""``kvlb capacity``: each router's highest arrival rate within a TTFT SLO.

- :mod:`loadtests.capacity.search` (pure): the SLO, a router's measured points and the
  bracket-then-bisect search.
- :mod:`loadtests.capacity.report` (pure): the searches as the report (JSON, markdown, SVG).
- :mod:`loadtests.capacity.command` (I/O shell): the command line, the request stream and the run
  (the searches, the diagnosis, the confirmation when asked, the report's files).
- :mod:`loadtests.capacity.simulated` (pure): each router in the simulator, the oracle's plan, the
  diagnosis against it and a confirmed point's band of jittered draws.
- :mod:`loadtests.capacity.confirm` (I/O): ``--confirm``, the bracketing rates on the emulated fleet,
  each next to a simulation of the same requests.
- :mod:`loadtests.capacity.target` (I/O): ``--target URL``, the search run for real at an endpoint.
- :mod:`loadtests.capacity.agreement` (pure): request-by-request agreement of a fleet run and a
  simulation of the same requests.
- :mod:`loadtests.capacity.band` (pure): the simulator's spread at a confirmed point, and the fleet's
  verdict against it.

See ``docs/loadtest.md``.
"""
