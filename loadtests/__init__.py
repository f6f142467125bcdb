"""kvlb's load-test toolkit.

- :mod:`loadtests.workloads` (pure): deterministic request streams (tenants, chat, rag, agent, unique)
  and Mooncake trace replay, registered by name.
- :mod:`loadtests.driver` (I/O): open- and closed-loop drivers for any OpenAI-compatible endpoint,
  streaming each request and recording a :class:`loadtests.driver.RequestRecord`.
- :mod:`loadtests.sse` (pure): OpenAI streaming chunks → a record (events split by the service's own
  parser, :mod:`balancer.upstream.sse`).
- :mod:`loadtests.stats` (pure): records → :class:`loadtests.stats.Summary` and comparisons.
- :mod:`loadtests.emulator_measure` (I/O): the emulator's idle cost and TTFT accuracy, measured from
  outside (``python -m loadtests.emulator_measure``).
"""
