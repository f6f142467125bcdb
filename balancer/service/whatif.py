"""Counterfactual replay (pure): re-run a policy on recorded decisions (``POST /admin/whatif``).

Each :class:`~balancer.service.decisions.DecisionRecord` keeps what the policy read when it decided:
the candidates, the prefix match per replica, the load snapshot. :func:`replay` calls the real
policy code (:mod:`balancer.policy`) on those inputs with proposed weights (or another policy) and
compares the result with what was decided: the share of decisions that change, the predicted cached
tokens and hit rate, the spread of assigned prefill across replicas, per-replica traffic shares, and
a sample of changed decisions with both sides' cost terms.

Randomness is coupled, so that unchanged weights reproduce every recorded decision: the replay's
``random.Random`` (:class:`ReplayRng`) keeps the recorded replica when
a tie-break or a uniform choice offers it, re-draws the recorded sample of ``power_of_two``, and for
softmax sampling returns the middle of the recorded replica's probability interval (a common random
number: with other weights the same draw lands where the new probabilities put it).

The cache: each record's prefix matches are those of the traffic as it was actually routed; a
change that moves a prefix to another replica would, from then on, find that replica warm and the
first one colder. :class:`~balancer.service.replay_cache.ReplayCache` follows the cache the replayed
decisions would have built from the records' prefix marks, and each decision is scored on those
matches; where a replica's KV pool size is known, a placement that holds more there than the real
run did evicts its least recently placed prefixes. The load: :class:`~balancer.service.replay_load.ReplayLoad`
moves each changed decision's load from the recorded replica to the replayed one for the span the
real request held it (:attr:`DecisionRecord.prefill_s`, ``held_s``), so a replica that gains
traffic looks busier to the next decisions. What it cannot know (docs/operations.md, "What-if"):
how long a moved request would have taken on its new replica, and the engines' scraped gauges.
The credit ramp's memory (``ramp_memory_s``) is one such state: each record keeps the average the
router had before it and when it was advanced (``RouteRequest.ramp_share``, ``ramp_at_s``), so
another memory is replayed on the history's averages, one decision at a time.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from balancer.policy.base import Policy, PolicyWeights
from balancer.service.decisions import DecisionRecord, terms_by_replica
from balancer.service.replay_cache import MAX_MARKS_HELD, ReplayCache
from balancer.service.replay_load import MAX_LOAD_MOVES, ReplayLoad
from balancer.types import Decision, ReplicaId

NOT_SAMPLED = "not sampled"
"""``power_of_two``'s exclusion reason of the candidates it did not sample."""


class ReplayRng(random.Random):
    """A ``random.Random`` that prefers the recorded outcome (see the module docstring). One is
    seeded per replay and :meth:`prefer` points it at each record in turn (seeding a Mersenne
    Twister per record would cost more than most policy calls)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self._prefer: str | None = None
        self._sampled: list[str] = []
        self._sampling = False
        self._point: float | None = None

    def prefer(self, recorded: Decision) -> None:
        """Couple the next policy call to ``recorded``."""
        self._prefer = recorded.replica
        self._sampling = False
        self._point = None
        terms = recorded.terms
        if any(t.excluded == NOT_SAMPLED for t in terms):
            self._sampling = True
            self._sampled = [t.replica for t in terms if t.excluded is None]
        if any(t.probability is not None and t.probability < 1.0 for t in terms):
            low = 0.0
            for t in terms:
                if t.excluded is not None:
                    continue
                p = t.probability or 0.0
                if t.replica == recorded.replica:
                    self._point = low + p / 2
                    break
                low += p

    def choice(self, seq: Any) -> Any:
        if self._prefer in seq:
            return self._prefer
        return super().choice(seq)

    def sample(self, population: Any, k: int, *, counts: Any = None) -> list[Any]:
        if self._sampling and len(self._sampled) == k and all(r in population for r in self._sampled):
            return list(self._sampled)
        return super().sample(population, k)

    def random(self) -> float:
        if self._point is not None:
            return self._point
        return super().random()


@dataclass(slots=True)
class _Side:
    """Running totals of one side (before: as decided; after: as replayed)."""

    cached_tokens: int = 0
    prefill_blocks: dict[ReplicaId, int] = field(default_factory=dict)
    decisions: dict[ReplicaId, int] = field(default_factory=dict)

    def add(self, decision: Decision) -> None:
        replica = decision.replica
        self.cached_tokens += decision.cached_tokens
        uncached = max(0, decision.request_blocks - decision.overlap_blocks)
        self.prefill_blocks[replica] = self.prefill_blocks.get(replica, 0) + uncached
        self.decisions[replica] = self.decisions.get(replica, 0) + 1

    def summary(self, prompt_tokens: int, replicas: Sequence[ReplicaId]) -> dict[str, Any]:
        blocks = [self.prefill_blocks.get(r, 0) for r in replicas]
        mean = sum(blocks) / len(blocks) if blocks else 0.0
        return {
            "predicted_cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "load_spread": max(blocks) / mean if mean > 0 else 1.0,
            "prefill_blocks": sum(blocks),
            "prompt_tokens": prompt_tokens,
        }


@dataclass(frozen=True, slots=True)
class WhatIfResult:
    """What :func:`replay` found; :meth:`to_json` is the ``/admin/whatif`` answer."""

    pool: str
    policy: str
    weights: PolicyWeights
    decisions: int
    changed: int
    before: dict[str, Any]
    after: dict[str, Any]
    replicas: list[dict[str, Any]]
    sample: list[dict[str, Any]]
    notes: list[str]
    tallies: dict[str, int] = field(default_factory=dict)
    """The counts the notes give (``other_config``, ``other_memory``, ``fresh``), so that
    :func:`merge_answers` can say them for several workers' replays."""
    model: dict[str, int] = field(default_factory=dict)
    """What the replay's models did (``load_moved``: decisions whose load moved to their replayed
    replica or changed size there; ``load_moved_seqs``: their sequences, each counting its OpenAI
    ``n``; ``evicted_marks``: prefix marks evicted where the replay filled a
    replica's pool beyond the real run): they depend on the replay's own decisions, so several
    workers' replays add theirs up."""

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "policy": self.policy,
            "weights": self.weights.to_dict(),
            "decisions": self.decisions,
            "changed": self.changed,
            "changed_share": self.changed / self.decisions if self.decisions else 0.0,
            "before": self.before,
            "after": self.after,
            "replicas": self.replicas,
            "sample": self.sample,
            "notes": self.notes,
            "tallies": self.tallies,
            "model": self.model,
        }


def replay(
    pool: str,
    records: Sequence[DecisionRecord],
    policy: Policy,
    weights: PolicyWeights,
    *,
    sample: int = 10,
    pause: Callable[[], None] | None = None,
    pause_every: int = 8,
    live: tuple[str, PolicyWeights] | None = None,
    max_cache_marks: int = MAX_MARKS_HELD,
    max_load_moves: int = MAX_LOAD_MOVES,
) -> WhatIfResult:
    """Re-run ``policy`` with ``weights`` on ``records`` (oldest first) and compare with what was
    decided. ``sample``: most changed decisions described (the newest ones). ``pause`` is called
    every ``pause_every`` records (the shell passes a short sleep, so that a replay in a worker
    thread lets the event loop's thread take the GIL). ``live``: the policy's name and the weights in
    force now (the console passes the live ones); a note counts the records made under others (a
    policy change in the window, an ``x-kvlb-weights`` override), whose "before" is not what the
    live policy decides. ``None``: the replayed ones stand for the live ones."""
    before, after = _Side(), _Side()
    replicas: dict[ReplicaId, None] = {}
    prompt_tokens = changed = 0
    other_config = other_memory = fresh = 0
    changes: list[tuple[DecisionRecord, Decision]] = []
    rng = ReplayRng(len(records))
    cache = ReplayCache(max_marks=max_cache_marks)
    load = ReplayLoad(max_moves=max_load_moves)
    unmarked = in_flight = 0
    live_policy, live_weights = live if live is not None else (policy.name, weights)
    for i, record in enumerate(records):
        if pause is not None and i and i % pause_every == 0:
            pause()
        inputs = record.inputs
        replicas.update(dict.fromkeys(inputs.request.candidates))
        rng.prefer(record.decision)
        marks = inputs.request.prefix_marks
        if not marks:
            unmarked += 1
        overlap = cache.overlap(inputs.request.candidates, inputs.overlap, marks)
        snapshot = load.load(inputs.load)
        decision = policy(inputs.request, overlap, snapshot, weights, rng)
        chosen = snapshot.replicas.get(decision.replica)
        cache.place(
            record.decision.replica,
            decision.replica,
            marks,
            capacity_blocks=None if chosen is None else chosen.capacity_blocks,
            held_blocks=inputs.overlap.held_blocks.get(decision.replica),
        )
        load.move(
            inputs.load.now,
            record.decision,
            decision,
            prefill_tokens=record.prompt_tokens - record.cached_tokens,
            decode_blocks=record.decode_blocks,
            block_size=inputs.load.block_size_tokens,
            prefill_s=record.prefill_s,
            held_s=record.held_s,
            sequences=record.sequences,
        )
        if record.held_s is None:
            in_flight += 1
        prompt_tokens += inputs.request.prompt_tokens
        before.add(record.decision)
        after.add(decision)
        if record.policy != live_policy or record.weights != live_weights:
            other_config += 1
        recorded = record.weights.ramp_memory_s
        if recorded != weights.ramp_memory_s:
            if weights.ramp_memory_s and not recorded:
                fresh += 1  # recorded with the memory off: no average to advance
            else:
                other_memory += 1
        if decision.replica != record.decision.replica:
            changed += 1
            changes.append((record, decision))
            if len(changes) > 2 * max(sample, 1):
                del changes[: len(changes) - max(sample, 1)]
    order = list(replicas)
    n = len(records)
    shares: list[dict[str, Any]] = []
    for replica in order:
        b = before.decisions.get(replica, 0) / n if n else 0.0
        a = after.decisions.get(replica, 0) / n if n else 0.0
        shares.append(
            {
                "replica": replica,
                "before_share": b,
                "after_share": a,
                "delta_share": a - b,
                "before_decisions": before.decisions.get(replica, 0),
                "after_decisions": after.decisions.get(replica, 0),
                "before_prefill_blocks": before.prefill_blocks.get(replica, 0),
                "after_prefill_blocks": after.prefill_blocks.get(replica, 0),
            }
        )
    shares.sort(key=lambda s: (-s["delta_share"], s["replica"]))
    described = (
        [_describe(record, decision) for record, decision in reversed(changes[-sample:])]
        if sample > 0
        else []
    )
    return WhatIfResult(
        pool=pool,
        policy=policy.name,
        weights=weights,
        decisions=n,
        changed=changed,
        before=before.summary(prompt_tokens, order),
        after=after.summary(prompt_tokens, order),
        replicas=shares,
        sample=described,
        notes=_notes(
            n,
            other_config,
            policy.name,
            weights,
            other_memory,
            fresh,
            unmarked + cache.unmodelled,
            in_flight,
            load.unmodelled,
        ),
        tallies={
            "other_config": other_config,
            "other_memory": other_memory,
            "fresh": fresh,
            "unmarked": unmarked,
            "unmodelled": cache.unmodelled,
            "load_unmodelled": load.unmodelled,
            "in_flight": in_flight,
        },
        model={"load_moved": load.moved, "load_moved_seqs": load.moved_seqs, "evicted_marks": cache.evicted},
    )


def _describe(record: DecisionRecord, decision: Decision) -> dict[str, Any]:
    return {
        "id": record.id,
        "ts": record.wall_ts,
        "tenant": record.tenant,
        "prompt_tokens": record.prompt_tokens,
        "before": _side_json(record.decision),
        "after": _side_json(decision),
    }


def _side_json(decision: Decision) -> dict[str, Any]:
    return {
        "replica": decision.replica,
        "policy": decision.policy,
        "reason": decision.reason,
        "predicted_cached_tokens": decision.cached_tokens,
        "terms": terms_by_replica(decision.terms),
    }


def _notes(
    n: int,
    other_config: int,
    policy: str,
    weights: PolicyWeights,
    other_memory: int,
    fresh: int = 0,
    unmarked: int = 0,
    in_flight: int = 0,
    load_unmodelled: int = 0,
) -> list[str]:
    notes = [
        "the prefix matches follow the cache the replayed decisions would have built (a moved prefix "
        "warms its new replica and leaves the old one), with the evictions the real run saw and, where "
        "a replica's KV pool size is known, those it would have made had the replay put more there "
        "(least recently placed first); the load follows the replayed decisions: a moved request's "
        "load leaves its recorded replica for its new one for as long as the real request held it "
        "(the recorded spans: how long it would have taken there is not modelled), while the engines' "
        "scraped gauges (queue length, KV usage) stay as recorded"
    ]
    if in_flight:
        notes.append(
            f"{in_flight} of {n} decisions were still in flight when the replay was asked (or were "
            "recorded without the spans of their load): a moved one holds its load to the end"
        )
    if load_unmodelled:
        notes.append(
            f"{load_unmodelled} of {n} decisions were not moved in the load model, {MAX_LOAD_MOVES:,} "
            "moved requests being in flight at once: they read the load as recorded"
        )
    if unmarked:
        notes.append(
            f"{unmarked} of {n} decisions carry no prefix marks (recorded before 2026-12-01, or with no "
            "key space among their candidates) or came after the cache model was full (1,000,000 "
            "marks): they are re-scored on the prefix matches recorded, the cache the actual decisions "
            "built, which counts a moved request of a shared prefix as a miss"
        )
    if n == 0:
        notes.append("no decisions recorded for this pool yet (console.decision_ring_size)")
    if other_config:
        notes.append(
            f"{other_config} of {n} decisions were made under another policy or other weights than the "
            "live ones (a policy change in the window, or an x-kvlb-weights override): their 'before' is "
            "not what the live policy decides"
        )
    if other_memory:
        notes.append(
            f"{other_memory} of {n} decisions were made with another ramp_memory_s: each "
            "is replayed from the average busy share the router had recorded before it and the time it "
            "was recorded (the history's averages), not the averages the replayed memory would have "
            "carried from decision to decision"
        )
    if fresh:
        notes.append(
            f"{fresh} of {n} decisions were recorded with the ramp's memory off (ramp_memory_s null "
            "or 0, the default before 2026-11-30): they carry no average, so each is replayed with "
            "the average started at its own busy share, the instant share it was made with; what the "
            "memory would change over the history is not shown"
        )
    if policy in ("random", "power_of_two") or weights.temperature > 0:
        notes.append("a sampling policy: random draws are coupled to the recorded ones, not reproduced")
    return notes


def merge_answers(answers: list[dict[str, Any]], sample: int) -> dict[str, Any]:
    """Several workers' replays (:meth:`WhatIfResult.to_json`, each marked with its ``worker``, of
    the same pool, policy and weights) as one: decisions, changes, cached and prompt tokens and each
    replica's decisions and prefill blocks add, and so do the models' counts (``model``); shares,
    hit rates and the load spread are recomputed from those sums; the sample is the newest
    ``sample`` changed decisions of all, each marked with its worker; the notes are said again for
    the summed counts."""
    first = answers[0]
    n = sum(int(a["decisions"]) for a in answers)
    changed = sum(int(a["changed"]) for a in answers)
    replicas: dict[str, dict[str, int]] = {}
    for answer in answers:
        for row in answer["replicas"]:
            into = replicas.setdefault(row["replica"], dict.fromkeys(_REPLICA_COUNTS, 0))
            for name in _REPLICA_COUNTS:
                into[name] += int(row[name])
    shares: list[dict[str, Any]] = []
    for replica, counts in replicas.items():
        b = counts["before_decisions"] / n if n else 0.0
        a = counts["after_decisions"] / n if n else 0.0
        shares.append(
            {"replica": replica, "before_share": b, "after_share": a, "delta_share": a - b, **counts}
        )
    shares.sort(key=lambda s: (-s["delta_share"], s["replica"]))
    sides = {}
    for side in ("before", "after"):
        cached = sum(int(a[side]["predicted_cached_tokens"]) for a in answers)
        prompt = sum(int(a[side]["prompt_tokens"]) for a in answers)
        blocks = [counts[f"{side}_prefill_blocks"] for counts in replicas.values()]
        mean = sum(blocks) / len(blocks) if blocks else 0.0
        sides[side] = {
            "predicted_cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "load_spread": max(blocks) / mean if mean > 0 else 1.0,
            "prefill_blocks": sum(blocks),
            "prompt_tokens": prompt,
        }
    described = [
        {**described, "worker": answer["worker"]} for answer in answers for described in answer["sample"]
    ]
    described.sort(key=lambda d: (d["ts"], d["id"]), reverse=True)
    tallies = {name: sum(int(a["tallies"][name]) for a in answers) for name in first["tallies"]}
    model = {
        name: sum(int(a.get("model", {}).get(name, 0)) for a in answers) for name in first.get("model", {})
    }
    weights = PolicyWeights.from_dict(first["weights"])
    notes = _notes(
        n,
        tallies["other_config"],
        first["policy"],
        weights,
        tallies["other_memory"],
        tallies["fresh"],
        tallies.get("unmarked", 0) + tallies.get("unmodelled", 0),
        tallies.get("in_flight", 0),
        tallies.get("load_unmodelled", 0),
    )
    return {
        **first,
        "decisions": n,
        "changed": changed,
        "changed_share": changed / n if n else 0.0,
        "before": sides["before"],
        "after": sides["after"],
        "replicas": shares,
        "sample": described[:sample],
        "notes": notes,
        "tallies": tallies,
        "model": model,
    }


_REPLICA_COUNTS = ("before_decisions", "after_decisions", "before_prefill_blocks", "after_prefill_blocks")
