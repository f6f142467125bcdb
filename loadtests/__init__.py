"""kvlb's load-test toolkit.

- :mod:`loadtests.workloads` (pure): deterministic request streams (tenants, chat, rag, agent, unique)
  and Mooncake trace replay, registered by name.
- :mod:`loadtests.driver` (I/O): open- and closed-loop drivers for any OpenAI-compatible endpoint,
  streaming each request and recording a :class:`loadtests.driver.RequestRecord`.
- :mod:`loadtests.sse` (pure): OpenAI streaming chunks → a record.
- :mod:`loadtests.stats` (pure): records → :class:`loadtests.stats.Summary` and comparisons.
"""
