"""``python -m loadtests.tenant_share_cost``: every case is timed and printed, in µs per call."""

from __future__ import annotations

import json

import pytest

from loadtests import tenant_share_cost


def test_every_case_is_timed_on_a_tree_with_tenant_slots(capsys: pytest.CaptureFixture[str]) -> None:
    result = tenant_share_cost.main(["--tenants", "8", "--number", "50", "--repeat", "2"])
    assert json.loads(capsys.readouterr().out) == result
    cases = [
        "request_one_worker",
        "request_global_shared",
        "peer_publish",
        "peer_read_unchanged",
        "request_tenant_shared",
        "request_tenant_shared_new",
    ]
    assert result["tenant_slots"] is True
    assert all(result[case] > 0 for case in cases), result
    assert "peer_read_changed" in result and "request_tenant_shared_peer_busy" in result
    assert result["rate_one_worker"] > 0 and result["rate_shared"] > 0 and "rate_shared_peer_busy" in result


def test_its_bounds_are_enforced() -> None:
    with pytest.raises(SystemExit):
        tenant_share_cost.main(["--number", "0"])
