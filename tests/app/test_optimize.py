"""The placement search on cases whose best answer is known: a slow-linked node left out for
cost, the server placed where uploads are not billed, the fastest plan, a budget nobody meets,
and bad input named by field."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import EgressKey, InstanceKey, InstancePrice, NodeUsage, Provider, Site, StaticPriceTable, TrafficClass
from app.errors import InvalidFieldError
from app.perfmodel.data import DataSetSpec
from app.perfmodel.optimize import Candidate, Goal, NoPlanError, optimize
from app.perfmodel.predict import LinkSpec, NodeSpec, TaskSpec, predict
from hybridtrain.contract import proportional_batch_sizes

T0 = datetime(2024, 1, 1, tzinfo=UTC)
ONPREM = Site("lab", "onprem", "onprem", "europe")
CLOUD = Site("gcp-eu", "cloud", "gcp", "europe", "europe-west1", "b")
FAR = Site("gcp-au", "cloud", "gcp", "oceania", "australia-southeast1", "a")
PRICES = StaticPriceTable(
    egress=[(EgressKey(Provider.gcp, cls), T0, Decimal(rate)) for cls, rate in
            ((TrafficClass.internet, "0.12"), (TrafficClass.to_oceania, "0.15"), (TrafficClass.intra_zone, "0"))],
    instances=[(InstanceKey(Provider.gcp, region, "g1", "T4", 1), T0, InstancePrice(Decimal("0.3"), Decimal("0.9")))
               for region in ("europe-west1", "australia-southeast1")],
)
TASK = TaskSpec(params=3_000_000, dense_params=3000)
SITE_IDS = {"lab": 1, "gcp-eu": 2, "gcp-au": 3}


def cand(i: int, site: Site, sps: float = 100.0, usd: str = "0.5") -> Candidate:
    node = NodeSpec(i, f"n{i}", SITE_IDS[site.name], sps, worker_compress_s=0.01, server_compress_s=0.02,
                    aggregate_s=0.005)
    if site.kind == "onprem":
        usage = NodeUsage(f"n{i}", site, 0, amortised_usd_per_hour=Decimal(usd))
    else:
        usage = NodeUsage(f"n{i}", site, 0, instance_type="g1", gpu_model="T4")
    return Candidate(node, usage)


def links_for(cands, **mbps):
    """LAN 1000 Mbit/s within a site; across sites 100 Mbit/s, or mbps[site name] for a site."""
    out = {}
    for a in cands:
        for b in cands:
            if a is b:
                continue
            if a.site == b.site:
                out[(a.node.node_id, b.node.node_id)] = LinkSpec(1000, 1.0, "assumed")
            else:
                rate = min(mbps.get(a.site.name, 100), mbps.get(b.site.name, 100))
                out[(a.node.node_id, b.node.node_id)] = LinkSpec(rate, 50.0, "assumed")
    return out


def run(cands, **kw):
    kw.setdefault("links", links_for(cands))
    return optimize(cands, task=TASK, prices=PRICES, at=T0, **kw)


def test_cost_goal_leaves_out_a_node_whose_granularity_is_below_one():
    # One node alone misses the deadline; two meet it; the far node's link is so slow that its
    # communication outweighs its compute, so adding it costs more per sample (and time).
    cands = [cand(1, CLOUD, sps=10), cand(2, CLOUD, sps=10), cand(3, FAR, sps=10)]
    links = links_for(cands, **{"gcp-au": 0.5})
    result = run(cands, links=links, global_batch=64, goal="cost", strategies=["ps-gc"], max_steps=100,
                 deadline_s=400)
    full = result.baseline
    far_row = next(r for r in full.prediction.per_worker if r["node_id"] == 3)
    assert far_row["granularity"] < 1
    assert result.left_out == (3,) and result.best.node_ids == (1, 2)
    assert "leaving out n3" in result.explanation
    assert f"{full.usd_per_million:.3g} -> {result.best.usd_per_million:.3g}" in result.explanation


def _server_case():
    # Two good cloud workers; two slow nodes at the same price that can only serve: one on-prem,
    # one in the workers' cloud zone. Links are equal everywhere, so only the price of the
    # workers' uploads tells the two server places apart.
    cands = [cand(1, ONPREM, sps=0.01, usd="0.9"), cand(2, CLOUD, sps=10), cand(3, CLOUD, sps=10),
             cand(4, CLOUD, sps=0.01)]
    links = {(a.node.node_id, b.node.node_id): LinkSpec(1000, 1.0, "assumed")
             for a in cands for b in cands if a is not b}
    return cands, links


def test_server_goes_where_cloud_uploads_are_not_internet_egress():
    cands, links = _server_case()
    result = run(cands, links=links, global_batch=64, goal="cost", strategies=["ps"], servers=[1, 4])
    assert result.best.node_ids == (2, 3)
    assert result.best.server_node_id == 4
    assert result.best.costs.egress_usd_per_h == 0
    assert "The server goes on n4: on n1, the next best place" in result.explanation, result.explanation


def test_server_on_prem_makes_every_cloud_upload_internet_egress():
    cands, links = _server_case()
    result = run(cands, links=links, global_batch=64, goal="cost", strategies=["ps"], servers=[1])
    assert result.best.server_node_id == 1 and 1 not in result.best.node_ids
    uploads = sum(b for s, d, b in result.best.prediction.bytes_per_step if d == 1)
    steps_per_h = 3600 / result.best.prediction.step_s
    assert result.best.costs.bytes_by_class_per_hour["internet"] >= uploads * steps_per_h * 0.999
    assert result.best.costs.egress_usd_per_h == pytest.approx(uploads * steps_per_h / 2**30 * 0.12, rel=1e-3)


def test_fastest_goal_uses_every_node_that_adds_throughput():
    cands = [cand(1, ONPREM), cand(2, ONPREM), cand(3, ONPREM)]
    result = run(cands, global_batch=96, goal=Goal.fastest, strategies=["ps-gc", "allreduce"])
    assert result.best.node_ids == (1, 2, 3)
    assert result.best.prediction.samples_per_s == max(
        p.prediction.samples_per_s for p in [result.best, *result.runners_up])


def test_fastest_goal_picks_ps_bz_gc_on_unequal_nodes():
    cands = [cand(1, ONPREM, sps=400), cand(2, ONPREM, sps=100)]
    result = run(cands, global_batch=100, goal="fastest", strategies=["ps-gc", "ps-bz-gc"])
    assert result.best.strategy == "ps-bz-gc"
    assert [n for _, n in result.best.workers] == proportional_batch_sizes(100, [400, 100])


def test_a_budget_nobody_meets_names_the_field_and_carries_the_cheapest_plan():
    cands = [cand(1, CLOUD), cand(2, CLOUD)]
    with pytest.raises(NoPlanError) as err:
        run(cands, global_batch=32, goal="cost", budget_usd_per_h=0.5, strategies=["allreduce", "ps"])
    assert err.value.field == "budget_usd_per_h"
    cheapest = err.value.cheapest
    assert cheapest.usd_per_h == pytest.approx(0.9)
    assert "$0.90/h" in err.value.message


def test_budget_excludes_the_plans_that_cost_more():
    cands = [cand(1, CLOUD, sps=100), cand(2, CLOUD, sps=100)]
    result = run(cands, global_batch=32, goal="fastest", budget_usd_per_h=1.0, strategies=["allreduce"])
    assert result.best.node_ids in ((1,), (2,))
    assert result.best.usd_per_h <= 1.0


def test_a_deadline_nobody_meets_names_the_field_and_the_fastest_plan():
    cands = [cand(1, ONPREM, sps=10)]
    with pytest.raises(NoPlanError) as err:
        run(cands, global_batch=10, goal="cost", deadline_s=5, max_steps=100, strategies=["allreduce"])
    assert err.value.field == "deadline_s"
    assert err.value.cheapest.prediction.time_to_max_steps_s == pytest.approx(100.0)


def test_a_deadline_needs_max_steps():
    with pytest.raises(InvalidFieldError) as err:
        run([cand(1, ONPREM)], global_batch=10, goal="cost", deadline_s=5)
    assert err.value.field == "max_steps"


def test_empty_candidates_are_refused():
    with pytest.raises(InvalidFieldError) as err:
        run([], global_batch=10, goal="cost")
    assert err.value.field == "candidates"


def test_an_unknown_goal_is_refused():
    with pytest.raises(InvalidFieldError) as err:
        run([cand(1, ONPREM)], global_batch=10, goal="cheapest")
    assert err.value.field == "goal"


def test_a_server_outside_the_candidates_is_refused():
    with pytest.raises(InvalidFieldError) as err:
        run([cand(1, ONPREM)], global_batch=10, goal="cost", servers=[9])
    assert err.value.field == "servers"


def test_more_candidates_than_exhaustive_search_fall_back_to_greedy_removal(monkeypatch):
    import app.perfmodel.optimize as opt

    monkeypatch.setattr(opt, "EXHAUSTIVE_MAX", 2)
    cands = [cand(1, CLOUD), cand(2, CLOUD), cand(3, FAR)]
    links = links_for(cands, **{"gcp-au": 0.5})
    result = run(cands, links=links, global_batch=64, goal="fastest", strategies=["ps"])
    assert result.best.node_ids == (1, 2)


def test_result_to_dict_carries_plan_prediction_and_explanation():
    import json

    result = run([cand(1, ONPREM), cand(2, CLOUD)], global_batch=16, goal="cost", strategies=["ps-gc"])
    d = json.loads(json.dumps(result.to_dict()))
    assert d["best"]["prediction"]["strategy"] == "ps-gc" and d["explanation"]


def test_chosen_plan_matches_a_direct_prediction():
    cands = [cand(1, ONPREM), cand(2, ONPREM)]
    links = links_for(cands)
    result = run(cands, links=links, global_batch=32, goal="fastest", strategies=["ps"], servers=[1])
    direct = predict("ps", workers=[(c.node, n) for c, (_, n) in zip(cands, result.best.workers)],
                     server=cands[0].node, links=links, task=TASK)
    assert result.best.prediction.samples_per_s == pytest.approx(direct.samples_per_s)


# -- the data sets' reads ---------------------------------------------------------------------

# 100 MiB in the workers' GCP zone; read from on-prem it is GCP's internet egress at $0.12/GiB.
NEAR_DATA = DataSetSpec("images", Site("store of images", "cloud", "gcp", "europe", "europe-west1", "b"),
                        100 * 2**20, 32_000)


def _data_case():
    # n1 on-prem at $0.80/h, n2 in the store's zone at $0.90/h, equally fast: one node is the
    # cheapest plan (two pay for two nodes and their link), and without data n1 is that node.
    return [cand(1, ONPREM, sps=100, usd="0.8"), cand(2, CLOUD, sps=100)]


def test_without_a_data_set_the_cheaper_node_wins_and_no_data_is_priced():
    result = run(_data_case(), global_batch=32, goal="cost", strategies=["allreduce"], max_steps=1000)
    assert result.best.node_ids == (1,)
    assert result.best.costs.data_usd == 0 and result.best.costs.data_usd_per_h == 0
    assert "data sets" not in result.explanation


def test_the_data_sets_reads_put_the_worker_beside_the_store():
    cands = _data_case()
    kw = {"global_batch": 32, "goal": "cost", "strategies": ["allreduce"], "max_steps": 1000, "datasets": [NEAR_DATA]}
    result = run(cands, **kw)
    onprem = run(cands[:1], **kw).best
    assert result.best.node_ids == (2,)
    assert result.best.costs.data_usd == 0  # same zone: intra-zone, free
    # n1 fetches the 100 MiB once over internet egress: $0.0117; spread over the run's 32,000
    # samples that is $0.366/1M, on top of $0.80/h at 360,000 samples/h ($2.222/1M).
    data_usd = 100 / 1024 * 0.12
    assert onprem.costs.data_usd == pytest.approx(data_usd)
    assert onprem.usd_per_million == pytest.approx(0.8 / 360_000 * 1e6 + data_usd / 32_000 * 1e6)
    assert result.best.usd_per_million == pytest.approx(0.9 / 360_000 * 1e6)
    assert "Reading the data sets costs $0 over the run here (0.0977 GB intra-zone)" in result.explanation
