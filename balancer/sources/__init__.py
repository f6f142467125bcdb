"""Event ingestion (does I/O): engine streams → ordered batches → ``PrefixIndex.apply``.

* :mod:`~balancer.sources.base`: the ``EventSource`` seam, ``IngestBatch``, status and backoff.
* :mod:`~balancer.sources.zmq_sub`: SGLang/vLLM ZMQ SUB per DP rank, its catch-up, gap and poll
  replays (:mod:`~balancer.sources.zmq_replay_merge`) over DEALER
  (:mod:`~balancer.sources.zmq_replay`), its connection (:mod:`~balancer.sources.zmq_connection`).
* :mod:`~balancer.sources.trtllm_poll`: the single consumer of TRT-LLM's ``POST /kv_cache_events``.
* :mod:`~balancer.sources.pipeline`: per-replica bounded queue + applier, and ``EventIngest``,
  the owner of every ingest task.
* :mod:`~balancer.sources.build`: sources for a configured replica.

The engine metrics scraper lives in :mod:`balancer.load.scrape`.
"""
