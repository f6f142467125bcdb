"""``kvlb capacity``: each router's highest arrival rate within a TTFT SLO.

- :mod:`loadtests.capacity.search` (pure): the SLO, a router's measured points and the
  bracket-then-bisect search.
- :mod:`loadtests.capacity.report` (pure): the searches as the report (JSON, markdown, SVG).
- :mod:`loadtests.capacity.command` (I/O shell): the command line and the run (simulator searches,
  fleet confirmation, report files).
- :mod:`loadtests.capacity.target` (I/O): ``--target URL``, the search run for real at an endpoint.
- :mod:`loadtests.capacity.agreement` (pure): request-by-request agreement of a fleet run and a
  simulation of the same requests.
- :mod:`loadtests.capacity.band` (pure): the simulator's spread at a confirmed point, and the fleet's
  verdict against it.

See ``docs/loadtest.md``.
"""
