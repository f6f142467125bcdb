"""Talking to replicas: :mod:`~balancer.upstream.client` opens streamed requests to a replica (I/O)
over kvlb's own HTTP/1.1 connections (:mod:`~balancer.upstream.connections`, I/O), whose answers
:mod:`~balancer.upstream.http1` frames (pure); :mod:`~balancer.upstream.sse` splits an event stream
into its ``data:`` payloads (pure); :mod:`~balancer.upstream.auth` words kvlb's own key towards an
engine (pure); :mod:`~balancer.upstream.stream_usage` asks every stream for usage and takes back out
what the client did not ask for (pure).
"""
