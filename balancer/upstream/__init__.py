"""Talking to replicas: :mod:`~balancer.upstream.client` opens streamed requests to a replica (I/O);
:mod:`~balancer.upstream.sse` splits an event stream into its ``data:`` payloads (pure).
"""
