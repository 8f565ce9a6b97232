"""The run planner: ranks, the server's placement and every worker's batch size.

Pure functions over plain data (no database), so the plan can be previewed, tested and
explained. The steps:

1. Workers: one per declared GPU of each chosen node, in the order the nodes were given
   (a node that declares none runs one CPU worker).
2. Speeds s_m: the declared GPU model's FP32 TFLOPS from the catalog (`flops`), or measured
   samples/s (`measured`: the node's latest profile of the run's own task where there is one,
   else the agent's reference benchmark), or all equal (`equal`); ps-bz-gc
   defaults to `flops`, or to `measured` where some node declares no GPU. The declared
   models are used even where the agent detected others: that is how a CPU-only machine
   stands in for a GPU node, and the node shows the mismatch (seed 000, section III-A).
3. Batch sizes: n_m = B * s_m / sum(s), rounded by largest remainder after reserving one
   sample each, so that sum(n_m) == B exactly and every n_m >= 1.
4. Server (PS strategies): on `ps_node_id` if given, else on the on-prem node with the
   cheapest links to the workers, as in the paper's testbed (server on an on-prem node);
   clouds only when the run has no on-prem node. Its node may also host a worker.
5. Ranks: the server is rank 0 and the workers 1..W; all-reduce runs have workers 0..W-1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hybridtrain.contract import ALLOCATIONS, PS_BZ_GC, STRATEGIES, is_local_sgd, is_ps, proportional_batch_sizes

# Relative cost of moving a byte over each kind of link, roughly inverse bandwidth: the
# paper's testbed has 1 Gbit/s inside a site and 100 Mbit/s between sites; seed 003 measured
# inter-continent links slower still.
LINK_COST = {"same_node": 0.0, "same_site": 1.0, "same_region": 3.0, "same_continent": 10.0, "far": 30.0}


class PlanError(ValueError):
    """The request cannot be planned; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class GpuSpec:
    """`count` GPUs of a catalog model, with its FP32 TFLOPS."""

    model: str
    count: int
    fp32_tflops: float


@dataclass(frozen=True)
class PlanNode:
    """What the planner needs to know about a node."""

    id: int
    name: str
    site_id: int
    site_kind: str  # onprem, cloud
    provider: str
    region: str | None
    continent: str
    address: str | None
    gpus: tuple[GpuSpec, ...] = ()
    measured_samples_per_s: float | None = None
    cpu_cores: int | None = None


@dataclass(frozen=True)
class PlannedRank:
    """One rank of the plan."""

    rank: int
    role: str  # ps, worker
    node_id: int
    node_name: str
    batch_size: int | None = None
    gpu_model: str | None = None
    gpu_index: int | None = None
    speed: float | None = None
    speed_unit: str | None = None


@dataclass(frozen=True)
class Plan:
    """Where every rank runs and with what share of the global batch."""

    strategy: str
    allocation: str
    global_batch_size: int
    ps_node_id: int | None
    master_addr: str
    workers: list[PlannedRank] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def batch_sizes(self) -> list[int]:
        """The workers' batch sizes in rank order (the trainer's --batch-sizes)."""
        return [w.batch_size for w in self.workers if w.role == "worker" and w.batch_size]


def default_allocation(
    strategy: str, nodes: Sequence[PlanNode] = (), task_speeds: Mapping[int, float] | None = None
) -> str:
    """ps-bz-gc sizes batches by speed (its point), and so does local SGD, whose workers must
    reach each outer step together; every other strategy splits equally.

    They use the catalog's FLOPs when every node declares its GPUs, else measured speeds
    (a CPU-only laptop under `hybridtrain local` declares none).
    """
    if strategy != PS_BZ_GC and not is_local_sgd(strategy):
        return "equal"
    if nodes and not all(n.gpus for n in nodes) and all(_measured(n, task_speeds) for n in nodes):
        return "measured"
    return "flops"


def _measured(node: PlanNode, task_speeds: Mapping[int, float] | None) -> float | None:
    # The run's own task, profiled on the node, beats the agent's reference benchmark.
    return (task_speeds or {}).get(node.id) or node.measured_samples_per_s


def split_batch(global_batch: int, speeds: Sequence[float]) -> list[int]:
    """n_m proportional to s_m, summing exactly to `global_batch`, each at least 1."""
    m = len(speeds)
    if m == 0:
        raise PlanError("node_ids", "the run has no workers")
    if global_batch < m:
        raise PlanError(
            "global_batch_size", f"global_batch_size {global_batch} is smaller than the {m} workers"
        )
    try:
        return proportional_batch_sizes(global_batch, speeds)
    except ValueError as exc:
        raise PlanError("allocation", f"every worker speed must be > 0, got {list(speeds)}") from exc


def link_cost(a: PlanNode, b: PlanNode) -> float:
    """The relative cost of the link between two nodes (LINK_COST)."""
    if a.id == b.id:
        return LINK_COST["same_node"]
    if a.site_id == b.site_id:
        return LINK_COST["same_site"]
    if a.provider == b.provider and a.region is not None and a.region == b.region:
        return LINK_COST["same_region"]
    if a.continent == b.continent:
        return LINK_COST["same_continent"]
    return LINK_COST["far"]


def place_server(candidates: Sequence[PlanNode], worker_nodes: Sequence[PlanNode]) -> PlanNode:
    """The on-prem node (any node if none is on-prem) with the cheapest links to the workers;
    ties go to the node with more CPU cores (the server aggregates on CPU), then the lower id."""
    onprem = [n for n in candidates if n.site_kind == "onprem"]
    pool = onprem or list(candidates)

    def key(node: PlanNode) -> tuple[float, int, int]:
        cost = sum(link_cost(node, w) for w in worker_nodes)
        return (cost, -(node.cpu_cores or 0), node.id)

    return min(pool, key=key)


def _worker_slots(node: PlanNode) -> list[tuple[str | None, int | None, float | None]]:
    # (gpu model, gpu index on the node, fp32 tflops) per worker of this node.
    slots: list[tuple[str | None, int | None, float | None]] = []
    for gpu in node.gpus:
        for _ in range(gpu.count):
            slots.append((gpu.model, len(slots), gpu.fp32_tflops))
    return slots or [(None, None, None)]


def plan_run(
    *,
    strategy: str,
    global_batch_size: int,
    nodes: Sequence[PlanNode],
    allocation: str | None = None,
    ps_node: PlanNode | None = None,
    task_speeds: Mapping[int, float] | None = None,
) -> Plan:
    """Plan a run over `nodes` (in the user's order); `ps_node` pins the server; `task_speeds`
    (node id -> samples/s of the run's task, from task profiles) feed allocation 'measured'."""
    if strategy not in STRATEGIES:
        raise PlanError("strategy", f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not nodes:
        raise PlanError("node_ids", "the run needs at least one node")
    allocation = allocation or default_allocation(strategy, nodes, task_speeds)
    if allocation not in ALLOCATIONS:
        raise PlanError("allocation", f"allocation {allocation!r}: expected one of {', '.join(ALLOCATIONS)}")
    with_server = is_ps(strategy)
    if ps_node is not None and not with_server:
        raise PlanError("ps_node_id", f"{strategy} has no parameter server; leave ps_node_id out")

    slots = [(node, *slot) for node in nodes for slot in _worker_slots(node)]
    if allocation == "equal":
        speeds = [1.0] * len(slots)
        unit = None
    elif allocation == "flops":
        missing = sorted({node.name for node, model, _, _ in slots if model is None})
        if missing:
            raise PlanError(
                "allocation",
                f"allocation 'flops' needs declared GPUs; node(s) {', '.join(missing)} declare "
                "none: declare their GPUs or use allocation 'measured' or 'equal'",
            )
        speeds = [float(tflops) for _, _, _, tflops in slots]  # type: ignore[arg-type]
        unit = "tflops"
    else:
        missing = sorted({n.name for n, *_ in slots if not _measured(n, task_speeds)})
        if missing:
            raise PlanError(
                "allocation",
                f"allocation 'measured' needs a speed measured by the agent; node(s) "
                f"{', '.join(missing)} have none yet",
            )
        speeds = [float(_measured(n, task_speeds)) for n, *_ in slots]  # type: ignore[arg-type]
        unit = "samples_per_s"
    sizes = split_batch(global_batch_size, speeds)

    ranks: list[PlannedRank] = []
    server: PlanNode | None = None
    if with_server:
        server = ps_node or place_server(nodes, [n for n, *_ in slots])
        ranks.append(PlannedRank(rank=0, role="ps", node_id=server.id, node_name=server.name))
    first = len(ranks)
    for i, ((node, model, index, _), size, speed) in enumerate(zip(slots, sizes, speeds, strict=True)):
        ranks.append(
            PlannedRank(
                rank=first + i, role="worker", node_id=node.id, node_name=node.name,
                batch_size=size, gpu_model=model, gpu_index=index,
                speed=speed if unit else None, speed_unit=unit,
            )
        )
    master = server or slots[0][0]
    if not master.address:
        raise PlanError(
            "ps_node_id" if with_server else "node_ids",
            f"node {master.name} (id {master.id}) has no address for the other ranks to reach: "
            "set its address or start its agent",
        )
    return Plan(
        strategy=strategy,
        allocation=allocation,
        global_batch_size=global_batch_size,
        ps_node_id=server.id if server else None,
        master_addr=master.address,
        workers=ranks,
    )
