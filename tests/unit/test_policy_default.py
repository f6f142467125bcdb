"""The shipped default weights (since 2026-11-29: the load ramp to credit 4 plus the held-roots
charge, ``$RC`` of docs/policy-studies.md Parts 16-22) and the ways back to the previous default
(``overlap_credit_loaded`` null, ``root_weight`` 0): a router spec, the config file and
environment, and the decisions they give (docs/policy-studies.md "Part 24")."""

from __future__ import annotations

import pytest
from policy_cases import route, terms_of

from balancer import config
from balancer.errors import ConfigError
from balancer.load.tracker import ReplicaLoad
from balancer.policy import PolicyWeights
from balancer.policy.cost import credit_ramps
from balancer.types import ReplicaId
from loadtests.peers import parse_router

A, B = ReplicaId("a"), ReplicaId("b")
RC = "kvlb:cost+overlap_credit_loaded=4+root_weight=1"
PREVIOUS = "kvlb:cost+overlap_credit_loaded=null+root_weight=0"
PREVIOUS_WEIGHTS = PolicyWeights(overlap_credit_loaded=None, root_weight=0.0)


def weights_of(router: str) -> PolicyWeights:
    """The weights ``kvlb capacity`` and ``kvlb loadtest`` give router ``router`` (its overrides over
    the defaults, as ``sim_config`` and the fleet's config do)."""
    return PolicyWeights().replace(**dict(parse_router(router).weights))


def test_the_shipped_default_is_the_ramp_with_the_held_roots_charge() -> None:
    weights = PolicyWeights()
    assert (weights.overlap_credit, weights.overlap_credit_loaded) == (1.0, 4.0)
    assert (weights.root_weight, weights.root_cap_prompts) == (1.0, 1.0)
    assert credit_ramps(weights)
    assert weights_of(RC) == weights == weights_of("kvlb:cost")


def test_the_previous_default_spec_turns_both_off() -> None:
    spec = parse_router(PREVIOUS)
    assert spec.weights == (("overlap_credit_loaded", None), ("root_weight", 0.0))
    previous = weights_of(PREVIOUS)
    assert previous == PREVIOUS_WEIGHTS
    assert not credit_ramps(previous) and previous.root_weight == 0.0
    # the other fields keep their defaults
    assert previous.replace(overlap_credit_loaded=4.0, root_weight=1.0) == PolicyWeights()
    # credit 1 as the loaded credit is a constant credit too while overlap_credit is 1
    assert not credit_ramps(weights_of("kvlb:cost+overlap_credit_loaded=1+root_weight=0"))


def test_null_parses_only_as_a_value_and_only_optional_weights_take_it() -> None:
    with pytest.raises(ValueError, match="number or null"):
        parse_router("kvlb:cost+root_weight=none")
    with pytest.raises(ValueError, match="number or null"):
        parse_router("kvlb:cost+root_weight")
    with pytest.raises(ConfigError, match="root_weight must be a finite number"):
        weights_of("kvlb:cost+root_weight=null")
    assert weights_of("kvlb:cost+kv_usage_ceiling=0.9+kv_usage_ceiling=null").kv_usage_ceiling is None


def test_the_config_file_and_environment_restore_the_previous_default() -> None:
    by_set = config.load(sets=["policy.weights={overlap_credit_loaded: null, root_weight: 0}"], env={})
    by_env = config.load(
        env={"KVLB_POLICY__WEIGHTS__OVERLAP_CREDIT_LOADED": "null", "KVLB_POLICY__WEIGHTS__ROOT_WEIGHT": "0"}
    )
    for settings in (by_set, by_env):
        assert PolicyWeights.from_dict(settings.policy.weights) == PREVIOUS_WEIGHTS


# A holds 8 of the request's 10 blocks with 12 blocks of prefill queued, B holds nothing and has 1;
# both prefill, so the default's credit is 4 (A: 12 + 10 − 32 = −10) and the previous one's 1
# (A: 14 against B's 11).


def busy_fleet() -> list[ReplicaLoad]:
    return [
        ReplicaLoad(A, pending_prefill_seqs=1, pending_prefill_blocks=12.0),
        ReplicaLoad(B, pending_prefill_seqs=1, pending_prefill_blocks=1.0),
    ]


def test_the_default_keeps_a_busy_fleet_on_the_cache_and_the_previous_one_does_not() -> None:
    default = route({A: 8, B: 0}, busy_fleet())
    assert default.replica == A
    assert {t.overlap_credit for t in default.terms} == {4.0}
    # the ramp's memory (0.2 s since 2026-11-30): a first decision starts the average at its own share
    assert "credit 4 (2/2 replicas prefilling, averaged 1.00 over 0.2 s)" in default.reason
    previous = route({A: 8, B: 0}, busy_fleet(), overlap_credit_loaded=None, root_weight=0.0)
    assert previous.replica == B
    assert {t.overlap_credit for t in previous.terms} == {1.0}
    assert previous.reason == "argmin"


def test_the_previous_default_reads_no_roots_and_the_default_charges_them() -> None:
    loads = [ReplicaLoad(A, pending_prefill_blocks=100.0), ReplicaLoad(B, pending_prefill_blocks=110.0)]
    roots = {A: 5, B: 3}
    charged = route({A: 0, B: 0}, loads, roots=roots, request_blocks=400)
    assert charged.replica == B  # A pays min(1, 1 · (5 − 3)) prompts = 400 blocks
    assert terms_of(charged)[A].root_term == pytest.approx(400.0)
    previous = route(
        {A: 0, B: 0}, loads, roots=roots, request_blocks=400, overlap_credit_loaded=None, root_weight=0.0
    )
    without = route({A: 0, B: 0}, loads, request_blocks=400, overlap_credit_loaded=None, root_weight=0.0)
    assert previous == without
    assert previous.replica == A
    assert all(t.root_term == 0.0 and t.held_roots is None for t in previous.terms)
