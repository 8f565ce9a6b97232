"""The performance model: one training step of each strategy, and the cost of an hour of it.

Pure functions over plain figures (no database, no torch): a node's speed and compression
costs come from its task profile, a link's bandwidth and round trip from probes (or declared or
assumed values), the bytes from `hybridtrain.wiresize`, the prices through
`app.billing.compute_bill`. docs/predict.md writes out every equation and assumption; in short:

1. compute_m = n_m / samples_per_s_m (the profile's rate, linear in the batch).
2. PS strategies: the step is max_m(compute_m + compress_m + upload_m) + server + max_m(download_m);
   `pipeline_chunks` C > 1 overlaps upload, server and download: the first chunk through every
   stage, then (C - 1) times the slowest stage. Compressed strategies' densities are the
   trainer's adaptive rule at its fixed point; warm-up steps are dense.
3. allreduce: DDP's ring over the slowest link, partly hidden behind the backward pass;
   allreduce-powersgd: rank-r factors after its start step, not overlapped.
4. Transfers that run at once share a pipe: a node's own link (incast at the server, its
   copies of the update) and, between two sites, the one site-to-site pipe of each direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from datetime import datetime

from app.billing import (
    LinkBytes,
    NodeUsage,
    PriceLookup,
    RunUsage,
    WorkerTime,
    compute_bill,
    granularity,
)
from app.errors import InvalidFieldError
from hybridtrain.contract import ALLREDUCE, ALLREDUCE_POWERSGD, STRATEGIES, adapt_densities, is_ps
from hybridtrain.contract import compresses as contract_compresses
from hybridtrain.wiresize import grad_frame_bytes, kept_for, update_frame_bytes

# A worker on the server's own node talks to it through the loopback interface.
LOOPBACK_MBPS = 20_000.0
LOOPBACK_RTT_MS = 0.05
# The share of a step's compute that is the backward pass, during which DDP may all-reduce the
# buckets already done (forward is ~1/3 of forward + backward for the CNNs we train).
BACKWARD_SHARE = 2 / 3
# How much of that window the ring actually hides. Fitted once, on the paper testbed
# (widecnn, 4 CPU-emulated workers, 100 Mbit/s WAN: step 3.49 s = compute 2.56 s + ring 1.68 s
# - 0.45 * 1.68 s): the gradient's largest tensor fills one bucket early in backward, but the
# ring's reductions and sends compete with the backward pass for the same cores.
DDP_OVERLAP = 0.45
# Without the task's matrix shapes, PowerSGD's factors of a compressed part of n elements are
# taken as POWERSGD_FACTOR_SCALE * rank * sqrt(n) elements: +52 % on widecnn (4 matrices),
# -26 % on resnet18 (21 matrices); `TaskSpec.matrix_shapes` makes it exact.
POWERSGD_FACTOR_SCALE = 8.0
# PyTorch's PowerSGD compresses a matrix only where its factors are 2x smaller.
POWERSGD_MIN_COMPRESSION_RATE = 2.0
# Evaluation runs the forward pass only: about 3x the training rate (forward ~ 1/3 of a step).
EVAL_SPEEDUP = 3.0
_MBIT = 1e6


class PredictError(InvalidFieldError):
    """The inputs of a prediction are inconsistent; `field` names the one at fault."""


@dataclass(frozen=True)
class NodeSpec:
    """A node as the model sees it: the task's samples/s there, and what compression costs there
    (the task profile's worker_compress_s, server_compress_s, aggregate_s, in seconds per step)."""

    node_id: int
    name: str
    site_id: int
    samples_per_s: float
    worker_compress_s: float = 0.0
    server_compress_s: float = 0.0
    aggregate_s: float = 0.0

    @classmethod
    def from_profile(cls, node_id: int, name: str, site_id: int, profile: Mapping) -> NodeSpec:
        """From the task profile's result measured on that node."""
        return cls(node_id, name, site_id, float(profile["samples_per_s"]),
                   float(profile.get("worker_compress_s") or 0.0), float(profile.get("server_compress_s") or 0.0),
                   float(profile.get("aggregate_s") or 0.0))


@dataclass(frozen=True)
class TaskSpec:
    """The model's size: all parameters, the part that travels dense, the float buffers.
    `matrix_shapes` (rows, cols) of the compressible matrices, when known, make PowerSGD's bytes
    exact."""

    params: int
    dense_params: int
    buffer_numel: int = 0
    matrix_shapes: tuple[tuple[int, int], ...] = ()
    # The held-out set's size; given, evaluation every eval_every steps is part of the time.
    eval_samples: int | None = None

    @property
    def sparse_params(self) -> int:
        """The compressed part."""
        return max(0, self.params - self.dense_params)

    @classmethod
    def from_profile(cls, profile: Mapping, *, with_eval: bool = True) -> TaskSpec:
        """From a task profile's result (trainer.profile's JSON)."""
        eval_samples = profile.get("eval_samples") if with_eval else None
        shapes = tuple((int(r), int(c)) for r, c in profile.get("matrix_shapes") or ())
        return cls(int(profile["params"]), int(profile["dense_params"]), int(profile.get("buffer_numel") or 0),
                   matrix_shapes=shapes, eval_samples=int(eval_samples) if eval_samples else None)


@dataclass(frozen=True)
class CompressionSpec:
    """The trainer's compression settings (trainer.config.TrainConfig's defaults), plus the
    density and k_s the profile measured compression at (profile_*)."""

    density: float = 0.01
    density_min: float = 0.002
    density_max: float = 0.05
    server_k_fraction: float = 1 / 32
    value_bytes: int = 2
    warmup_steps: int = 5
    pipeline_chunks: int = 1
    compressor: str = "topk"
    eval_every: int = 50
    density_gamma: float = 0.5
    density_time_floor_s: float = 0.05
    powersgd_rank: int = 2
    powersgd_start: int = 10


@dataclass(frozen=True)
class LinkSpec:
    """One direction of a link: goodput in Mbit/s, round trip in ms, and where they come from
    (measured, declared, assumed)."""

    mbps: float
    rtt_ms: float
    source: str = "assumed"


LOOPBACK = LinkSpec(LOOPBACK_MBPS, LOOPBACK_RTT_MS, "loopback")


@dataclass(frozen=True)
class Prediction:
    """One strategy's predicted step: throughput, the critical path's parts, granularity (the
    bill's compute over communication), bytes per link per step, and what was assumed."""

    strategy: str
    samples_per_s: float
    step_s: float
    breakdown: dict[str, float]
    granularity: float | None
    per_worker: list[dict]
    bytes_per_step: list[tuple[int, int, int]]
    time_to_max_steps_s: float | None
    assumptions: list[str]
    global_batch: int = 0
    server_node_id: int | None = None
    node_names: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready (bytes_per_step as objects, node ids as keys turned to strings)."""
        d = asdict(self)
        d["bytes_per_step"] = [{"src_node_id": s, "dst_node_id": t, "bytes": b} for s, t, b in self.bytes_per_step]
        d["node_names"] = {str(k): v for k, v in self.node_names.items()}
        return d


@dataclass(frozen=True)
class CostPrediction:
    """An hour of the predicted run, priced: samples, bytes per traffic class, $/h, $/1M samples
    and the egress share of the bill; `unpriced` lists what had no price (counted as $0)."""

    samples_per_hour: float
    bytes_by_class_per_hour: dict[str, int]
    egress_usd_per_h: float
    compute_usd_per_h: float
    usd_per_million_samples: float | None
    egress_share: float | None
    unpriced: tuple[str, ...] = ()

    @property
    def total_usd_per_h(self) -> float:
        """Egress plus compute."""
        return self.egress_usd_per_h + self.compute_usd_per_h

    def to_dict(self) -> dict:
        """JSON-ready, with the total."""
        d = asdict(self)
        d["unpriced"] = list(self.unpriced)
        d["total_usd_per_h"] = self.total_usd_per_h
        return d


# -- links and concurrent transfers -----------------------------------------------------------


@dataclass(frozen=True)
class _Transfer:
    src: NodeSpec
    dst: NodeSpec
    nbytes: float


def _link(links: Mapping[tuple[int, int], LinkSpec], src: NodeSpec, dst: NodeSpec) -> LinkSpec:
    if src.node_id == dst.node_id:
        return LOOPBACK
    try:
        return links[(src.node_id, dst.node_id)]
    except KeyError:
        raise PredictError("links", f"links: no link from node {src.name} (id {src.node_id}) to "
                                    f"node {dst.name} (id {dst.node_id})") from None


def _concurrent(transfers: Sequence[_Transfer], links: Mapping[tuple[int, int], LinkSpec]) -> list[float]:
    """Seconds each of `transfers` takes when all run at once.

    Each uses pipes: its sender's link and its receiver's link (at the fastest rate either end
    has among these transfers: its network card), and between two sites the direction's one
    site-to-site pipe (at the link's own rate). A transfer takes the bytes through its busiest
    pipe at that pipe's rate, plus half a round trip. Loopback transfers share nothing.
    """
    pipes: dict[tuple, list[float]] = {}  # pipe -> [bytes, rate]
    uses: list[list[tuple]] = []
    for t in transfers:
        link = _link(links, t.src, t.dst)
        mine: list[tuple] = []
        if t.src.node_id != t.dst.node_id:
            ends = [(("out", t.src.node_id), max), (("in", t.dst.node_id), max)]
            if t.src.site_id != t.dst.site_id:
                ends.append((("site", t.src.site_id, t.dst.site_id), min))
            for key, pick in ends:
                pipe = pipes.setdefault(key, [0.0, link.mbps])
                pipe[0] += t.nbytes
                pipe[1] = pick(pipe[1], link.mbps)
                mine.append(key)
        uses.append(mine)
    times = []
    for t, mine in zip(transfers, uses):
        link = _link(links, t.src, t.dst)
        if not mine:
            times.append(t.nbytes * 8 / (link.mbps * _MBIT) + link.rtt_ms / 2000)
            continue
        busiest = max(pipes[k][0] * 8 / (pipes[k][1] * _MBIT) for k in mine)
        times.append(busiest + link.rtt_ms / 2000)
    return times


# -- the strategies ---------------------------------------------------------------------------


@dataclass
class _Step:
    """One kind of step (dense warm-up or compressed) of a strategy."""

    step_s: float
    breakdown: dict[str, float]
    workers: list[dict]
    transfers: list[_Transfer]


def _ratio(compute_s: float, comm_s: float) -> float | None:
    return compute_s / comm_s if comm_s > 0 else None


def _relay_plan(workers: Sequence[NodeSpec], server: NodeSpec, relay: bool) -> tuple[list[int], dict[int, list[int]]]:
    """Worker indices the server sends the update to, and relay index -> its site's peers
    (`trainer.relay.plan_relay`: the lowest rank of each remote site with several workers)."""
    if not relay:
        return list(range(len(workers))), {}
    by_site: dict[int, list[int]] = {}
    for i, w in enumerate(workers):
        by_site.setdefault(w.site_id, []).append(i)
    sends, forwards = [], {}
    for site, idx in by_site.items():
        if site == server.site_id or len(idx) == 1:
            sends.extend(idx)
        else:
            sends.append(idx[0])
            forwards[idx[0]] = idx[1:]
    return sorted(sends), forwards


def _chunk_sizes(numel: int, count: int) -> list[int]:
    """`trainer.algorithm.chunks`: near-equal contiguous chunks of the compressed part."""
    bounds = [round(i * numel / count) for i in range(count + 1)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _ps_step(workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec,
             links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec, comp: CompressionSpec,
             relay: bool, densities: Sequence[float] | None) -> _Step:
    """One PS step; `densities` None is a dense step (warm-up, `ps`, or compressor none)."""
    nodes = [w for w, _ in workers]
    m = len(nodes)
    chunks = _chunk_sizes(task.sparse_params, comp.pipeline_chunks) if task.sparse_params else [0]
    c = len(chunks)
    dense = densities is None
    seeded = comp.compressor == "randomk"

    def grad_bytes(density: float | None) -> float:
        return _grad_bytes(task.dense_params, tuple(chunks), density, comp.value_bytes, seeded)

    update_bytes = sum(update_frame_bytes(task.dense_params if i == 0 else 0, n,
                                          None if dense else kept_for(n, comp.server_k_fraction),
                                          comp.value_bytes, workers=m if i == c - 1 else 0)
                       for i, n in enumerate(chunks))
    ups = [_Transfer(w, server, grad_bytes(None if dense else densities[i])) for i, w in enumerate(nodes)]
    upload = _concurrent(ups, links)
    sends, forwards = _relay_plan(nodes, server, relay)
    downs = [_Transfer(server, nodes[i], update_bytes) for i in sends]
    first_hop = dict(zip(sends, _concurrent(downs, links)))
    download = [0.0] * m
    fwd_transfers = []
    for i in sends:
        download[i] = first_hop[i]
    for r, peers in forwards.items():
        hops = [_Transfer(nodes[r], nodes[p], update_bytes) for p in peers]
        fwd_transfers.extend(hops)
        for p, t in zip(peers, _concurrent(hops, links)):
            download[p] = first_hop[r] + t

    compute = [n / w.samples_per_s for w, n in workers]
    # Top-k's cost is one pass over the elements whatever k (selection by threshold), so the
    # profile's time stands at any density.
    compress = [0.0 if dense else w.worker_compress_s for w in nodes]
    server_s = m * server.aggregate_s + (0.0 if dense else server.server_compress_s)
    arrive = [compute[i] + compress[i] + upload[i] for i in range(m)]
    crit = max(range(m), key=lambda i: arrive[i])
    down_s = max(download)
    plain = arrive[crit] + server_s + down_s
    step_s = plain
    overlap = 0.0
    if c > 1:
        # Chunk c+1 is compressed and sent while chunk c is aggregated and comes back: the first
        # chunk goes through every stage, then the slowest stage repeats C - 1 times.
        per = [max(compress) / c, max(upload) / c, server_s / c, down_s / c]
        head = max(compute[i] + (compress[i] + upload[i]) / c for i in range(m))
        step_s = head + per[2] + per[3] + (c - 1) * max(per)
        overlap = step_s - plain
    breakdown = {"compute_s": compute[crit], "compress_s": compress[crit], "upload_s": upload[crit],
                 "server_s": server_s, "download_s": down_s}
    if c > 1:
        breakdown["overlap_s"] = overlap
    rows = []
    for i, (w, n) in enumerate(workers):
        rows.append({"node_id": w.node_id, "name": w.name, "batch": n, "compute_s": compute[i],
                     "compress_s": compress[i], "upload_s": upload[i], "download_s": download[i],
                     "comm_s": upload[i] + download[i],
                     "granularity": _ratio(compute[i], upload[i] + download[i]),
                     "upload_bytes": ups[i].nbytes,
                     "download_bytes": update_bytes,
                     "density": 1.0 if dense else densities[i],
                     "relay_for": [nodes[p].node_id for p in forwards.get(i, [])]})
    return _Step(step_s, breakdown, rows, ups + downs + fwd_transfers)


def _fixed_point_densities(workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec,
                           links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec,
                           comp: CompressionSpec) -> list[float]:
    """The densities the trainer's rule settles at: iterate `adapt_densities` over predicted
    upload times until no density moves by more than 0.5 % (the rule halves the distance to its
    fixed point each step at gamma 0.5)."""
    nodes = [w for w, _ in workers]
    chunks = _chunk_sizes(task.sparse_params, comp.pipeline_chunks) if task.sparse_params else [0]
    seeded = comp.compressor == "randomk"
    d = [comp.density] * len(nodes)
    for _ in range(100):
        ups = [_Transfer(w, server, _grad_bytes(task.dense_params, tuple(chunks), di, comp.value_bytes, seeded))
               for w, di in zip(nodes, d)]
        times = _concurrent(ups, links)
        new = adapt_densities(d, times, target=comp.density, low=comp.density_min,
                              high=comp.density_max, gamma=comp.density_gamma,
                              floor=comp.density_time_floor_s)
        if all(abs(a - b) <= 5e-3 * b for a, b in zip(new, d)):
            return new
        d = new
    return d


@lru_cache(maxsize=65536)
def _grad_bytes(dense_numel: int, chunks: tuple[int, ...], density: float | None, value_bytes: int,
                seeded: bool) -> float:
    """A worker's GRAD frames of one step, every chunk (the dense part rides on the first)."""
    return sum(grad_frame_bytes(dense_numel if i == 0 else 0, n,
                                None if density is None else kept_for(n, density),
                                value_bytes, seeded=seeded) for i, n in enumerate(chunks))


def _ring(workers: Sequence[tuple[NodeSpec, int]], links: Mapping[tuple[int, int], LinkSpec],
          nbytes: float) -> tuple[float, list[_Transfer]]:
    """Seconds of one ring all-reduce of `nbytes` per worker: 2(W-1) steps, each moving nbytes/W
    over every ring link at once (ring order = worker order), paced by the slowest."""
    nodes = [w for w, _ in workers]
    k = len(nodes)
    if k < 2 or nbytes <= 0:
        return 0.0, []
    hop = [_Transfer(nodes[i], nodes[(i + 1) % k], nbytes / k) for i in range(k)]
    per_step = max(_concurrent(hop, links))
    total = [_Transfer(t.src, t.dst, 2 * (k - 1) * t.nbytes) for t in hop]
    return 2 * (k - 1) * per_step, total


def _powersgd_elements(task: TaskSpec, rank: int) -> float:
    """Elements all-reduced per step once PowerSGD runs: P and Q of each compressed matrix plus
    every other tensor as is."""
    if task.matrix_shapes:
        elements, covered = 0.0, 0
        for rows, cols in task.matrix_shapes:
            r = min(rows, cols, rank)
            covered += rows * cols
            factors = (rows + cols) * r
            elements += factors if factors * POWERSGD_MIN_COMPRESSION_RATE < rows * cols else rows * cols
        return elements + max(0, task.params - covered)
    return POWERSGD_FACTOR_SCALE * rank * math.sqrt(task.sparse_params) + task.dense_params


def _allreduce_step(strategy: str, workers: Sequence[tuple[NodeSpec, int]],
                    links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec, comp: CompressionSpec,
                    compressed: bool) -> _Step:
    compute = [n / w.samples_per_s for w, n in workers]
    if compressed:
        elements = _powersgd_elements(task, comp.powersgd_rank)
        ring_s, transfers = _ring(workers, links, elements * 4)
        # P, then Q, then the uncompressed tensors: three rings, each paying its latency; the
        # hook runs after backward (one bucket on CPU), so nothing overlaps.
        k = len(workers)
        if k > 1:
            rtt_ms = max(_link(links, workers[i][0], workers[(i + 1) % k][0]).rtt_ms for i in range(k))
            ring_s += 2 * 2 * (k - 1) * rtt_ms / 2000
        step_s = max(compute) + ring_s
        overlap = 0.0
    else:
        ring_s, transfers = _ring(workers, links, task.params * 4)
        overlap = -DDP_OVERLAP * min(BACKWARD_SHARE * max(compute), ring_s)
        step_s = max(compute) + ring_s + overlap
    crit = max(range(len(workers)), key=lambda i: compute[i])
    rows = []
    for i, (w, n) in enumerate(workers):
        sent = transfers[i].nbytes if transfers else 0.0
        rows.append({"node_id": w.node_id, "name": w.name, "batch": n, "compute_s": compute[i],
                     "compress_s": 0.0, "upload_s": ring_s, "download_s": 0.0, "comm_s": ring_s,
                     "granularity": _ratio(compute[i], ring_s),
                     "upload_bytes": sent, "download_bytes": sent, "density": 1.0, "relay_for": []})
    breakdown = {"compute_s": compute[crit], "compress_s": 0.0, "upload_s": ring_s, "server_s": 0.0,
                 "download_s": 0.0, "overlap_s": overlap}
    return _Step(step_s, breakdown, rows, transfers)


# -- predict ----------------------------------------------------------------------------------


def _evaluation(workers: Sequence[tuple[NodeSpec, int]], task: TaskSpec, comp: CompressionSpec,
                max_steps: int | None) -> tuple[float, float]:
    """Seconds of one evaluation (each worker a share of the held-out set by its batch share,
    forward only; the slowest decides) and evaluations per step (every eval_every steps and
    after the last)."""
    if not task.eval_samples:
        return 0.0, 0.0
    total = sum(n for _, n in workers)
    eval_s = max(task.eval_samples * n / total / (EVAL_SPEEDUP * w.samples_per_s) for w, n in workers)
    every = max(1, comp.eval_every)
    if max_steps is None:
        return eval_s, 1 / every
    return eval_s, (max_steps // every + (1 if max_steps % every else 0)) / max_steps


def _check(strategy: str, workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec | None,
           task: TaskSpec, comp: CompressionSpec, max_steps: int | None) -> None:
    if strategy not in STRATEGIES:
        raise PredictError("strategy", f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if not workers:
        raise PredictError("workers", "workers: at least one worker is required")
    for node, n in workers:
        if not (node.samples_per_s > 0) or not math.isfinite(node.samples_per_s):
            raise PredictError("samples_per_s", f"samples_per_s of node {node.name}: must be a finite "
                                                f"number > 0, got {node.samples_per_s!r}")
        if n < 1:
            raise PredictError("workers", f"workers: node {node.name} has a batch share of {n}, below 1")
    if is_ps(strategy) and server is None:
        raise PredictError("server", f"server: {strategy} needs a parameter-server node")
    if task.params <= 0 or not 0 <= task.dense_params <= task.params:
        raise PredictError("task", f"task: params {task.params} and dense_params {task.dense_params} "
                                   "must satisfy 0 <= dense_params <= params, params > 0")
    if comp.pipeline_chunks < 1:
        raise PredictError("pipeline_chunks", f"pipeline_chunks must be >= 1, got {comp.pipeline_chunks}")
    if max_steps is not None and max_steps < 1:
        raise PredictError("max_steps", f"max_steps must be >= 1, got {max_steps}")


def predict(strategy: str, *, workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec | None,
            links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec,
            compression: CompressionSpec = CompressionSpec(), relay: bool = True,
            max_steps: int | None = None, densities: Sequence[float] | None = None) -> Prediction:
    """The predicted step of `strategy` with `workers` (node, batch share) and `server`;
    `densities` (compressing PS strategies) replace the adaptive rule's fixed point."""
    _check(strategy, workers, server, task, compression, max_steps)
    workers = list(workers)
    comp = compression
    sources = sorted({_link(links, a, b).source for (a, _) in workers
                      for b in ([server] if server is not None and is_ps(strategy) else [w for w, _ in workers])
                      if a.node_id != b.node_id})
    notes = [f"links: {', '.join(sources) or 'none (one node)'}"]
    # Warm-up steps (and PowerSGD's plain all-reduce before its start step) are the dense kind.
    if strategy == ALLREDUCE:
        steady = _allreduce_step(strategy, workers, links, task, comp, compressed=False)
        warm, warm_steps = steady, 0
        notes.append(f"DDP hides {DDP_OVERLAP:g} of the ring all-reduce behind the backward pass "
                     "(2/3 of compute), fitted on the paper testbed")
    elif strategy == ALLREDUCE_POWERSGD:
        steady = _allreduce_step(strategy, workers, links, task, comp, compressed=True)
        warm = _allreduce_step(strategy, workers, links, task, comp, compressed=False)
        # PowerSGDState counts steps from 0 and compresses from its start step on (>= 2).
        warm_steps = max(2, comp.powersgd_start)
        notes.append("PowerSGD factors " + ("from the task's matrix shapes" if task.matrix_shapes else
                     f"approximated as {POWERSGD_FACTOR_SCALE:g} * rank * sqrt(compressed params) elements "
                     "(within a factor 1.6 on the built-in CNNs)"))
    else:
        compresses = contract_compresses(strategy, comp.compressor)
        warm = _ps_step(workers, server, links, task, comp, relay, None)
        if compresses:
            if densities is None:
                densities = _fixed_point_densities(workers, server, links, task, comp)
            elif len(densities) != len(workers):
                raise PredictError("densities", f"densities: {len(densities)} given for {len(workers)} workers")
            steady = _ps_step(workers, server, links, task, comp, relay, densities)
            warm_steps = comp.warmup_steps
            notes.append("densities at the adaptive rule's fixed point; top-k cost flat in density")
            notes.append("delta-encoded index sizes are expectations for uniformly spread top-k positions")
        else:
            steady, warm_steps = warm, 0
        if relay and any(r["relay_for"] for r in steady.workers):
            notes.append("the update crosses to each remote site once (relay)")
        if comp.pipeline_chunks > 1:
            notes.append(f"{comp.pipeline_chunks} pipelined chunks: first chunk through every stage "
                         "+ (C-1) x the slowest stage")
    global_batch = sum(n for _, n in workers)
    eval_s, evals_per_step = _evaluation(workers, task, comp, max_steps)
    if task.eval_samples:
        notes.append(f"evaluation of {task.eval_samples} samples every {comp.eval_every} steps, forward "
                     f"only at {EVAL_SPEEDUP:g}x the training rate")
    else:
        notes.append("evaluation is ignored (the held-out set's size is not known)")
    notes.append("start-up (handshake, first weights) is ignored")
    if max_steps is not None:
        dense_n = min(warm_steps, max_steps)
        total_s = dense_n * warm.step_s + (max_steps - dense_n) * steady.step_s + evals_per_step * max_steps * eval_s
        step_s = total_s / max_steps
        weight = dense_n / max_steps
        if dense_n:
            notes.append(f"{dense_n} dense warm-up steps amortised over {max_steps}")
    else:
        total_s, weight = None, 0.0
        step_s = steady.step_s + evals_per_step * eval_s
    breakdown = dict(steady.breakdown)
    if task.eval_samples:
        breakdown["eval_s"] = evals_per_step * eval_s

    pairs: dict[tuple[int, int], float] = {}
    for step, share in ((steady, 1 - weight), (warm, weight)):
        if share <= 0:
            continue
        for t in step.transfers:
            if t.src.node_id != t.dst.node_id:
                key = (t.src.node_id, t.dst.node_id)
                pairs[key] = pairs.get(key, 0.0) + share * t.nbytes
    overall, _ = granularity([WorkerTime(r["name"], r["compute_s"], r["comm_s"]) for r in steady.workers])
    names = {w.node_id: w.name for w, _ in workers}
    if server is not None and is_ps(strategy):
        names[server.node_id] = server.name
    return Prediction(
        strategy=strategy,
        samples_per_s=global_batch / step_s,
        step_s=step_s,
        breakdown=breakdown,
        granularity=overall.ratio,
        per_worker=steady.workers,
        bytes_per_step=[(s, d, int(round(b))) for (s, d), b in sorted(pairs.items())],
        time_to_max_steps_s=total_s,
        assumptions=notes,
        global_batch=global_batch,
        server_node_id=server.node_id if server is not None and is_ps(strategy) else None,
        node_names=names,
    )


def predict_costs(prediction: Prediction, *, nodes: Sequence[NodeUsage], prices: PriceLookup,
                  at: datetime) -> CostPrediction:
    """An hour of `prediction` billed by `app.billing.compute_bill` at the prices in force at
    `at`: every node of the plan (workers and server, matched by name in `nodes`) for 3600 s and
    the links' bytes at the predicted step rate. Missing prices count as $0 and are listed."""
    by_name = {n.name: n for n in nodes}
    plan_names = list(dict.fromkeys(prediction.node_names.values()))
    missing = [n for n in plan_names if n not in by_name]
    if missing:
        raise PredictError("nodes", f"nodes: no site or pricing given for node(s) {', '.join(missing)}")
    steps_per_h = 3600.0 / prediction.step_s
    names = prediction.node_names
    usage = RunUsage(
        priced_at=at,
        nodes=[replace(by_name[n], seconds=3600.0) for n in plan_names],
        links=[LinkBytes(names[s], names[d], int(round(b * steps_per_h))) for s, d, b in prediction.bytes_per_step],
        samples=int(round(prediction.samples_per_s * 3600)),
        duration_s=3600.0,
    )
    bill = compute_bill(usage, prices, strict=False)
    egress, compute = float(bill.egress_usd), float(bill.compute_usd)
    samples_h = prediction.samples_per_s * 3600
    total = egress + compute
    return CostPrediction(
        samples_per_hour=samples_h,
        bytes_by_class_per_hour={c.value: b for c, b in bill.bytes_by_class.items() if b},
        egress_usd_per_h=egress,
        compute_usd_per_h=compute,
        usd_per_million_samples=total * 1e6 / samples_h if samples_h > 0 else None,
        egress_share=egress / total if total > 0 else None,
        unpriced=bill.unpriced,
    )


__all__ = ["CompressionSpec", "CostPrediction", "LOOPBACK", "LinkSpec", "NodeSpec", "Prediction",
           "PredictError", "TaskSpec", "predict", "predict_costs"]
