"""A run's bill counts only its share of a node: the GPUs it holds over the node's, each
divided by the runs that shared it at launch. Hand-computed cases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.billing import (
    Continent, InstanceKey, InstancePrice, InvalidUsageError, NodeUsage, Provider, RunUsage, Site, SiteKind,
    StaticPriceTable, compute_bill,
)
from app.models import Node, NodeGpu, RunWorker
from app.queries.costs import node_share, run_usage
from app.queries.runs import get_run

AT = datetime(2026, 1, 1, tzinfo=UTC)
HOUR = 3600.0
ZONE = Site(name="gcp/us-central1/a", kind=SiteKind.cloud, provider=Provider.gcp,
            continent=Continent("north_america"), region="us-central1", zone="us-central1-a")
# A 4-GPU instance at $4.00/h on demand.
FOUR_T4 = InstanceKey(Provider.gcp, "us-central1", "n1-standard-32", "T4", 4)
PRICES = StaticPriceTable(instances=[(FOUR_T4, AT - timedelta(days=1), InstancePrice(None, Decimal("4.00")))])


def _bill(share: str | Decimal) -> Decimal:
    node = NodeUsage("big", ZONE, HOUR, instance_type="n1-standard-32", gpu_model="T4", gpu_count=4,
                     share=Decimal(share))
    return compute_bill(RunUsage(priced_at=AT, nodes=[node], samples=1, duration_s=HOUR), PRICES).compute_usd


def test_a_run_holding_one_of_four_gpus_pays_a_quarter_of_the_node():
    assert _bill("0.25") == Decimal("1.00")


def test_a_run_holding_the_whole_node_pays_all_of_it():
    assert _bill("1") == Decimal("4.00")


def test_a_share_outside_zero_to_one_is_refused_naming_the_node():
    with pytest.raises(InvalidUsageError, match=r"nodes\[big\]\.share"):
        _bill("1.5")


def _node(gpus: int) -> Node:
    return Node(name="n", gpus=[NodeGpu(count=gpus)] if gpus else [])


def _rank(gpu_index: int | None, sharers: int = 1) -> RunWorker:
    return RunWorker(rank=0, role="worker", node_name="n", gpu_index=gpu_index, sharers=sharers)


def test_one_gpu_of_four_is_a_quarter():
    assert node_share(_node(4), [_rank(0)]) == Fraction(1, 4)


def test_a_gpu_shared_by_two_runs_counts_half():
    # GPU 0 alone, GPU 1 with another run: (1 + 1/2) of 4 GPUs.
    assert node_share(_node(4), [_rank(0), _rank(1, sharers=2)]) == Fraction(3, 8)


def test_a_server_without_a_gpu_pays_the_whole_node():
    assert node_share(_node(4), [_rank(None)]) == 1


def test_a_node_without_gpus_is_paid_whole():
    assert node_share(_node(0), [_rank(None)]) == 1


def test_the_second_of_two_sharing_runs_counts_half_the_node(online_node, client, dispatched, session):
    a = online_node()  # one T4
    ids = []
    for _ in range(2):
        body = run_body([a], strategy="allreduce", share_gpus=True)
        ids.append(client.post(f"{API}/runs", json=body).json()["id"])
        a.event(ids[-1], rank=0, role="worker", event="started", pid=len(ids))
    session.expire_all()
    first, second = (get_run(session, run_id=i) for i in ids)
    later = datetime.now(UTC) + timedelta(hours=1)

    assert [n.share for n in run_usage(session, run=first, now=later).nodes] == [Decimal(1)]
    assert [n.share for n in run_usage(session, run=second, now=later).nodes] == [Decimal("0.5")]
    for rid in ids:
        client.post(f"{API}/runs/{rid}/cancel")
