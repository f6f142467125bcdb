"""The service layer under the HTTP and gRPC faces: state shared by both faces, admission, the
policy in force, dispatch (admit → route → forward) and the per-replica lifecycle. The faces
(:mod:`balancer.api`) use it; the composition root :mod:`balancer.app` builds it and them."""
