"""Event ingestion (does I/O): engine streams → ordered batches → ``PrefixIndex.apply``.

* :mod:`~balancer.sources.base`: the ``EventSource`` seam, ``IngestBatch``, status and backoff.
* The SGLang/vLLM ZMQ source, one per DP rank (what it does case by case: docs/architecture.md,
  "One ZMQ source, case by case"), in parts:

  * :mod:`~balancer.sources.zmq_sub`: the async shell: the subscription loop, the SUB's monitor
    events (a new connection's catch-up, a lost connection's resync), the live messages drained,
    shed or dropped as a flood, the order's actions applied, a batch accepted with its lag rule;
  * :mod:`~balancer.sources.zmq_parts`: the parts the shell and its replays share, in one object;
  * :mod:`~balancer.sources.zmq_order`: the stream's order and the catch-up's merge rule (pure:
    seqs and digests in, actions out);
  * :mod:`~balancer.sources.zmq_replay_merge`: the catch-up, gap and poll replays, each answer
    merged with the live messages queued on the SUB, and counted;
  * :mod:`~balancer.sources.zmq_replay`: the replay exchange over the DEALER;
  * :mod:`~balancer.sources.replay_poll`: when a silent stream's replay poll is due (pure);
  * :mod:`~balancer.sources.replay_watch`: what ends a replay before its timeout;
  * :mod:`~balancer.sources.zmq_connection`: the SUB, its monitor, the connection's handshake and
    the events endpoint's problems;
  * :mod:`~balancer.sources.zmq_incarnation`: whether a publisher that dropped its connection
    restarted, said once a batch shows it;
  * :mod:`~balancer.sources.read_ahead`: what the SUB queued, and which message to shed;
  * :mod:`~balancer.sources.zmq_messages`: a message decoded (charged to the budget), shed, or
    counted as unusable.
* :mod:`~balancer.sources.trtllm_poll`: the single consumer of TRT-LLM's ``POST /kv_cache_events``.
* :mod:`~balancer.sources.pipeline`: per-replica bounded queue + applier, and ``EventIngest``,
  the owner of every ingest task.
* :mod:`~balancer.sources.build`: sources for a configured replica.

The engine metrics scraper lives in :mod:`balancer.load.scrape`.
"""
