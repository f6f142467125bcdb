"""Pure wire encoders for the engine emulator (no I/O, no clock).

* :mod:`replicas.wire.sglang`: SGLang and vLLM KV-event ZMQ frames (msgpack) and SGLang's page hash.
* :mod:`replicas.wire.vllm`: vLLM's block hash (its events are the ``vllm`` flavour of
  :mod:`replicas.wire.sglang`).
* :mod:`replicas.wire.trtllm`: TRT-LLM ``POST /kv_cache_events`` JSON and the V1 block-key hash.

Written from the engines' documented wire formats and real captures, never from ``balancer.engines``.
"""
