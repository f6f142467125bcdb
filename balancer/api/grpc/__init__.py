"""The gRPC face (I/O): ``kvlb.v1.Balancer`` and the admin RPCs over the same service state.

* :mod:`~balancer.api.grpc.server`: the server, ``Generate`` streaming and ``Route``.
* :mod:`~balancer.api.grpc.calls`: per-call plumbing (auth, deadlines, errors to status codes).
* :mod:`~balancer.api.grpc.messages`: protobuf ↔ request and response conversion.
* :mod:`~balancer.api.grpc.admin`: the admin RPCs (policy, explain, replicas).
"""
