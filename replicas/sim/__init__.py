"""The engine emulator: replicas that model an inference engine's cache and timing.

Pure core: :mod:`~replicas.sim.cache` (paged radix cache with LRU), :mod:`~replicas.sim.scheduler`
(continuous batching), :mod:`~replicas.sim.timing` and :mod:`~replicas.sim.profiles` (step-time model),
:mod:`~replicas.sim.sampling` (deterministic output) and :mod:`~replicas.sim.faults`.
I/O shell: :mod:`~replicas.sim.engine` (the step loop), :mod:`~replicas.sim.http` (OpenAI API), the
engine personalities :mod:`~replicas.sim.personality_sglang`, :mod:`~replicas.sim.personality_vllm` (both
over the ZMQ publisher :mod:`~replicas.sim.zmq_events`) and :mod:`~replicas.sim.personality_trtllm`,
and :mod:`~replicas.sim.replica`, which assembles one replica. See ``docs/emulator.md``.
"""
