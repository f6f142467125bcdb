"""After TRT-LLM event loss, kvlb's index holds the engine's very blocks again (identity, not counts).

The emulator's own parts stand in for the engine, in process and in step: its paged prefix cache
(:class:`replicas.sim.cache.PrefixCache`, LRU eviction) and its TRT-LLM event buffer
(:class:`replicas.sim.personality_trtllm.EventBuffer`, the ``POST /kv_cache_events`` JSON, with its
fault that loses events after their ``event_id`` was taken). kvlb's side is real too: the drained
body goes through :class:`~balancer.engines.trtllm.TrtllmDecoder` into a
:class:`~balancer.index.table.PrefixTable`, and each request's ``cached_tokens`` (what the cache
found at admission) is settled as a receipt. Each check compares the set of engine block hashes the
index holds with the set the engine caches.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from balancer.engines.trtllm import SPEC as TRTLLM
from balancer.engines.trtllm import TrtllmDecoder, v1_block_hashes
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.policy.base import PolicyWeights
from balancer.policy.registry import make_policy
from balancer.routing.router import PoolRequest, PoolRouter
from balancer.types import U64_MASK, EngineHash, ReplicaId
from replicas.sim.cache import PrefixCache
from replicas.sim.config import ReplicaConfig
from replicas.sim.faults import FaultSettings, FaultState
from replicas.sim.personality_trtllm import EventBuffer
from replicas.sim.profiles import get_profile
from replicas.wire import trtllm as wire

BS = 4
R = ReplicaId("r2")
STEP_S = 0.05
"""Model seconds between two requests (20/s, the fault suite's rate)."""
POLICY = make_policy("cost")
PREFIXES = 24
"""Shared 3-block prefixes: a pool larger than the 64-block cache holds with their suffixes."""


@dataclass
class Rig:
    cache: PrefixCache
    buffer: EventBuffer
    faults: FaultState
    decoder: TrtllmDecoder
    router: PoolRouter
    rng: random.Random
    prefixes: list[list[int]]
    now: float = 0.0

    @property
    def table(self) -> PrefixTable:
        return self.router.space_of[R].table

    def engine(self) -> set[int]:
        return set(self.buffer._hashes[0].values())

    def index(self) -> set[int]:
        return self.table.engine_hashes(R)

    def request(self) -> None:
        """One request: routed by kvlb, admitted by the engine (its ``cached_tokens``), computed and
        cached (``prompt[:-1]``), released; the drain applied; the receipt settled."""
        self.now += STEP_S
        prompt = [*self.rng.choice(self.prefixes), *(self.rng.randrange(30000, 40000) for _ in range(9))]
        lease = self.router.route(PoolRequest(prompt, POLICY, PolicyWeights(), "q"), self.now)
        held = self.cache.acquire(prompt[:-1], len(prompt), self.now)
        assert held is not None
        self.cache.insert(held, prompt[:-1], self.now)
        self.cache.release(held, self.now)
        self.buffer.on_records(0, self.cache.take_records())
        body = wire.encode_drain(self.buffer.drain())
        self.table.apply(R, self.decoder.decode([body]).events, self.now)
        lease.settle_receipt(held.cached_tokens, self.now)
        lease.release(self.now)


def rig(hold_s: float, seed: int, teach: bool = True, keep_s: float = 0.0) -> Rig:
    config = ReplicaConfig("r2", "trtllm", get_profile("cpu-test"), page_size=BS)
    faults = FaultState(FaultSettings(), random.Random(seed))
    buffer = EventBuffer(config, faults)
    buffer.start()
    cache = PrefixCache(page_size=BS, capacity_blocks=config.capacity_blocks, store_partial=True)
    limits = TableLimits(gap_hold_s=hold_s, gap_keep_s=keep_s)
    router = PoolRouter("sim-test", limits, rng=random.Random(seed))
    router.add_replica(R, BS, TRTLLM.align_mode, TRTLLM.block_hashes if teach else None)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(3 * BS)] for _ in range(PREFIXES)]
    return Rig(cache, buffer, faults, TrtllmDecoder(tokens_per_block=BS), router, rng, prefixes)


def requests_to_identity(
    hold_s: float,
    seed: int,
    teach: bool = True,
    fault_requests: int = 120,
    limit: int = 400,
    keep_s: float = 0.0,
) -> int | None:
    """Requests after the end of a loss of half the events until the index holds exactly the engine's
    blocks (``None``: not within ``limit``)."""
    r = rig(hold_s, seed, teach, keep_s)
    for _ in range(100):
        r.request()
    assert r.index() == r.engine()  # no loss: exact throughout
    r.faults.settings = FaultSettings(drop_events=0.5)
    for _ in range(fault_requests):
        r.request()
    r.faults.settings = FaultSettings()
    assert r.faults.dropped_batches > 0
    for count in range(limit):
        if r.index() == r.engine():
            return count
        r.request()
    return None


@pytest.mark.parametrize("seed", range(8))
def test_after_event_loss_the_index_holds_the_engines_blocks_again(seed: int) -> None:
    """With the gap hold (10 requests here) and receipts teaching blocks under verified engine hashes,
    the index is block for block the engine's within 40 requests of the end of the loss; each check
    compares hash sets, so a count that matches by chance with other blocks does not pass."""
    steps = requests_to_identity(10 * STEP_S, seed)
    assert steps is not None and steps <= 40, steps


def test_the_hold_and_receipts_converge_sooner_than_clearing_at_the_gap() -> None:
    """Side by side on the same request sequences: clearing at each gap (``gap_hold_s`` 0, no
    teaching) waits for the engine to evict every block stored before the last gap."""
    held = [requests_to_identity(10 * STEP_S, seed) for seed in range(8)]
    cleared = [requests_to_identity(0.0, seed, teach=False) for seed in range(8)]
    assert None not in held and None not in cleared
    assert sum(s for s in held if s is not None) < sum(s for s in cleared if s is not None), (held, cleared)


def test_receipts_teach_only_under_hashes_the_engines_events_confirmed() -> None:
    """The engine's hash reproduced: trusted after its events matched it. A wrong one (here: kvlb's
    hashes shifted by one) never matches, is never trusted, and teaches nothing."""
    good = rig(10 * STEP_S, 0)
    for _ in range(60):
        good.request()
    assert good.router.hash_trust(R) is True
    bad = rig(10 * STEP_S, 0)

    def shifted(token_ids: Sequence[int], tokens_per_block: int) -> list[EngineHash]:
        return [EngineHash((h + 1) & U64_MASK) for h in v1_block_hashes(token_ids, tokens_per_block)]

    bad.router.add_replica(R, BS, TRTLLM.align_mode, shifted)
    for _ in range(60):
        bad.request()
    assert bad.router.hash_trust(R) is not True
    assert bad.index() == bad.engine()  # nothing lost, nothing taught: the events alone


def stale_and_missing_at_the_end_of_loss(keep_s: float, seed: int) -> tuple[int, int]:
    """``(stale, missing)`` engine blocks at the end of a loss of half the events (gaps every few
    requests, each restarting the hold): blocks the index holds that the engine does not, and the
    reverse."""
    r = rig(10 * STEP_S, seed, keep_s=keep_s)
    for _ in range(100):
        r.request()
    r.faults.settings = FaultSettings(drop_events=0.5)
    for _ in range(120):
        r.request()
    engine, index = r.engine(), r.index()
    return len(index - engine), len(engine - index)


def test_the_lru_frontier_drops_the_blocks_evicted_in_the_gaps_during_the_loss() -> None:
    """With ``gap_keep_s``, each post-gap eviction of a suspect block drops the suspects kvlb saw used
    less recently (the emulator evicts least recently used leaves first, as TRT-LLM does): at the end
    of the loss far fewer stale blocks remain than with the hold alone, which each new gap restarts.
    The missing ones (stored in lost events) are the receipts' to teach, the same either way."""
    hold = [stale_and_missing_at_the_end_of_loss(0.0, seed) for seed in range(8)]
    lru = [stale_and_missing_at_the_end_of_loss(2.0, seed) for seed in range(8)]
    assert sum(s for s, _ in lru) * 4 < sum(s for s, _ in hold), (lru, hold)
    assert sum(m for _, m in lru) <= sum(m for _, m in hold), (lru, hold)


@pytest.mark.parametrize("seed", range(8))
def test_with_the_lru_frontier_the_index_holds_the_engines_blocks_again(seed: int) -> None:
    steps = requests_to_identity(10 * STEP_S, seed, keep_s=2.0)
    assert steps is not None and steps <= 40, steps
