"""Talking to replicas (I/O): :mod:`~balancer.upstream.client` opens streamed requests to a replica."""
