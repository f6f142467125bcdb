"""The HTTP API (I/O): OpenAI endpoints, admin, operational endpoints.

:func:`balancer.api.http.build_web_app` assembles them over a
:class:`balancer.service.state.ServiceState`; :mod:`balancer.app` owns the lifecycle.
"""
