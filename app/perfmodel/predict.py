"""The performance model: one training step of each strategy, and the cost of an hour of it.

Pure functions over plain figures (no database, no torch): a node's speed and compression
costs come from its task profile, a link's bandwidth and round trip from probes (or declared or
assumed values), the bytes from `hybridtrain.wiresize`, the prices through
`app.billing.compute_bill`. The inputs are `app.perfmodel.inputs`, one step of each strategy
`app.perfmodel.steps` (sites as replicas `app.perfmodel.site_replicas`). docs/predict.md writes
out every equation and assumption; in short:

1. compute_m = n_m / samples_per_s_m (the profile's rate, linear in the batch).
2. PS strategies: the step is max_m(compute_m + compress_m + upload_m) + server + max_m(download_m
   + decode_m), dense frames costing their encode and decode per element on both ends;
   `pipeline_chunks` C > 1 saves 0.8 of what an ideal chunk pipeline would. Compressed
   strategies follow the trainer's adaptive densities step by step from the target to their
   fixed point; warm-up steps are dense.
3. allreduce: DDP's ring over the slowest link, partly hidden behind the backward pass;
   allreduce-powersgd: each worker's factorisation, then rank-r factors after its start step,
   not overlapped.
4. Transfers that run at once share a pipe: a node's own link (incast at the server, its
   copies of the update) and, between two sites, the one site-to-site pipe of each direction.
5. Over `max_steps` the prediction is the mean of its phases (dense warm-up, the densities'
   path, the steady state), each listed in `phases`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
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
from app.perfmodel.data import NO_READS, DataReads
from app.perfmodel.inputs import (
    LOOPBACK,
    LOOPBACK_MBPS,
    LOOPBACK_RTT_MS,
    CompressionSpec,
    LinkSpec,
    NodeSpec,
    PredictError,
    TaskSpec,
)
from app.perfmodel.site_replicas import site_exchange, site_replicas, site_replicas_step
from app.perfmodel.steps import (
    BACKWARD_SHARE,
    DDP_OVERLAP,
    PIPELINE_EFFICIENCY,
    POWERSGD_FACTOR_SCALE,
    Step,
    allreduce_step,
    density_path,
    link,
    local_sgd_step,
    ps_step,
)
from hybridtrain.contract import (
    ALLREDUCE,
    ALLREDUCE_POWERSGD,
    STRATEGIES,
    is_local_sgd,
    is_ps,
    outer_density_plan,
)
from hybridtrain.contract import compresses as contract_compresses
from hybridtrain.wiresize import site_value_bytes

# Evaluation runs the forward pass only: about 3x the training rate (forward ~ 1/3 of a step).
EVAL_SPEEDUP = 3.0


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
    # Steps first..last of one kind (warm-up, each step of the densities' path, the settled
    # state; last null: unbounded), each with its step time, bytes crossing sites and densities.
    phases: list[dict] = field(default_factory=list)

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
    # The data sets' reads from their stores (app.perfmodel.data): the run's dollars and bytes,
    # and those dollars spread over its samples, as $/h at this plan's rate.
    data_usd_per_h: float = 0.0
    data_usd: float = 0.0
    data_bytes: int = 0

    @property
    def total_usd_per_h(self) -> float:
        """Egress plus compute plus the data sets' reads."""
        return self.egress_usd_per_h + self.compute_usd_per_h + self.data_usd_per_h

    def to_dict(self) -> dict:
        """JSON-ready, with the total."""
        d = asdict(self)
        d["unpriced"] = list(self.unpriced)
        d["total_usd_per_h"] = self.total_usd_per_h
        return d


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


@dataclass(frozen=True)
class _Phase:
    """Steps first..last (last None: every step from first on) that all take `step`."""

    first: int
    last: int | None
    step: Step


def _ps_phases(workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec,
               links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec, comp: CompressionSpec,
               relay: bool, strategy: str, densities: Sequence[float] | None) -> list[_Phase]:
    """Dense warm-up steps, then each step of the densities' path, then the settled state (a
    `ps` run, or compressor none: dense throughout)."""
    downlinks: dict = {}
    dense = ps_step(workers, server, links, task, comp, relay, None, downlinks)
    if not contract_compresses(strategy, comp.compressor):
        return [_Phase(1, None, dense)]
    if densities is not None:
        if len(densities) != len(workers):
            raise PredictError("densities", f"densities: {len(densities)} given for {len(workers)} workers")
        path = [list(densities)]
    else:
        path = density_path(workers, server, links, task, comp)
    w = max(0, comp.warmup_steps)
    phases = [_Phase(1, w, dense)] if w else []
    for j, d in enumerate(path):
        first, last = w + 1 + j, (None if j == len(path) - 1 else w + 1 + j)
        if j and phases[-1].first > w and d == path[j - 1]:
            phases[-1] = _Phase(phases[-1].first, last, phases[-1].step)
        else:
            phases.append(_Phase(first, last, ps_step(workers, server, links, task, comp, relay, d, downlinks)))
    return phases


def _round_phases(rounds: list[_Phase], every: int, step_of: Callable[[Step], Step]) -> list[_Phase]:
    """Local SGD's phases from its outer steps' (`rounds`, one PS step each: the densities' path,
    then the settled state): the k-th outer step's round is inner steps (k - 1) H + 1 .. k H,
    each a step of `step_of` that round's exchange."""
    return [_Phase((r.first - 1) * every + 1, None if r.last is None else r.last * every, step_of(r.step))
            for r in rounds]


def _within(phases: list[_Phase], max_steps: int | None) -> list[tuple[_Phase, int]]:
    """Each phase that starts by `max_steps`, with how many of its steps are run (None: the
    last phase, unbounded)."""
    out = []
    for ph in phases:
        if max_steps is not None and ph.first > max_steps:
            break
        last = ph.last if max_steps is None else min(max_steps, ph.last if ph.last is not None else max_steps)
        out.append((ph, None if last is None else last - ph.first + 1))
    return out


def predict(strategy: str, *, workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec | None,
            links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec,
            compression: CompressionSpec = CompressionSpec(), relay: bool = True,
            max_steps: int | None = None, densities: Sequence[float] | None = None) -> Prediction:
    """The predicted step of `strategy` with `workers` (node, batch share) and `server`, the
    mean over `max_steps` (else the settled step); `densities` (compressing PS strategies)
    replace the adaptive rule's path."""
    _check(strategy, workers, server, task, compression, max_steps)
    workers = list(workers)
    comp = compression
    sources = sorted({link(links, a, b).source for (a, _) in workers
                      for b in ([server] if server is not None and is_ps(strategy) else [w for w, _ in workers])
                      if a.node_id != b.node_id})
    notes = [f"links: {', '.join(sources) or 'none (one node)'}"]
    if strategy == ALLREDUCE:
        phases = [_Phase(1, None, allreduce_step(workers, links, task, comp, compressed=False))]
        notes.append(f"DDP hides {DDP_OVERLAP:g} of the ring all-reduce behind the backward pass "
                     f"({BACKWARD_SHARE:.2g} of compute), fitted on the paper testbed")
    elif strategy == ALLREDUCE_POWERSGD:
        # PowerSGDState counts steps from 0 and compresses from its start step on (>= 2).
        plain_steps = max(2, comp.powersgd_start)
        phases = [_Phase(1, plain_steps, allreduce_step(workers, links, task, comp, compressed=False)),
                  _Phase(plain_steps + 1, None, allreduce_step(workers, links, task, comp, compressed=True))]
        notes.append("PowerSGD factors " + ("from the task's matrix shapes" if task.matrix_shapes else
                     f"approximated as {POWERSGD_FACTOR_SCALE:g} * rank * sqrt(compressed params) elements "
                     "(within a factor 1.6 on the built-in CNNs)"))
        notes.append("each worker's PowerSGD work from its profile, before the all-reduces")
        _note_unmeasured(notes, [w for w, _ in workers], "powersgd_s", "PowerSGD's work")
    elif is_local_sgd(strategy):
        # An outer step is a PS step of the pseudo-gradient (at the densities' fixed point under
        # diloco-gc); the run pays 1/H of it a step. Dense changes travel at the value width.
        target, low, high, server_k = outer_density_plan(comp.outer_density)
        outer = replace(comp, warmup_steps=0, density=target, density_min=low, density_max=high,
                        server_k_fraction=server_k)
        share = 1.0 if contract_compresses(strategy, comp.compressor) else comp.value_bytes / 4
        if comp.site_replicas:
            # One replica per site: the outer step's PS step is the sites' relays'.
            site_bytes = site_value_bytes(comp.value_bytes)
            site = site_exchange(workers, links, task, site_bytes)
            rounds = _ps_phases(site_replicas(workers, site), server, links, task, outer, relay, strategy, densities)
            phases = _round_phases(rounds, comp.sync_every,
                                   lambda r: site_replicas_step(workers, links, task, comp, r, site, share))
            width = "fp32" if site_bytes == 4 else "bf16"
            notes.append(f"sites as replicas: every step each site's workers send their {width} gradient to the "
                         f"site's relay and take the mean back over the LAN ({len(site.sites)} replicas; "
                         "pieces pipelined, the relay's averaging at the profile's dense decode and encode "
                         "costs); the slowest site paces the step")
            notes.append(f"an outer step every {comp.sync_every} steps: one change per site crosses to the "
                         "server (its relay's), the members' changes reach the relay uncompressed and the "
                         f"reply is fanned out on the LAN; each step pays 1/{comp.sync_every} of it")
            _note_unmeasured(notes, [w for w, _ in workers], "dense_encode_s_per_element",
                             "the in-site exchange's encode and decode")
        else:
            rounds = _ps_phases(workers, server, links, task, outer, relay, strategy, densities)
            phases = _round_phases(rounds, comp.sync_every,
                                   lambda r: local_sgd_step(r, comp.sync_every, share, comp.outer_delay, comp.fragments))
            notes.append(f"an outer step every {comp.sync_every} steps: each step pays its compute and 1/"
                         f"{comp.sync_every} of a PS step's exchange of the pseudo-gradient")
            if comp.fragments > 1:
                notes.append(f"streaming: {comp.fragments} fragments, each exchange 1/{comp.fragments} of the "
                             f"model every {comp.sync_every // comp.fragments} steps (frame headers not counted)")
        if len(phases) > 1:
            notes.append("diloco-gc's densities follow the adaptive rule one outer step at a time to their "
                         "fixed point; each round is predicted at its own")
        if comp.outer_delay:
            notes.append(f"the outer exchange overlaps {comp.outer_delay} inner steps (outer_delay)")
    else:
        phases = _ps_phases(workers, server, links, task, comp, relay, strategy, densities)
        if len(phases) > 1 or phases[0].step.workers[0]["density"] < 1.0:
            notes.append("densities follow the adaptive rule step by step from the target to its fixed "
                         "point; top-k cost flat in density")
            notes.append("delta-encoded index sizes are expectations for uniformly spread top-k positions")
        notes.append("dense frames cost their encode and decode per element on both ends")
        _note_unmeasured(notes, [w for w, _ in workers] + [server], "dense_encode_s_per_element",
                         "dense frames' encode and decode")
        if relay and any(r["relay_for"] for r in phases[-1].step.workers):
            notes.append("the update crosses to each remote site once (relay)")
        if comp.pipeline_chunks > 1:
            notes.append(f"{comp.pipeline_chunks} pipelined chunks save {PIPELINE_EFFICIENCY:.2g} of what "
                         "their timeline (each chunk through every stage, in order) saves")
    steady = phases[-1].step
    global_batch = sum(n for _, n in workers)
    eval_s, evals_per_step = _evaluation(workers, task, comp, max_steps)
    if task.eval_samples:
        notes.append(f"evaluation of {task.eval_samples} samples every {comp.eval_every} steps, forward "
                     f"only at {EVAL_SPEEDUP:g}x the training rate")
    else:
        notes.append("evaluation is ignored (the held-out set's size is not known)")
    notes.append("start-up (handshake, first weights) is ignored")
    run = _within(phases, max_steps)
    if max_steps is not None:
        train_s = sum(n * ph.step.step_s for ph, n in run)
        total_s = train_s + evals_per_step * max_steps * eval_s
        step_s = total_s / max_steps
        shares = [(ph.step, n / max_steps) for ph, n in run]
        if len(run) > 1:
            notes.append(f"{len(run)} phases (warm-up, transient, steady) averaged over {max_steps} steps")
    else:
        total_s = None
        step_s = steady.step_s + evals_per_step * eval_s
        shares = [(steady, 1.0)]
    breakdown = dict(steady.breakdown)
    if task.eval_samples:
        breakdown["eval_s"] = evals_per_step * eval_s

    pairs: dict[tuple[int, int], float] = {}
    for step, share in shares:
        for t in step.transfers:
            if t.src.node_id != t.dst.node_id and share > 0:
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
        phases=[_phase_dict(ph, n) for ph, n in run],
    )


def _note_unmeasured(notes: list[str], nodes: Sequence[NodeSpec], attr: str, what: str) -> None:
    """Say which nodes' profiles do not measure `attr` (older profiles): it counts as 0 there."""
    names = sorted({n.name for n in nodes if not getattr(n, attr)})
    if names:
        notes.append(f"{what} not in the profile of {', '.join(names)}: counted as 0 (profile again to measure it)")


def _phase_dict(phase: _Phase, steps: int | None) -> dict:
    step = phase.step
    cross = sum(t.nbytes for t in step.transfers if t.src.site_id != t.dst.site_id)
    return {"first_step": phase.first, "last_step": None if steps is None else phase.first + steps - 1,
            "step_s": step.step_s, "cross_site_bytes_per_step": int(round(cross)),
            "densities": [r["density"] for r in step.workers]}


def predict_costs(prediction: Prediction, *, nodes: Sequence[NodeUsage], prices: PriceLookup,
                  at: datetime, reads: DataReads = NO_READS) -> CostPrediction:
    """An hour of `prediction` billed by `app.billing.compute_bill` at the prices in force at
    `at`: every node of the plan (workers and server, matched by name in `nodes`) for 3600 s, the
    links' bytes at the predicted step rate, and the data sets' `reads` spread over the run's
    samples. Missing prices count as $0 and are listed."""
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
    data = reads.usd_per_sample * samples_h
    total = egress + compute + data
    return CostPrediction(
        samples_per_hour=samples_h,
        bytes_by_class_per_hour={c.value: b for c, b in bill.bytes_by_class.items() if b},
        egress_usd_per_h=egress,
        compute_usd_per_h=compute,
        usd_per_million_samples=total * 1e6 / samples_h if samples_h > 0 else None,
        egress_share=egress / total if total > 0 else None,
        unpriced=tuple(dict.fromkeys((*bill.unpriced, *reads.unpriced))),
        data_usd_per_h=data,
        data_usd=reads.usd,
        data_bytes=reads.bytes,
    )


__all__ = ["BACKWARD_SHARE", "CompressionSpec", "CostPrediction", "DDP_OVERLAP", "LOOPBACK", "LOOPBACK_MBPS",
           "LOOPBACK_RTT_MS", "LinkSpec", "NodeSpec", "PIPELINE_EFFICIENCY", "Prediction", "PredictError",
           "TaskSpec", "predict", "predict_costs"]
