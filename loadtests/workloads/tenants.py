"""The shared-prefix "tenants" workload, after llm-d's benchmark (pure).

Each of T tenants has a long shared context (its system message); each of its U users has a fixed
question (the user message), re-asked many times. A request picks a tenant and a user uniformly at
random, so the prompt is ``context(tenant) + question(tenant, user)``: every request of a tenant
shares the context as an exact prefix (of the rendered chat text and of its token ids), and a
re-asked question shares the whole prompt.

Sizing rule. The prefix demand, the tokens a fleet must hold to serve every prompt from cache, is
``D = T · (C + U · Q)`` with C the context and Q the question size. Cache-aware routing only shows
when D is well over one replica's KV capacity K (else every replica can hold everything) yet fits
the fleet of R replicas (else nothing can). llm-d's run used D ≈ 6·K ≈ 0.73 of the fleet (150
tenants × (6,000 + 5 × 1,200) tokens on 8 pods of 307k tokens). :meth:`TenantsWorkload.for_capacity`
picks ``T = floor(min(overflow · K, fleet_fill · R · K) / (C + U · Q))``. The defaults (T = 8, C =
6,000, U = 4, Q = 1,000) give D = 80,000 tokens, 1.2× the 65,536-token ``cpu-small-llama`` emulator
pool; prompts are ~7,000 tokens, so the replica's context limit must allow that.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar

from loadtests.workloads.base import (
    ChatMessage,
    PromptFormat,
    RequestSpec,
    check_format,
    check_positive,
    make_tags,
)
from loadtests.workloads.text import chat_spec, random_text, tokens_per_word, words_for_tokens


@dataclass(frozen=True, slots=True)
class TenantsWorkload:
    """T tenants × U users; shared per-tenant context, fixed per-user questions."""

    name: ClassVar[str] = "tenants"

    tenants: int = 8
    """Number of tenants (distinct shared contexts)."""

    users_per_tenant: int = 4
    """Distinct questions per tenant; each is re-asked, so the full prompt repeats too."""

    context_tokens: int = 6000
    """Shared context per tenant, in tokens (approximate for ``chat``, exact for ``tokens``)."""

    question_tokens: int = 1000
    """Question per user, in tokens (approximate for ``chat``)."""

    num_requests: int = 1000
    """Requests generated; the stream ends after this many."""

    max_tokens: int = 100
    """Completion tokens asked for per request."""

    prompt_format: PromptFormat = "chat"
    """``chat`` (messages, text) or ``tokens`` (toy token ids to ``/v1/completions``)."""

    def __post_init__(self) -> None:
        check_positive(
            self.name,
            tenants=self.tenants,
            users_per_tenant=self.users_per_tenant,
            context_tokens=self.context_tokens,
            question_tokens=self.question_tokens,
            num_requests=self.num_requests,
            max_tokens=self.max_tokens,
        )
        check_format(self.name, self.prompt_format)

    @property
    def prefix_demand_tokens(self) -> int:
        """``T · (C + U · Q)``: tokens needed to hold every tenant's context and every question."""
        return self.tenants * (self.context_tokens + self.users_per_tenant * self.question_tokens)

    @staticmethod
    def tenants_for_capacity(
        capacity_tokens: int,
        *,
        replicas: int,
        context_tokens: int = 6000,
        users_per_tenant: int = 4,
        question_tokens: int = 1000,
        overflow: float = 6.0,
        fleet_fill: float = 0.75,
    ) -> int:
        """Tenants whose demand is ``min(overflow · K, fleet_fill · R · K)``, at least 1 (module docs)."""
        check_positive(
            "tenants_for_capacity",
            capacity_tokens=capacity_tokens,
            replicas=replicas,
            overflow=overflow,
            fleet_fill=fleet_fill,
        )
        target_tokens = min(overflow * capacity_tokens, fleet_fill * replicas * capacity_tokens)
        per_tenant_tokens = context_tokens + users_per_tenant * question_tokens
        return max(1, math.floor(target_tokens / per_tenant_tokens))

    def for_capacity(
        self, capacity_tokens: int, *, replicas: int, overflow: float = 6.0, fleet_fill: float = 0.75
    ) -> TenantsWorkload:
        """This workload with ``tenants`` set by :meth:`tenants_for_capacity` from its own sizes."""
        tenants = self.tenants_for_capacity(
            capacity_tokens,
            replicas=replicas,
            context_tokens=self.context_tokens,
            users_per_tenant=self.users_per_tenant,
            question_tokens=self.question_tokens,
            overflow=overflow,
            fleet_fill=fleet_fill,
        )
        return replace(self, tenants=tenants)

    def generate(self, rng: random.Random) -> Iterator[RequestSpec]:
        per_word = tokens_per_word(self.prompt_format)
        context_words = words_for_tokens(self.context_tokens, per_word)
        question_words = words_for_tokens(self.question_tokens, per_word)
        contexts = [ChatMessage("system", random_text(rng, context_words)) for _ in range(self.tenants)]
        questions = [
            [ChatMessage("user", random_text(rng, question_words)) for _ in range(self.users_per_tenant)]
            for _ in range(self.tenants)
        ]
        for n in range(self.num_requests):
            tenant = rng.randrange(self.tenants)
            user = rng.randrange(self.users_per_tenant)
            yield chat_spec(
                f"{self.name}-{n}",
                (contexts[tenant], questions[tenant][user]),
                prompt_format=self.prompt_format,
                max_tokens=self.max_tokens,
                session_id=f"tenant{tenant}-user{user}",
                tags=make_tags(tenant=tenant, user=user),
            )
