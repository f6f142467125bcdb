"""A replica being removed is listed once: as a replica or as a kept drain, never as neither
(2026-12-01, h-keptdrains).

:class:`~balancer.service.lifecycle.ReplicaLifecycle` removes a drained replica in steps with the
loop let run between them: its health record goes first (its drain kept), its pool entry last, once
its blocks have left the index. ``GET /admin/replicas`` and gRPC ``ListReplicas`` leave out a
replica whose record is gone, but the kept drains left out every replica a pool still lists: in
between, the replica was in neither list (a gathered read of ``kvlb serve --workers N`` whose
sibling did not answer showed no kept drain, ``e2e/test_kept_drains_workers.py``). A real
:class:`~balancer.app.Balancer` with file discovery over the emulator; the removal's first step is
the lifecycle's own call (:meth:`~balancer.health.book.HealthBook.remove`), the pool entry left as
the lifecycle leaves it until its last step.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from kvlb_harness import MODEL, replica_entry, wait_for
from test_discovery_app import balancer_over, two_replicas
from test_drain_keep import kept_on_both_faces

from balancer.types import ReplicaId


async def test_a_replica_whose_record_is_gone_but_pool_entry_stays_is_listed_as_a_kept_drain(
    tmp_path: Path,
) -> None:
    listed = tmp_path / "replicas.yaml"
    overrides = {
        "discovery__kind": "file",
        "discovery__file": str(listed),
        "discovery__reload_interval_s": 0.1,
        "listen__grpc_port": 0,
    }
    async with two_replicas(**overrides) as (static, extra, settings):
        listed.write_text(yaml.safe_dump({"pools": [{"model": MODEL, "replicas": [replica_entry(extra)]}]}))
        async with balancer_over(static, extra, settings) as setup:

            async def r1_listed() -> bool:
                return "r1" in await setup.views()

            await wait_for("r1 discovered", r1_listed, timeout_s=10)
            url = f"{setup.balancer.url}/admin/replicas/r1/drain"
            async with setup.session.post(url, json={"reason": "rack move"}) as response:
                assert response.status == 200, await response.text()
            state = setup.balancer.state
            assert state is not None
            r1 = ReplicaId("r1")
            # the removal's first step (ReplicaLifecycle.remove); its last, the pool entry, not yet
            assert state.health.remove(r1, state.monotonic(), state.wall_clock()) is not None
            assert any(r1 in pool.replicas for pool in state.pools.values())
            assert "r1" not in await setup.views()
            http_kept, grpc_kept = await kept_on_both_faces(setup)
            # before: {} and {} (the pool still listed r1, so its kept drain was left out)
            assert list(http_kept) == ["r1"] and list(grpc_kept) == ["r1"], http_kept
            assert http_kept["r1"]["drain"]["reason"] == "rack move", http_kept
            assert grpc_kept["r1"].text == http_kept["r1"]["text"]
