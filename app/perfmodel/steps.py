"""One step of each strategy under the performance model (app/perfmodel/predict.py): transfers sharing
pipes, the parameter-server step (pipelined or not), the adaptive densities' path, the ring
all-reduce, PowerSGD and local SGD (its sites as replicas are `app.perfmodel.site_replicas`).
Pure functions over `app.perfmodel.inputs`; docs/predict.md has the equations."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from app.perfmodel.inputs import LOOPBACK, CompressionSpec, LinkSpec, NodeSpec, PredictError, TaskSpec
from hybridtrain.contract import adapt_densities
from hybridtrain.wiresize import grad_frame_bytes, kept_for, update_frame_bytes

# The share of a step's compute that is the backward pass, during which DDP may all-reduce the
# buckets already done (forward is ~1/3 of forward + backward for the CNNs we train).
BACKWARD_SHARE = 2 / 3
# How much of that window the ring actually hides. Fitted once, on the paper testbed
# (widecnn, 4 CPU-emulated workers, 100 Mbit/s WAN: step 3.49 s = compute 2.56 s + ring 1.68 s
# - 0.45 * 1.68 s): the gradient's largest tensor fills one bucket early in backward, but the
# ring's reductions and sends compete with the backward pass for the same cores.
DDP_OVERLAP = 0.45
# How much of the chunk pipeline's saving (`chunk_pipeline` against the same step unpipelined)
# real steps get. Fitted on 12 PS runs of bench/predict.py (2026-11-25 10:42, both testbeds,
# both tasks, `ps`, `ps-gc`, `ps-bz-gc`, 4 chunks): 0.6 leaves a mean error of +0.5 % (mean
# |error| 4.5 %), the timeline as is +7.7 %. The timeline runs every stage at its profiled
# speed the moment its input is ready; on the testbed's CPU quotas a stage that becomes ready
# may wait for the quota's next period, and chunks of workers that share a pipe arrive
# together at its end (a FIFO serves one flow's chunks before another's).
PIPELINE_EFFICIENCY = 0.6
# Without the task's matrix shapes, PowerSGD's factors of a compressed part of n elements are
# taken as POWERSGD_FACTOR_SCALE * rank * sqrt(n) elements: +52 % on widecnn (4 matrices),
# -26 % on resnet18 (21 matrices); `TaskSpec.matrix_shapes` makes it exact.
POWERSGD_FACTOR_SCALE = 8.0
# PyTorch's PowerSGD compresses a matrix only where its factors are 2x smaller.
POWERSGD_MIN_COMPRESSION_RATE = 2.0
# The densities' path is followed until no density moves by more than this share in a step.
DENSITY_SETTLED = 5e-3
_MBIT = 1e6


# -- links and concurrent transfers -----------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """`nbytes` from one node to another within a step."""

    src: NodeSpec
    dst: NodeSpec
    nbytes: float


def link(links: Mapping[tuple[int, int], LinkSpec], src: NodeSpec, dst: NodeSpec) -> LinkSpec:
    """The link from `src` to `dst` (loopback on one node); PredictError naming `links` if none."""
    if src.node_id == dst.node_id:
        return LOOPBACK
    try:
        return links[(src.node_id, dst.node_id)]
    except KeyError:
        raise PredictError("links", f"links: no link from node {src.name} (id {src.node_id}) to "
                                    f"node {dst.name} (id {dst.node_id})") from None


def concurrent(transfers: Sequence[Transfer], links: Mapping[tuple[int, int], LinkSpec]) -> list[float]:
    """Seconds each of `transfers` takes when all run at once.

    Each uses pipes: its sender's link and its receiver's link (at the fastest rate either end
    has among these transfers: its network card), and between two sites the direction's one
    site-to-site pipe (at the link's own rate). A transfer takes the bytes through its busiest
    pipe at that pipe's rate, plus half a round trip. Loopback transfers share nothing.
    """
    pipes: dict[tuple, list[float]] = {}  # pipe -> [bytes, rate]
    uses: list[list[tuple]] = []
    for t in transfers:
        ln = link(links, t.src, t.dst)
        mine: list[tuple] = []
        if t.src.node_id != t.dst.node_id:
            ends = [(("out", t.src.node_id), max), (("in", t.dst.node_id), max)]
            if t.src.site_id != t.dst.site_id:
                ends.append((("site", t.src.site_id, t.dst.site_id), min))
            for key, pick in ends:
                pipe = pipes.setdefault(key, [0.0, ln.mbps])
                pipe[0] += t.nbytes
                pipe[1] = pick(pipe[1], ln.mbps)
                mine.append(key)
        uses.append(mine)
    times = []
    for t, mine in zip(transfers, uses):
        ln = link(links, t.src, t.dst)
        if not mine:
            times.append(t.nbytes * 8 / (ln.mbps * _MBIT) + ln.rtt_ms / 2000)
            continue
        busiest = max(pipes[k][0] * 8 / (pipes[k][1] * _MBIT) for k in mine)
        times.append(busiest + ln.rtt_ms / 2000)
    return times


def staggered(transfers: Sequence[Transfer], starts: Sequence[float],
              links: Mapping[tuple[int, int], LinkSpec]) -> list[float]:
    """Seconds each of `transfers` takes when each starts at its own time (seconds into the step).

    Transfers share pipes only with those still under way when they start: in order of start,
    one joins the running group if it starts before the group's last transfer ends, and a group
    is timed as if its transfers ran at once (`concurrent`). Two workers of one site whose
    compute ends 0.5 s apart each have the site's WAN link to themselves for a 40 ms upload;
    timed as sharing it, each would take twice the time (docs/predict.md).
    """
    if len(starts) != len(transfers):
        raise ValueError(f"{len(transfers)} transfers but {len(starts)} start times")
    times = [0.0] * len(transfers)
    group: list[int] = []
    end = -math.inf
    for i in sorted(range(len(transfers)), key=lambda j: starts[j]):
        if group and starts[i] >= end:
            group = []
        group.append(i)
        shared = concurrent([transfers[j] for j in group], links)
        for j, t in zip(group, shared):
            times[j] = t
        end = max(starts[j] + times[j] for j in group)
    return times


# -- the parameter server ---------------------------------------------------------------------


def _ready(workers: Sequence[tuple[NodeSpec, int]], task: TaskSpec,
           densities: Sequence[float] | None) -> tuple[list[float], list[float]]:
    """Each worker's compute and its compression at its density (the upload starts after
    both); `densities` None is a dense step."""
    compute = [n / w.samples_per_s for w, n in workers]
    # Elements that travel as dense fp32 payloads: everything on a dense step, else the dense
    # part. Each costs an encode on its sender.
    dense_numel = task.params if densities is None else task.dense_params
    compress = [(0.0 if densities is None else w.worker_compress_at(task.sparse_params, d))
                + dense_numel * w.dense_encode_s_per_element
                for (w, _), d in zip(workers, densities or [None] * len(workers))]
    return compute, compress


def chunk_pipeline(compute: Sequence[float], compress: Sequence[float], upload: Sequence[float],
                   latency: Sequence[float], server_s: float, download: Sequence[float],
                   decode: Sequence[float], chunks: int) -> float:
    """Seconds of a step whose compressed part travels in `chunks` pieces, as the trainer runs
    it (trainer/ps.py, trainer/server.py), each stage's time split evenly over the chunks.

    A worker compresses chunk after chunk and posts each; its link carries them in order; the
    server takes chunk c once every worker's has arrived and its previous chunk is done, then
    posts the update; each worker's way back carries the updates in order; a worker applies
    (decodes) the updates only once its own sends are done, in order. `upload` and `download`
    include their `latency` (half a round trip), paid once per chunk but not in series.
    """
    m = len(compute)
    ce = list(compute)          # each worker's compression of the chunk before ended
    ue = [0.0] * m              # each worker's link: the chunk before's last byte left
    arrivals: list[list[float]] = []
    for _ in range(chunks):
        got = []
        for i in range(m):
            ce[i] += compress[i] / chunks
            ue[i] = max(ce[i], ue[i]) + (upload[i] - latency[i]) / chunks
            got.append(ue[i] + latency[i])
        arrivals.append(got)
    se = 0.0
    de = [0.0] * m
    done = list(ue)             # a worker decodes once its own sends are done
    for got in arrivals:
        se = max(se, max(got)) + server_s / chunks
        for i in range(m):
            de[i] = max(se, de[i]) + (download[i] - latency[i]) / chunks
            done[i] = max(done[i], de[i] + latency[i]) + decode[i] / chunks
    return max(done)


@dataclass
class Step:
    """One kind of step (dense, compressed at some densities, ...) of a strategy."""

    step_s: float
    breakdown: dict[str, float]
    workers: list[dict]
    transfers: list[Transfer]


def ratio(compute_s: float, comm_s: float) -> float | None:
    """Compute over communication; None without communication."""
    return compute_s / comm_s if comm_s > 0 else None


def relay_plan(workers: Sequence[NodeSpec], server: NodeSpec, relay: bool) -> tuple[list[int], dict[int, list[int]]]:
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


def chunk_sizes(numel: int, count: int) -> list[int]:
    """`trainer.algorithm.chunks`: near-equal contiguous chunks of the compressed part."""
    bounds = [round(i * numel / count) for i in range(count + 1)]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


@lru_cache(maxsize=65536)
def grad_bytes(dense_numel: int, chunks: tuple[int, ...], density: float | None, value_bytes: int,
               seeded: bool) -> float:
    """A worker's GRAD frames of one step, every chunk (the dense part rides on the first)."""
    return sum(grad_frame_bytes(dense_numel if i == 0 else 0, n,
                                None if density is None else kept_for(n, density),
                                value_bytes, seeded=seeded) for i, n in enumerate(chunks))


def task_chunks(task: TaskSpec, comp: CompressionSpec) -> tuple[int, ...]:
    """The compressed part's chunk sizes under `comp.pipeline_chunks` (one empty chunk if none)."""
    return tuple(chunk_sizes(task.sparse_params, min(comp.pipeline_chunks, task.sparse_params)) if task.sparse_params else [0])


def ps_step(workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec,
            links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec, comp: CompressionSpec,
            relay: bool, densities: Sequence[float] | None, downlinks: dict | None = None) -> Step:
    """One PS step; `densities` None is a dense step (warm-up, `ps`, or compressor none).
    `downlinks`, shared by calls for the same plan, keeps the way back, which the densities do
    not change (the densities' path predicts many steps of one plan)."""
    nodes = [w for w, _ in workers]
    m = len(nodes)
    chunks = task_chunks(task, comp)
    c = len(chunks)
    dense = densities is None
    seeded = comp.compressor == "randomk"
    ups = [Transfer(w, server, grad_bytes(task.dense_params, chunks, None if dense else densities[i],
                                          comp.value_bytes, seeded)) for i, w in enumerate(nodes)]
    compute, compress = _ready(workers, task, None if dense else densities)
    upload = staggered(ups, [a + b for a, b in zip(compute, compress)], links)
    cached = None if downlinks is None else downlinks.get(dense)
    if cached is None:
        cached = _downlink(nodes, server, links, task, comp, relay, chunks, dense)
        if downlinks is not None:
            downlinks[dense] = cached
    update_bytes, download, forwards, downs, fwd_transfers = cached
    # A dense payload's elements also cost a decode (and add) on their receiver.
    dense_numel = task.params if dense else task.dense_params
    decode = [dense_numel * w.dense_aggregate_s_per_element for w in nodes]
    server_s = m * dense_numel * server.dense_aggregate_s_per_element + dense_numel * server.dense_encode_s_per_element
    if not dense:
        # The sum is zeroed once a step; each frame is decoded and added at its own density.
        s_numel = task.sparse_params
        server_s += (server.aggregate_fixed_s + sum(server.aggregate_at(s_numel, d) for d in densities)
                     + server.server_compress_at(s_numel, comp.server_k_fraction))
    arrive = [compute[i] + compress[i] + upload[i] for i in range(m)]
    crit = max(range(m), key=lambda i: arrive[i])
    back = [download[i] + decode[i] for i in range(m)]
    down_s = max(back)
    plain = arrive[crit] + server_s + down_s
    step_s = plain
    overlap = 0.0
    if c > 1:
        latency = [link(links, w, server).rtt_ms / 2000 for w in nodes]
        timeline = chunk_pipeline(compute, compress, upload, latency, server_s, download, decode, c)
        overlap = PIPELINE_EFFICIENCY * (timeline - plain)
        step_s = plain + overlap
    breakdown = {"compute_s": compute[crit], "compress_s": compress[crit], "upload_s": upload[crit],
                 "server_s": server_s, "download_s": down_s}
    if c > 1:
        breakdown["overlap_s"] = overlap
    rows = []
    for i, (w, n) in enumerate(workers):
        rows.append({"node_id": w.node_id, "name": w.name, "batch": n, "compute_s": compute[i],
                     "compress_s": compress[i], "upload_s": upload[i], "download_s": download[i],
                     "decode_s": decode[i], "comm_s": upload[i] + download[i],
                     "granularity": ratio(compute[i], upload[i] + download[i]),
                     "upload_bytes": ups[i].nbytes,
                     "download_bytes": update_bytes,
                     "density": 1.0 if dense else densities[i],
                     "relay_for": [nodes[p].node_id for p in forwards.get(i, [])]})
    return Step(step_s, breakdown, rows, ups + downs + fwd_transfers)


def _downlink(nodes: list[NodeSpec], server: NodeSpec, links: Mapping[tuple[int, int], LinkSpec],
              task: TaskSpec, comp: CompressionSpec, relay: bool, chunks: tuple[int, ...], dense: bool) -> tuple:
    """The update's bytes, each worker's download time, the relays' peers and the transfers."""
    m, c = len(nodes), len(chunks)
    update_bytes = sum(update_frame_bytes(task.dense_params if i == 0 else 0, n,
                                          None if dense else kept_for(n, comp.server_k_fraction),
                                          comp.value_bytes, workers=m if i == c - 1 else 0)
                       for i, n in enumerate(chunks))
    sends, forwards = relay_plan(nodes, server, relay)
    downs = [Transfer(server, nodes[i], update_bytes) for i in sends]
    first_hop = dict(zip(sends, concurrent(downs, links)))
    download = [0.0] * m
    fwd_transfers = []
    for i in sends:
        download[i] = first_hop[i]
    for r, peers in forwards.items():
        hops = [Transfer(nodes[r], nodes[p], update_bytes) for p in peers]
        fwd_transfers.extend(hops)
        for p, t in zip(peers, concurrent(hops, links)):
            download[p] = first_hop[r] + t
    return update_bytes, download, forwards, downs, fwd_transfers


def density_path(workers: Sequence[tuple[NodeSpec, int]], server: NodeSpec,
                 links: Mapping[tuple[int, int], LinkSpec], task: TaskSpec,
                 comp: CompressionSpec) -> list[list[float]]:
    """The densities of the compressed steps in order, until the trainer's rule settles; the
    last entry holds from there on.

    The first compressed step (warmup_steps + 1) and the next run at the target density: the
    server adapts from the second one's transmission times on (`trainer.planner.Planner.plan`), and each
    step's times set the next step's densities. The trainer's times are each upload's bytes at
    its link's rate as TCP measured it (`trainer.linkclock`: the best of recent delivery-rate
    samples, which sees the link's own rate even where uploads share it), so here they are the
    bytes at the link's goodput, without sharing or latency. The path stops once no density
    moves by DENSITY_SETTLED (the rule halves its log-distance to the fixed point each step at
    gamma 0.5).
    """
    nodes = [w for w, _ in workers]
    chunks = task_chunks(task, comp)
    seeded = comp.compressor == "randomk"
    rates = [link(links, w, server).mbps * _MBIT / 8 for w in nodes]
    d = [comp.density] * len(nodes)
    path = [d, d]
    for _ in range(200):
        times = [grad_bytes(task.dense_params, chunks, di, comp.value_bytes, seeded) / rate
                 for di, rate in zip(d, rates)]
        new = adapt_densities(d, times, target=comp.density, low=comp.density_min,
                              high=comp.density_max, gamma=comp.density_gamma, floor=comp.density_time_floor_s)
        settled = all(abs(a - b) <= DENSITY_SETTLED * b for a, b in zip(new, d))
        path.append(new)
        d = new
        if settled:
            break
    return path


# -- all-reduce -------------------------------------------------------------------------------


def ring(workers: Sequence[tuple[NodeSpec, int]], links: Mapping[tuple[int, int], LinkSpec],
         nbytes: float) -> tuple[float, list[Transfer]]:
    """Seconds of one ring all-reduce of `nbytes` per worker: 2(W-1) steps, each moving nbytes/W
    over every ring link at once (ring order = worker order), paced by the slowest."""
    nodes = [w for w, _ in workers]
    k = len(nodes)
    if k < 2 or nbytes <= 0:
        return 0.0, []
    hop = [Transfer(nodes[i], nodes[(i + 1) % k], nbytes / k) for i in range(k)]
    per_step = max(concurrent(hop, links))
    total = [Transfer(t.src, t.dst, 2 * (k - 1) * t.nbytes) for t in hop]
    return 2 * (k - 1) * per_step, total


def powersgd_elements(task: TaskSpec, rank: int) -> float:
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


def allreduce_step(workers: Sequence[tuple[NodeSpec, int]], links: Mapping[tuple[int, int], LinkSpec],
                   task: TaskSpec, comp: CompressionSpec, compressed: bool) -> Step:
    """A DDP step: the plain ring partly hidden behind backward, or (compressed) PowerSGD's
    factors after each worker's own PowerSGD work."""
    compute = [n / w.samples_per_s for w, n in workers]
    if compressed:
        # The hook runs after backward (one bucket on CPU): each worker's factorisation (the
        # profile's powersgd_s), then the rings; nothing overlaps.
        compress = [w.powersgd_at(comp.powersgd_rank) for w, _ in workers]
        elements = powersgd_elements(task, comp.powersgd_rank)
        ring_s, transfers = ring(workers, links, elements * 4)
        # P, then Q, then the uncompressed tensors: three rings, each paying its latency.
        k = len(workers)
        if k > 1:
            rtt_ms = max(link(links, workers[i][0], workers[(i + 1) % k][0]).rtt_ms for i in range(k))
            ring_s += 2 * 2 * (k - 1) * rtt_ms / 2000
        ready = [a + b for a, b in zip(compute, compress)]
        step_s = max(ready) + ring_s
        overlap = 0.0
    else:
        compress = [0.0] * len(workers)
        ready = compute
        ring_s, transfers = ring(workers, links, task.params * 4)
        overlap = -DDP_OVERLAP * min(BACKWARD_SHARE * max(compute), ring_s)
        step_s = max(compute) + ring_s + overlap
    crit = max(range(len(workers)), key=lambda i: ready[i])
    rows = []
    for i, (w, n) in enumerate(workers):
        sent = transfers[i].nbytes if transfers else 0.0
        rows.append({"node_id": w.node_id, "name": w.name, "batch": n, "compute_s": compute[i],
                     "compress_s": compress[i], "upload_s": ring_s, "download_s": 0.0, "comm_s": ring_s,
                     "granularity": ratio(compute[i], ring_s),
                     "upload_bytes": sent, "download_bytes": sent, "density": 1.0, "relay_for": []})
    breakdown = {"compute_s": compute[crit], "compress_s": compress[crit], "upload_s": ring_s, "server_s": 0.0,
                 "download_s": 0.0, "overlap_s": overlap}
    return Step(step_s, breakdown, rows, transfers)


def local_sgd_step(round_: Step, every: int, value_share: float = 1.0, delay: int = 0, fragments: int = 1) -> Step:
    """Local SGD's mean step: its compute (the slowest worker's), and 1/`every` of an outer step's
    exchange, the PS step `round_` less that compute (the pseudo-gradient travels as a gradient would, and the outer
    step's arithmetic is the same elementwise work as an update's). `value_share` scales the
    exchange's bytes and time, for a dense change sent narrower than the dense frames `round_`
    was sized with (fp16 is half of fp32); an overlapped exchange (`delay` inner steps) hides up
    to that many steps' compute of it. Streaming's `fragments` each send 1/P of the exchange,
    every H/P steps, each hiding up to min(delay, H/P) steps' compute (the link carries one
    fragment's exchange at a time)."""
    # Each worker takes its inner steps on its own: the slowest compute paces them, which need
    # not be the worker whose upload reached the server last.
    compute = max(row["compute_s"] for row in round_.workers)
    share = value_share / every
    whole = (round_.step_s - compute) * value_share
    hidden = min(delay, every // fragments) * compute
    exchange = fragments * max(0.0, whole / fragments - hidden) / every
    breakdown = {"compute_s": compute, "outer_exchange_s": exchange}
    scaled = ("compress_s", "upload_s", "download_s", "decode_s", "comm_s", "upload_bytes", "download_bytes")
    rows = []
    for row in round_.workers:
        row = dict(row) | {k: row[k] * share for k in scaled}
        row["granularity"] = ratio(row["compute_s"], row["comm_s"])
        rows.append(row)
    transfers = [replace(t, nbytes=t.nbytes * share) for t in round_.transfers]
    return Step(compute + exchange, breakdown, rows, transfers)  # bytes: all of them, hidden or not
