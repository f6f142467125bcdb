"""kvlb: a KV-cache-aware load balancer for LLM inference (import package ``balancer``)."""

__version__ = "0.1.0"
