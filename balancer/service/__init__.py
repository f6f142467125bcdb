"""The service layer under the HTTP and gRPC faces: state shared by both faces, admission, the
policy in force, per-replica lifecycle, and the composition root (:mod:`~balancer.service.app`)."""
