"""The planner: exact batch splits, server placement as in the paper, ranks per strategy."""

from __future__ import annotations

import pytest

from app.planner import GpuSpec, PlanError, PlanNode, link_cost, place_server, plan_run, split_batch


def node(id: int, *, site: int = 1, kind: str = "onprem", gpus: tuple[GpuSpec, ...] = (), measured: float | None = None,
         provider: str = "onprem", region: str | None = None, continent: str = "europe", cores: int | None = None) -> PlanNode:
    return PlanNode(
        id=id, name=f"n{id}", site_id=site, site_kind=kind, provider=provider, region=region,
        continent=continent, address=f"10.0.0.{id}", gpus=gpus, measured_samples_per_s=measured,
        cpu_cores=cores,
    )


RTX3090TI = GpuSpec("RTX 3090 Ti", 1, 40.0)
RTX3090 = GpuSpec("RTX 3090", 1, 35.6)
V100 = GpuSpec("V100 PCIe", 1, 14.0)


@pytest.mark.parametrize(
    ("batch", "speeds"),
    [(256, [40.0, 35.6, 14.0, 14.0]), (7, [1.0, 1.0, 1.0]), (64, [1000.0, 1.0, 1.0]), (3, [5.0, 1.0, 1.0]),
     (1000, [0.3, 0.3, 0.4])],
)
def test_split_batch_sums_exactly_with_every_share_at_least_one(batch, speeds):
    sizes = split_batch(batch, speeds)
    assert sum(sizes) == batch and min(sizes) >= 1
    # Each share is within one sample of the exact proportion of what is left after the
    # guaranteed one each.
    spare = batch - len(speeds)
    for n, s in zip(sizes, speeds, strict=True):
        assert abs((n - 1) - spare * s / sum(speeds)) < 1


def test_split_batch_refuses_a_batch_smaller_than_the_workers():
    with pytest.raises(PlanError, match="smaller than the 4 workers") as info:
        split_batch(3, [1, 1, 1, 1])
    assert info.value.field == "global_batch_size"


def test_ps_bz_gc_places_the_server_on_prem_and_sizes_batches_by_catalog_flops():
    # The paper's testbed: two on-prem nodes (3090 Ti, 3090) and two cloud V100s.
    nodes = [
        node(1, gpus=(RTX3090TI,), cores=8), node(2, gpus=(RTX3090,), cores=16),
        node(3, site=2, kind="cloud", provider="gcp", gpus=(V100,)),
        node(4, site=2, kind="cloud", provider="gcp", gpus=(V100,)),
    ]
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=256, nodes=nodes)

    assert plan.allocation == "flops"
    server = plan.workers[0]
    # Both on-prem nodes have the same links; the one with more cores wins the tie.
    assert (server.rank, server.role, server.node_id) == (0, "ps", 2)
    assert plan.master_addr == "10.0.0.2"
    workers = plan.workers[1:]
    assert [w.rank for w in workers] == [1, 2, 3, 4]
    assert [w.node_id for w in workers] == [1, 2, 3, 4]
    assert [w.batch_size for w in workers] == split_batch(256, [40.0, 35.6, 14.0, 14.0])
    assert plan.batch_sizes == [w.batch_size for w in workers]
    assert workers[0].batch_size > workers[1].batch_size > workers[2].batch_size


def test_server_goes_where_most_workers_are_close():
    onprem_alone = node(1, site=1)
    onprem_with_peers = node(2, site=3)
    peers = [node(5, site=3, kind="cloud", provider="gcp"), node(6, site=3, kind="cloud", provider="gcp")]
    chosen = place_server([onprem_alone, onprem_with_peers, *peers], [onprem_alone, onprem_with_peers, *peers])
    assert chosen.id == 2


def test_server_falls_back_to_cloud_nodes_when_the_run_has_no_on_prem_node():
    a = node(1, kind="cloud", provider="aws", region="us-east-1", continent="north_america")
    b = node(2, site=2, kind="cloud", provider="aws", region="us-east-1", continent="north_america")
    c = node(3, site=3, kind="cloud", provider="gcp", region="europe-west1")
    assert place_server([a, b, c], [a, b, c]).id in (1, 2)
    assert link_cost(a, b) < link_cost(a, c)


def test_pinned_server_may_also_host_a_worker_or_stand_alone():
    nodes = [node(1, gpus=(RTX3090,)), node(2, gpus=(V100,))]
    on_worker = plan_run(strategy="ps", global_batch_size=10, nodes=nodes, ps_node=nodes[1])
    assert on_worker.ps_node_id == 2 and [w.node_id for w in on_worker.workers] == [2, 1, 2]
    alone = plan_run(strategy="ps", global_batch_size=10, nodes=nodes, ps_node=node(9))
    assert alone.workers[0].node_id == 9 and alone.master_addr == "10.0.0.9"
    # Plain PS splits equally whatever the GPUs.
    assert alone.batch_sizes == [5, 5]


def test_allreduce_has_no_server_and_refuses_one():
    nodes = [node(1, gpus=(RTX3090,)), node(2, gpus=(V100,))]
    plan = plan_run(strategy="allreduce", global_batch_size=9, nodes=nodes)
    assert [(w.rank, w.role) for w in plan.workers] == [(0, "worker"), (1, "worker")]
    assert plan.ps_node_id is None and plan.master_addr == "10.0.0.1"
    with pytest.raises(PlanError, match="no parameter server"):
        plan_run(strategy="allreduce", global_batch_size=9, nodes=nodes, ps_node=nodes[0])


def test_a_node_with_several_gpus_runs_one_worker_per_gpu():
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=64,
                    nodes=[node(1, gpus=(GpuSpec("A100 80GB", 2, 19.5), GpuSpec("T4", 1, 8.1)))])
    workers = plan.workers[1:]
    assert [(w.gpu_model, w.gpu_index) for w in workers] == [("A100 80GB", 0), ("A100 80GB", 1), ("T4", 2)]
    assert sum(plan.batch_sizes) == 64


def test_measured_allocation_uses_the_agents_speeds_and_needs_them():
    nodes = [node(1, gpus=(RTX3090,), measured=300.0), node(2, gpus=(RTX3090,), measured=100.0)]
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=40, nodes=nodes, allocation="measured")
    assert plan.batch_sizes == [30, 10]
    assert plan.workers[1].speed_unit == "samples_per_s"
    with pytest.raises(PlanError, match="n2 have none yet"):
        plan_run(strategy="ps-bz-gc", global_batch_size=40, allocation="measured",
                 nodes=[nodes[0], node(2, gpus=(RTX3090,))])


def test_flops_allocation_names_nodes_without_declared_gpus():
    with pytest.raises(PlanError, match="node\\(s\\) n2 declare none") as info:
        plan_run(strategy="ps-bz-gc", global_batch_size=40, allocation="flops",
                 nodes=[node(1, gpus=(RTX3090,)), node(2)])
    assert info.value.field == "allocation"


def test_ps_bz_gc_defaults_to_measured_speeds_on_machines_that_declare_no_gpu():
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=40,
                    nodes=[node(1, measured=300.0), node(2, measured=100.0)])
    assert plan.allocation == "measured" and plan.batch_sizes == [30, 10]


def test_a_server_without_an_address_cannot_be_planned():
    lonely = PlanNode(id=1, name="n1", site_id=1, site_kind="onprem", provider="onprem", region=None,
                      continent="europe", address=None, gpus=(RTX3090,))
    with pytest.raises(PlanError, match="has no address"):
        plan_run(strategy="ps", global_batch_size=4, nodes=[lonely])


def test_measured_allocation_prefers_the_tasks_profiled_speeds():
    nodes = [node(1, gpus=(RTX3090,), measured=100.0), node(2, gpus=(RTX3090,), measured=300.0)]
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=40, nodes=nodes, allocation="measured",
                    task_speeds={1: 300.0, 2: 100.0})
    assert plan.batch_sizes == [30, 10]


def test_a_task_profile_stands_in_for_a_missing_benchmark():
    nodes = [node(1, measured=None), node(2, measured=100.0)]
    plan = plan_run(strategy="ps-bz-gc", global_batch_size=40, nodes=nodes, task_speeds={1: 300.0})
    assert plan.allocation == "measured" and plan.batch_sizes == [30, 10]
