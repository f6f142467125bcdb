"""vLLM: its :data:`SPEC` (pure). vLLM's ZMQ KV events share SGLang's framing and event schema, so
its decoder is :class:`balancer.engines.sglang.SglangDecoder` (which knows vLLM's own fields: u64 and
``bytes`` hashes, ``lora_name``, ``extra_keys``, KV-cache groups).

vLLM's spec: plain alignment, 16 tokens per block by default, ZMQ events per DP rank with replay, and
load from Prometheus ``/metrics`` only (``vllm:num_requests_running`` and friends); it answers a
request for a model it does not serve with 404, so its model list is checked.
"""

from __future__ import annotations

from balancer.engines.sglang import SglangDecoder, chain_decoder
from balancer.engines.spec import EngineSpec
from balancer.load.scrape import ScrapeTarget, parse_vllm_prometheus, text_parser

SPEC = EngineSpec(
    name="vllm",
    decoder=SglangDecoder,
    chain_decoder=chain_decoder,
    align_mode="plain",
    bigram_align_mode="bigram",
    default_block_size=16,
    transport="zmq",
    scrape_targets=(ScrapeTarget("/metrics", text_parser(parse_vllm_prometheus), prometheus=True),),
    resync_on_unclean_takeover=False,
    checks_model_name=True,
)
