"""GET /runs/{id}/cost charges each node only for the time it was part of the run: from its
rank's start (or join) to its loss, leave or end, by the run's membership events."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models.runs import Run, RunStatus, RunWorker, WorkerStatus
from app.queries.events import record_event
from app.security import hash_secret, new_secret

API = "/api/v1"
GC_T4_SPOT_USD_PER_H = 0.18  # Table 1 of seed 003, seeded by migration 0002
T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_each_node_is_billed_only_while_its_rank_was_part_of_the_run(
    client: TestClient, session: Session, make_site: Callable[..., dict[str, Any]],
    make_node: Callable[..., dict[str, Any]],
) -> None:
    gcp = make_site(provider="gcp", region="us-west", zone="us-west-a", continent="north_america")
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="north_america")
    server = make_node(site_id=lab["id"], gpus=[{"model": "RTX 3090", "count": 1}])
    spot = {"site_id": gcp["id"], "instance_type": "n1-standard-8", "spot": True}
    lost, added, rejoined = make_node(**spot), make_node(**spot), make_node(**spot)
    # A 120-minute run. Rank 1 is lost at minute 30 (its process lives on, cut off, to the
    # end); rank 2's node is added at minute 60 and admitted at 61; rank 3 is lost at 20 and
    # re-admitted at 50.
    ranks = [(0, "ps", server, at(0)), (1, "worker", lost, at(0)), (2, "worker", added, at(60)),
             (3, "worker", rejoined, at(0))]
    run = Run(
        name="elastic", status=RunStatus.succeeded, strategy="ps", task="hybridtrain.tasks.digits:smallcnn",
        global_batch_size=64, max_steps=100, allocation="equal", compression={},
        metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test",
        launched_at=at(0), started_at=at(0), finished_at=at(120),
        workers=[RunWorker(rank=rank, role=role, node_id=node["id"], node_name=node["name"],
                           status=WorkerStatus.succeeded, started_at=started, finished_at=at(120))
                 for rank, role, node, started in ranks],
    )
    session.add(run)
    session.flush()
    record_event(session, run=run, kind="worker_lost", subject=3, t=at(20), source="trainer")
    record_event(session, run=run, kind="worker_lost", subject=1, t=at(30), source="trainer")
    record_event(session, run=run, kind="worker_lost", subject=1, t=at(31))  # the control plane saw it too
    record_event(session, run=run, kind="worker_joined", subject=3, t=at(50), source="trainer")
    record_event(session, run=run, kind="worker_joined", subject=2, t=at(61), source="trainer")
    session.commit()

    cost = client.get(f"{API}/runs/{run.id}/cost").json()

    minutes = {n["node"]: n["seconds"] / 60 for n in cost["compute_by_node"]}
    usd = {n["node"]: n["usd"] for n in cost["compute_by_node"]}
    assert minutes == {server["name"]: 120, lost["name"]: 30, added["name"]: 59, rejoined["name"]: 20 + 70}
    assert usd[lost["name"]] == pytest.approx(GC_T4_SPOT_USD_PER_H * 30 / 60, abs=1e-6)
    assert usd[added["name"]] == pytest.approx(GC_T4_SPOT_USD_PER_H * 59 / 60, abs=1e-6)
    assert usd[rejoined["name"]] == pytest.approx(GC_T4_SPOT_USD_PER_H * 90 / 60, abs=1e-6)
    assert cost["compute_usd"] == pytest.approx(GC_T4_SPOT_USD_PER_H * (30 + 59 + 90) / 60, abs=1e-5)
