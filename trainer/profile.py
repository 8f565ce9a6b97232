"""`python -m trainer.profile --task T [--task-args J] [--batch N] [--seconds S]`: what the
control plane needs to know of a task on this node, as one JSON line on stdout.

{"params", "dense_params", "buffer_numel", "matrix_shapes", "train_samples", "eval_samples",
"batch", "samples_per_s", "step_s", "worker_compress_s", "server_compress_s", "aggregate_s",
"worker_compress_s_per_kept", "server_compress_s_per_kept", "aggregate_s_per_kept",
"aggregate_fixed_s", "worker_compress_density", "server_compress_k_fraction",
"dense_aggregate_s_per_element", "dense_encode_s_per_element", "powersgd_s", "powersgd_rank",
"metrics"}: the parameter count, the part that travels dense (1-D and small tensors, at the
trainer's default --dense-numel) and the (rows, cols) of every matrix-shaped parameter (which
PowerSGD factors), the data sets' sizes (null for a stream), the node's throughput of
forward, backward and optimizer step at batch N (the median step of about S seconds, at
least 3 steps, after two untimed ones), and what the compression path costs on this node: a
worker's error feedback (with DGC's velocity where the task's SGD has a momentum), top-k and
frame encoding of the model's compressed part (`worker_compress_s`), the server's top-k of it
and encoding (`server_compress_s`), and decoding and adding one worker's compressed frame
(`aggregate_s`, of which the sum's zeroing is `aggregate_fixed_s`), each at the trainer's
default density and k_s (`worker_compress_density`, `server_compress_k_fraction`) and growing
by its `*_per_kept` per element kept beyond; what a dense frame costs per element (decoding
and adding one worker's, `dense_aggregate_s_per_element`; encoding one,
`dense_encode_s_per_element`), and PowerSGD's work on a worker per step at the default rank
(`powersgd_s`), each the median of a few repeats. The control plane's performance model
(app/perfmodel/predict.py) reads these. A task that cannot be loaded exits 1 with the reason on stderr.
Node agents run this in a child process, so the agent itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from hybridtrain.option_flags import add_option
from hybridtrain.task import TaskError, load_task, parse_task_args


# A slow node's step takes seconds: the profile times at least this many, after two untimed.
WARMUP_STEPS = 2
MIN_TIMED_STEPS = 3

# The largest dense frame the profile times (4 MB). The `ps` server of a ResNet-18 run on the
# paper testbed spent 0.084 s a step on summing 4 x 11.2M elements and encoding 11.2M on its
# 0.3-core quota, ~0.5 ns an element of a full core: what frames of this size measure, while
# frames of 8 MB and more measured 3-10x that (fresh pages and cache misses of one-off buffers).
DENSE_FRAME_NUMEL = 1 << 20

# Compression's cost grows with what it keeps (gathering the kept values, the residual's and
# the velocity's update, the frame's encoding) while the selection is one pass whatever k: the
# profile times it at the trainer's defaults and at these, and reports the slope per element
# kept. ResNet-18's worker compression on one core: 0.048 s at density 0.01, 0.090 s at 0.1.
COMPRESSION_HIGH_DENSITY = 0.1
COMPRESSION_HIGH_K_FRACTION = 1 / 8
COMPRESSION_COST_FIELDS = ("worker_compress_s", "server_compress_s", "aggregate_s", "worker_compress_s_per_kept",
                           "server_compress_s_per_kept", "aggregate_s_per_kept", "aggregate_fixed_s")


def profile(task_ref: str, task_args: dict, *, batch: int, seconds: float, device: str = "cpu") -> dict:
    """Measure the task at `batch` on `device`; the result as a JSON-ready dict."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, default_collate

    from trainer.devices import resolve_device, to_device
    from trainer.loader import make_loader

    task = load_task(task_ref, task_args)
    dev = resolve_device(device, 0)
    torch.manual_seed(0)
    model = task.model().to(dev)
    optimizer = task.optimizer(model)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    sized = not isinstance(task.train_data, IterableDataset)
    train_samples = len(task.train_data) if sized else None
    eval_data = task.eval_data
    eval_samples = len(eval_data) if eval_data is not None and not isinstance(eval_data, IterableDataset) else None
    if sized:
        batches = make_loader(task.train_data, first_step=1, last_step=10**9, worker=0, batch_sizes=[batch],
                              seed=0, collate=task.collate or default_collate, transform=task.transform)
    else:
        batches = _cycle(lambda: iter(DataLoader(task.train_data, batch_size=batch, collate_fn=task.collate)))

    def one_step() -> None:
        inputs, target = next(batches)
        inputs, target = to_device(inputs, dev), to_device(target, dev)
        optimizer.zero_grad()
        task.loss(model(inputs), target).backward()
        optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(WARMUP_STEPS):  # the allocator, kernels, lazy modules, the data's first pages
        one_step()
    times: list[float] = []
    t0 = time.perf_counter()
    while len(times) < MIN_TIMED_STEPS or time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t)
    # The median: on a node with a CPU quota (a cloud VM's share, the testbed's cgroups) one
    # step slowed by a neighbour or a throttled period moves a mean of two or three a long way.
    step_s = statistics.median(times)
    from trainer.algorithm import Layout, correction_momentum
    from trainer.config import TrainConfig

    layout = Layout.of(model, TrainConfig.dense_numel)
    momentum = correction_momentum(optimizer.param_groups) if isinstance(optimizer, torch.optim.SGD) else 0.0
    costs = compression_costs(layout.sparse_numel, momentum=momentum or 0.0)
    # PowerSGD factors each matrix-shaped gradient as DDP's hook sees it: rows x (numel / rows).
    shapes = [[p.shape[0], p.numel() // p.shape[0]] for p in model.parameters() if p.requires_grad and p.dim() > 1]
    costs |= dense_frame_costs(params)
    costs |= {"powersgd_s": powersgd_cost(shapes, params, rank=TrainConfig.powersgd_rank),
              "powersgd_rank": TrainConfig.powersgd_rank}
    return {"params": params, "dense_params": layout.dense_numel, "buffer_numel": layout.spec.buffer_numel,
            "matrix_shapes": shapes,
            "train_samples": train_samples, "eval_samples": eval_samples, "batch": batch,
            "samples_per_s": batch / step_s, "step_s": step_s, **costs, "metrics": task.metric_directions}


def compression_costs(sparse_numel: int, *, momentum: float = 0.0, repeats: int = 5) -> dict[str, float]:
    """Seconds of the PS strategies' compression path on this node for a compressed part of
    `sparse_numel` elements, at the trainer's defaults and per element kept beyond them."""
    import torch

    from trainer.algorithm import aggregate, server_sparsify, worker_sparsify
    from trainer.compression import CompressionState, Payload, build_compressor, k_for
    from trainer.config import TrainConfig
    from trainer.frames import Grad, pack, unpack

    cfg = TrainConfig()
    refs = {"worker_compress_density": cfg.density, "server_compress_k_fraction": cfg.server_k_fraction}
    if sparse_numel == 0:
        return {k: 0.0 for k in COMPRESSION_COST_FIELDS} | refs
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(sparse_numel, generator=gen)
    codec = build_compressor(cfg.compressor, value_dtype=cfg.value_dtype, select=cfg.select)
    no_dense = Payload(0, torch.zeros(0))

    def worker(density: float) -> tuple[bytes, float]:
        # As a worker's step 2: DGC's velocity (two passes) where the task's SGD has one, Top-k
        # with error feedback, the velocity's masking, the frame's encoding.
        state = CompressionState(density=density, residual=torch.randn(sparse_numel, generator=gen))
        velocity = torch.randn(sparse_numel, generator=gen) if momentum else None
        t0 = time.perf_counter()
        sent = worker_sparsify(grad, codec=codec, state=state, velocity=velocity, momentum=momentum,
                               dense_step=False)
        frame = pack(Grad(1, 1, 0, 0.0, 1, 0.0, 0.0, 0.0, no_dense, sent))
        return frame, time.perf_counter() - t0

    def aggregate_one(frame) -> float:
        t0 = time.perf_counter()
        aggregate([unpack(frame)], 0, sparse_numel)
        return time.perf_counter() - t0

    def server(fraction: float) -> float:
        state = CompressionState(density=fraction, residual=torch.zeros(sparse_numel))
        total = grad * 0.5
        t0 = time.perf_counter()
        update = server_sparsify(total, codec=codec, state=state, dense_step=False)
        pack(Grad(1, 0, 0, 0.0, 1, 0.0, 0.0, 0.0, no_dense, update))
        return time.perf_counter() - t0

    def zeros() -> float:
        t0 = time.perf_counter()
        torch.zeros(sparse_numel)
        return time.perf_counter() - t0

    lo_d, hi_d = cfg.density, COMPRESSION_HIGH_DENSITY
    lo_k, hi_k = cfg.server_k_fraction, COMPRESSION_HIGH_K_FRACTION
    times: dict[str, list[float]] = {k: [] for k in ("w_lo", "w_hi", "a_lo", "a_hi", "s_lo", "s_hi", "z")}
    for i in range(repeats + 1):
        frame_lo, w_lo = worker(lo_d)
        frame_hi, w_hi = worker(hi_d)
        got = {"w_lo": w_lo, "w_hi": w_hi, "a_lo": aggregate_one(frame_lo), "a_hi": aggregate_one(frame_hi),
               "s_lo": server(lo_k), "s_hi": server(hi_k), "z": zeros()}
        if i:  # the first round warms the allocator and the selection's workspace
            for k, v in got.items():
                times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}

    def per_kept(lo: float, hi: float, f_lo: float, f_hi: float) -> float:
        # A slope below zero is the timer's noise, not a cost that falls with k.
        return max(0.0, (hi - lo) / max(1, k_for(sparse_numel, f_hi) - k_for(sparse_numel, f_lo)))

    return {"worker_compress_s": med["w_lo"], "server_compress_s": med["s_lo"], "aggregate_s": med["a_lo"],
            "worker_compress_s_per_kept": per_kept(med["w_lo"], med["w_hi"], lo_d, hi_d),
            "server_compress_s_per_kept": per_kept(med["s_lo"], med["s_hi"], lo_k, hi_k),
            "aggregate_s_per_kept": per_kept(med["a_lo"], med["a_hi"], lo_d, hi_d),
            "aggregate_fixed_s": min(med["z"], med["a_lo"]), **refs}


def dense_frame_costs(numel: int, repeats: int = 5, frames: int = 4) -> dict[str, float]:
    """Seconds per element of a dense frame (a `ps` step, a warm-up step, the dense part): the
    server's decoding of `frames` workers' GRAD frames and adding them into the sum, per frame,
    and encoding one frame. Measured on frames of at most DENSE_FRAME_NUMEL elements in the
    steady state (the allocator warm), as a running server's are."""
    import torch

    from trainer.algorithm import aggregate
    from trainer.compression import Payload
    from trainer.frames import Grad, Update, pack, unpack

    n = min(numel, DENSE_FRAME_NUMEL)
    if n == 0:
        return {"dense_aggregate_s_per_element": 0.0, "dense_encode_s_per_element": 0.0}
    values = torch.randn(n, generator=torch.Generator().manual_seed(0))
    sent = [pack(Grad(1, w, 0, 0.0, 1, 0.0, 0.0, 0.0, Payload(0, torch.zeros(0)), Payload(n, values)))
            for w in range(frames)]
    decode_add, encode = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        pack(Update(1, 0, Payload(0, torch.zeros(0)), Payload(n, values)))
        t1 = time.perf_counter()
        aggregate([unpack(f) for f in sent], 0, n)
        t2 = time.perf_counter()
        if i:  # the first round warms the allocator
            encode.append(t1 - t0)
            decode_add.append((t2 - t1) / frames)
    return {"dense_aggregate_s_per_element": statistics.median(decode_add) / n,
            "dense_encode_s_per_element": statistics.median(encode) / n}


def powersgd_cost(shapes: list[list[int]], params: int, *, rank: int, repeats: int = 3) -> float:
    """Seconds of PowerSGD's own work on one worker per compressed step, as PyTorch's
    `powerSGD_hook` does it on one bucket (error feedback on, warm start): add the residual, copy
    the uncompressed tensors out, P = M Q, orthogonalise P, Q = M^T P, M ~ P Q^T, the new residual
    and the copies back. The all-reduces are left out: the model times them on the links."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(params, generator=gen)
    residual = torch.zeros(params)
    compressed, plain, offset = [], 0, 0
    for rows, cols in shapes:
        r = min(rows, cols, rank)
        worth, _, _ = psgd._should_compress(rows, cols, r, 2.0)
        if worth:
            compressed.append((offset, rows, cols, torch.randn(cols, r, generator=gen)))
        else:
            plain += rows * cols
        offset += rows * cols
    plain += max(0, params - offset)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        grad = flat + residual  # error feedback: the bucket plus last step's residual
        # The uncompressed tensors go to a contiguous buffer for their own all-reduce.
        torch.empty(plain).copy_(grad[:plain])
        approx = torch.empty_like(grad)
        for start, rows, cols, q in compressed:
            m = grad[start:start + rows * cols].view(rows, cols)
            p = m @ q
            psgd._orthogonalize(p.unsqueeze(0))
            q.copy_(m.t() @ p)
            approx[start:start + rows * cols].view(rows, cols).copy_(p @ q.t())
        residual = grad - approx
        t1 = time.perf_counter()
        if i:  # the first round warms the allocator and the matmul kernels
            times.append(t1 - t0)
    return statistics.median(times) if compressed else 0.0


def _cycle(make):
    """Batches of a stream, read again from its start when it ends (a short stream still
    gives the profile enough steps)."""
    while True:
        empty = True
        for item in make():
            empty = False
            yield item
        if empty:
            raise TaskError("the training data yielded no batch")


def build_parser() -> argparse.ArgumentParser:
    """The profiler's flags; the task's come from hybridtrain.option_flags, as the trainer's do."""
    p = argparse.ArgumentParser(prog="python -m trainer.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(p, "task", required=True)
    add_option(p, "task_args", "{}")
    p.add_argument("--batch", type=int, default=32, help="the batch of the steps it times (default 32)")
    p.add_argument("--seconds", type=float, default=3.0, help="time steps for about this long (default 3)")
    add_option(p, "device", "cpu", note="here where the task is measured; default cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--code-dir", default=None, help="where the task's modules are (agents set it)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, profile, print one JSON line; 1 on a bad task, 2 on bad usage."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.batch < 1 or args.seconds < 0:
        p.error("--batch must be >= 1 and --seconds >= 0")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from trainer.runtime import use_code_dir

    use_code_dir(args.code_dir)
    try:
        result = profile(args.task, parse_task_args(args.task_args), batch=args.batch, seconds=args.seconds,
                         device=args.device)
    except TaskError as exc:
        print(f"profile: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the user's code may raise anything; say what
        print(f"profile: task {args.task} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
