"""GET /api/v1/runs/{id}/cost: a run's bill from its plan, its metrics and the prices in force."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.billing import Continent, EgressKey, InstanceKey, Provider, TrafficClass
from app.billing.table1 import IMPLIED_EGRESS, TABLE1_EGRESS, TABLE1_T4
from app.models import EgressPrice, GpuModel, InstancePrice
from app.models.runs import Run, RunStatus, RunWorker, WorkerStatus
from app.queries.costs import run_bill, run_bills
from app.queries.metrics import store_metrics
from app.queries.price_lookups import DbPriceLookup, PriceHistoryLookup
from app.schemas.runs import MetricRecord
from app.security import hash_secret, new_secret

API = "/api/v1"
GIB = 2**30
HOUR = timedelta(hours=1)


@pytest.fixture
def hybrid_nodes(make_site: Callable[..., dict[str, Any]], make_node: Callable[..., dict[str, Any]]):
    """An on-prem node and a spot GCP T4 node in us-west (the seeded Table 1 region)."""
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="asia")
    gcp = make_site(provider="gcp", region="us-west", zone="us-west-a", continent="north_america")
    onprem = make_node(site_id=lab["id"], gpus=[{"model": "RTX 3090", "count": 1}])
    cloud = make_node(
        site_id=gcp["id"], instance_type="n1-standard-8", spot=True,
        gpus=[{"model": "T4", "count": 1}],
    )
    return onprem, cloud


def _run(session: Session, onprem: dict, cloud: dict, *, started: datetime, hours: float,
         tta_name: str = "time_to_target_s") -> Run:
    """A finished ps-bz-gc run: the server and one worker on-prem, one worker in GCP."""
    finished = started + hours * HOUR
    run = Run(
        name="hybrid", status=RunStatus.succeeded, strategy="ps-bz-gc",
        task="hybridtrain.tasks.digits:smallcnn", global_batch_size=64, max_steps=2, allocation="flops",
        compression={}, metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test",
        launched_at=started, started_at=started, finished_at=finished,
        workers=[
            RunWorker(rank=rank, role=role, node_id=node["id"], node_name=node["name"],
                      batch_size=batch, status=WorkerStatus.succeeded,
                      started_at=started, finished_at=finished)
            for rank, role, node, batch in (
                (0, "ps", onprem, None), (1, "worker", onprem, 40), (2, "worker", cloud, 24),
            )
        ],
    )
    session.add(run)
    session.flush()
    records = []
    for step in (1, 2):
        t = started.timestamp() + step
        for rank, role, name, value, peer in (
            (2, "worker", "bytes_sent", GIB, 0),  # cloud -> on-prem: GCP internet egress
            (0, "ps", "bytes_sent", 3 * GIB, 2),  # on-prem -> cloud: free
            (1, "worker", "bytes_sent", 5 * GIB, 0),  # within the on-prem node
            (0, "ps", "batch_size", 64, None),  # the server's global batch: not extra samples
            (1, "worker", "batch_size", 40, None),
            (2, "worker", "batch_size", 24, None),
            (1, "worker", "compute_s", 3.0, None),
            (1, "worker", "comm_s", 1.0, None),
            (2, "worker", "compute_s", 2.0, None),
            (2, "worker", "comm_s", 4.0, None),
        ):
            records.append(MetricRecord(rank=rank, role=role, step=step, t=t, name=name,
                                        value=value, peer=peer))
    records.append(MetricRecord(rank=0, role="ps", step=2, t=started.timestamp() + 2,
                                name=tta_name, value=42.5))
    store_metrics(session, run_id=run.id, records=records)
    session.commit()
    return run


def test_cost_of_an_onprem_plus_gcp_run_is_bytes_times_the_seeded_rate(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    onprem, cloud = hybrid_nodes
    run = _run(session, onprem, cloud, started=datetime.now(UTC) - 2 * HOUR, hours=1)

    cost = client.get(f"{API}/runs/{run.id}/cost").json()

    # 2 GiB left GCP for on-prem at GCP's seeded internet rate; nothing else is charged.
    gcp_internet = session.scalar(
        select(EgressPrice.usd_per_gb).where(
            EgressPrice.provider == "gcp", EgressPrice.traffic_class == "internet"
        )
    )
    assert cost["egress_usd"] == pytest.approx(2 * gcp_internet, abs=1e-6)
    assert cost["egress_by_class"]["internet"] == pytest.approx(2 * gcp_internet, abs=1e-6)
    assert {k: v for k, v in cost["bytes_by_class"].items() if v} == {
        "internet": 8 * GIB, "intra_zone": 10 * GIB,
    }
    charged = [link for link in cost["egress_by_link"] if link["usd"] > 0]
    assert [(link["src"], link["dst"], link["payer"]) for link in charged] == [
        (cloud["name"], onprem["name"], "gcp")
    ]
    # One hour of a spot n1-standard-8 with a T4 at Table 1's GC spot price; on-prem costs 0.
    by_node = {n["node"]: n for n in cost["compute_by_node"]}
    assert by_node[cloud["name"]]["basis"] == "spot"
    assert by_node[cloud["name"]]["usd"] == pytest.approx(0.18, abs=1e-6)
    assert by_node[onprem["name"]]["usd"] == 0
    assert cost["total_usd"] == pytest.approx(cost["egress_usd"] + 0.18, abs=1e-6)
    assert cost["final"] is True and cost["unpriced"] == []


def test_a_node_renamed_after_its_run_is_billed_links_and_all_under_its_name_now(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    onprem, cloud = hybrid_nodes
    run = _run(session, onprem, cloud, started=datetime.now(UTC) - 2 * HOUR, hours=1)
    assert client.patch(f"{API}/nodes/{cloud['id']}", json={"name": "gcp-t4-renamed"}).status_code == 200

    cost = client.get(f"{API}/runs/{run.id}/cost")

    assert cost.status_code == 200
    charged = [(link["src"], link["dst"]) for link in cost.json()["egress_by_link"] if link["usd"] > 0]
    assert charged == [("gcp-t4-renamed", onprem["name"])]
    assert "gcp-t4-renamed" in {n["node"] for n in cost.json()["compute_by_node"]}


def test_cost_counts_worker_samples_and_granularity_per_worker(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    run = _run(session, *hybrid_nodes, started=datetime.now(UTC) - 2 * HOUR, hours=1)

    cost = client.get(f"{API}/runs/{run.id}/cost").json()

    assert cost["samples"] == 2 * (40 + 24)
    assert cost["samples_per_s"] == pytest.approx(128 / 3600)
    assert cost["usd_per_million_samples"] == pytest.approx(cost["total_usd"] / 128e-6, rel=1e-5)
    assert cost["time_to_target_s"] == 42.5
    # Compute 3+3 and 2+2 s against communication 1+1 and 4+4 s.
    assert cost["granularity"] == {"compute_s": 10.0, "comm_s": 10.0, "ratio": 1.0}
    ratios = sorted(g["ratio"] for g in cost["granularity_by_worker"].values())
    assert ratios == [0.5, 3.0]


def test_cost_keeps_the_prices_in_force_when_the_run_started(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    run = _run(session, *hybrid_nodes, started=datetime.now(UTC) - 2 * HOUR, hours=1)
    before = client.get(f"{API}/runs/{run.id}/cost").json()
    price = session.scalar(
        select(EgressPrice).where(
            EgressPrice.provider == "gcp", EgressPrice.traffic_class == "internet"
        )
    )

    revised = client.patch(f"{API}/prices/egress/{price.id}", json={"usd_per_gb": 5.0})
    after = client.get(f"{API}/runs/{run.id}/cost").json()

    assert revised.status_code == 201, revised.text
    assert after["egress_usd"] == before["egress_usd"]


def test_cost_of_an_unknown_run_is_404(client: TestClient) -> None:
    assert client.get(f"{API}/runs/999999/cost").status_code == 404


def test_seeded_egress_prices_are_the_billing_table(session: Session) -> None:
    seeded = {
        (row.provider.value, row.traffic_class.value, row.continent and row.continent.value):
            Decimal(str(row.usd_per_gb))
        for row in session.scalars(select(EgressPrice).where(EgressPrice.seeded))
    }
    table = {
        (r.key.provider.value, r.key.traffic_class.value, r.key.scope and r.key.scope.value):
            r.usd_per_gb
        for r in TABLE1_EGRESS + IMPLIED_EGRESS
        if r.key.provider.value in ("gcp", "aws", "azure")
    }
    assert {k: v for k, v in seeded.items() if k[0] in ("gcp", "aws", "azure")} == table


def test_seeded_t4_prices_are_the_billing_table(session: Session) -> None:
    rows = session.execute(
        select(InstancePrice, GpuModel.name)
        .join(GpuModel, GpuModel.id == InstancePrice.gpu_model_id)
        .where(InstancePrice.seeded)
    ).all()
    seeded = {
        row.provider.value: (row.instance_type, Decimal(str(row.spot_usd_per_h)),
                             Decimal(str(row.on_demand_usd_per_h)))
        for row, gpu in rows if gpu == "T4"
    }
    table = {
        provider.value: (itype, price.spot_usd_per_hour, price.on_demand_usd_per_hour)
        for provider, (itype, price) in TABLE1_T4.items()
    }
    assert seeded == table


def test_cost_reads_the_legacy_time_to_accuracy_of_old_runs(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    run = _run(session, *hybrid_nodes, started=datetime.now(UTC) - 2 * HOUR, hours=1,
               tta_name="time_to_accuracy_s")

    cost = client.get(f"{API}/runs/{run.id}/cost").json()

    assert cost["time_to_target_s"] == 42.5


def test_cost_keeps_the_deprecated_time_to_accuracy_field_equal_to_time_to_target(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    run = _run(session, *hybrid_nodes, started=datetime.now(UTC) - 2 * HOUR, hours=1)

    cost = client.get(f"{API}/runs/{run.id}/cost").json()

    assert cost["time_to_accuracy_s"] == cost["time_to_target_s"] == 42.5


# -- many runs' bills together ---------------------------------------------------------------------


def test_bills_of_many_runs_together_equal_each_runs_own_bill(
    client: TestClient, session: Session, hybrid_nodes
) -> None:
    onprem, cloud = hybrid_nodes
    early = _run(session, onprem, cloud, started=datetime.now(UTC) - 5 * HOUR, hours=1)
    price = session.scalar(select(EgressPrice).where(EgressPrice.provider == "gcp", EgressPrice.traffic_class == "internet"))
    assert client.patch(f"{API}/prices/egress/{price.id}", json={"usd_per_gb": 5.0}).status_code == 201
    late = _run(session, onprem, cloud, started=datetime.now(UTC) + timedelta(seconds=1), hours=1)
    now = datetime.now(UTC) + 2 * HOUR

    together = run_bills(session, [early, late], now=now)

    alone = {run.id: run_bill(session, run=run, now=now) for run in (early, late)}
    assert together == alone
    assert together[late.id].egress_usd > together[early.id].egress_usd  # each at its own start's prices


@pytest.mark.parametrize("month", [1, 2, 3, 4])
def test_a_price_history_answers_each_instant_as_the_database_does(session: Session, month: int) -> None:
    # gcp internet from Europe: an any-continent series from January, Europe's own from March.
    for continent, starts, usd in ((None, 1, 0.11), (None, 2, 0.12), ("europe", 3, 0.2)):
        session.add(EgressPrice(provider="gcp", traffic_class="internet", continent=continent, usd_per_gb=usd,
                                effective_from=datetime(1990, starts, 1, tzinfo=UTC)))
    session.flush()
    at = datetime(1990, month, 1, tzinfo=UTC) - timedelta(days=10)
    key = EgressKey(Provider.gcp, TrafficClass.internet, Continent.europe)
    t4 = InstanceKey(Provider.gcp, "us-west", "n1-standard-8", "T4", 1)

    history, database = PriceHistoryLookup(session), DbPriceLookup(session)

    assert history.egress_usd_per_gb(key, at) == database.egress_usd_per_gb(key, at)
    assert history.instance_price(t4, datetime.now(UTC)) == database.instance_price(t4, datetime.now(UTC))
