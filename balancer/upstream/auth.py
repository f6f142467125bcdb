"""kvlb's own credentials towards an engine (pure): the header carrying a replica's API key
(``replicas[].api_key_file``/``api_key_env``) and the words of a refusal, which name where the key
came from, never the key. Every call kvlb makes to an engine sends it: requests
(:mod:`~balancer.upstream.client`), health and ``/v1/models`` probes, load scrapes, TRT-LLM's
``/kv_cache_events`` drain."""

from __future__ import annotations

from balancer.config.settings import Secret

REFUSED_CALLER_STATUSES = frozenset({401, 403, 407})
"""A replica's answers that refuse its caller, kvlb, not the client: kvlb never forwards the client's
credentials, so an engine started with an API key (vLLM's ``--api-key``, SGLang's ``--api-key``)
that kvlb has not been given, or a proxy before it that wants some, refuses every request. Relayed,
they told the client its own key was wrong (the SDK raises ``AuthenticationError`` and does not
retry); they are a replica failure instead: retried elsewhere, counted against the breaker, then 502
naming the cause."""


def engine_auth_headers(api_key: Secret | None) -> dict[str, str]:
    """The header carrying kvlb's own key to a replica (``{}`` without one)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key.value}"}


def refused_caller(status: int, api_key: Secret | None) -> str:
    """Why a replica answered ``status`` (401, 403, 407) to kvlb, naming where its key came from,
    never the key."""
    if api_key is None:
        return (
            f"replica answered {status}, refusing kvlb, not the client (kvlb sends this replica no"
            " credentials: does the engine, or a proxy before it, require an API key? set"
            " api_key_file or api_key_env)"
        )
    return (
        f"replica answered {status}, refusing kvlb's API key (from {api_key.source}), not the client:"
        " is it the key the engine was started with?"
    )


def key_refused_reason(api_key: Secret | None) -> str:
    """Why a replica whose engine refuses kvlb (401, 403, 407 on a guarded path) is out of routing,
    naming where the key came from, never the key."""
    source = "none sent: set api_key_file or api_key_env" if api_key is None else api_key.source
    return f"engine refuses kvlb's key ({source})"
