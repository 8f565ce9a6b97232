"""Compression cost of a 25M-parameter gradient against that model's step compute, same device.

    .venv/bin/python bench/compression.py --out results-compression.json

1. One training step (forward + backward) of each model is timed: `resnet50` (25.6M parameters,
   ImageNet head, 3x32x32 inputs with the small-input stem) and `widemlp` (25.5M parameters, the
   communication-bound model, digits-shaped inputs). Its real gradient is the codecs' input.
2. Each top-k selection method (sampled threshold with exact correction, torch.topk, full sort)
   is timed alone at the worker density and at the server's k = params/32.
3. The whole worker path (error feedback + selection + fp16 values + wire encoding) and the whole
   server path (same, at params/32) are timed and compared with the step compute (< 10%).
4. The trainer's own per-step paths over `--chunks` chunks of the gradient (the paper benchmark's
   pipeline): a worker's `worker_sparsify` of each chunk (momentum 0.9 into the velocity, error
   feedback, estimated top-k, fp16 values) and the server's `server_sparsify` of each at its k,
   summed over the chunks (one step's codec time, the wire's encoding left out).
5. A worker's application of one step's update (the server's k, the same chunks) under momentum
   correction: through the flat gradient and an SGD pass over every compressed tensor, against
   each chunk added straight into the tensors it spans (`add_payload`, the trainer's path).
Medians of --repeats runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch import nn

from trainer.compression import (
    SELECT_METHODS,
    CompressionState,
    build_compressor,
    select_topk,
)
from hybridtrain.tasks.models import build
from trainer.algorithm import Layout, add_payload, apply_payload, chunk_pieces, chunks, server_sparsify, worker_sparsify
from trainer.wire import Message, encode


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,widemlp")
    p.add_argument("--batch", type=int, default=32, help="per-worker batch of the timed step")
    p.add_argument("--density", type=float, default=0.01, help="worker density (the CLI default)")
    p.add_argument("--server-k-fraction", type=float, default=1 / 32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunks", type=int, default=4, help="the PS pipeline's chunks for the per-step paths")
    p.add_argument("--out", default=None, help="JSON results file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    results = []
    for name in args.models.split(","):
        results.append(bench_model(name, args, device))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    """Time one model's step and its gradient's compression; print its table."""
    shape, classes = ((3, 32, 32), 1000) if name.startswith("resnet") else ((1, 8, 8), 10)
    torch.manual_seed(0)
    model = build(name, shape, classes).to(device)
    params = sum(q.numel() for q in model.parameters())
    x = torch.randn(args.batch, *shape, device=device)
    y = torch.randint(0, classes, (args.batch,), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()

    step_s = timed(step, device, args.repeats)
    grad = torch.cat([q.grad.reshape(-1) for q in model.parameters()])

    rows = []
    for label, density in (("worker", args.density), ("server", args.server_k_fraction)):
        k = max(1, round(density * params))
        for method in SELECT_METHODS:
            s = timed(lambda k=k, m=method: select_topk(grad, k, m), device, args.repeats)
            rows.append({"path": label, "what": f"select ({method})", "density": density, "k": k,
                         "seconds": s, "pct_of_step": 100 * s / step_s})
        codec = build_compressor("topk", value_dtype="fp16", error_feedback=True, select="estimate")
        state = CompressionState(density=density, residual=torch.zeros_like(grad))

        def full(codec=codec, state=state) -> None:
            payload = codec.compress(grad, state)
            encode(Message(1, 1, 1, [0.0] * 4, [payload]))

        s = timed(full, device, args.repeats)
        rows.append({"path": label, "what": "EF + estimated top-k + fp16 + encode", "density": density,
                     "k": k, "seconds": s, "pct_of_step": 100 * s / step_s})

    rows.extend(_chunked_paths(grad, args, device, step_s))
    rows.extend(_apply_paths(model, args, device, step_s))

    print(f"\n{name}: {params / 1e6:.1f}M parameters, batch {args.batch}, device {device}, "
          f"{args.threads} thread(s); step compute (fwd+bwd) {step_s * 1e3:.1f} ms")
    print("| path | what | density | k | ms | % of step |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['what']} | {r['density']:.4f} | {r['k']} | "
              f"{r['seconds'] * 1e3:.1f} | {r['pct_of_step']:.1f} |")
    return {"model": name, "params": params, "batch": args.batch, "device": str(device),
            "threads": args.threads, "step_compute_s": step_s, "rows": rows}


def _chunked_paths(grad: torch.Tensor, args: argparse.Namespace, device: torch.device, step_s: float) -> list[dict]:
    """One step's codec time of a worker and of the server over `args.chunks` chunks of `grad`."""
    bounds = chunks(grad.numel(), args.chunks)
    codec = build_compressor("topk", value_dtype="fp16", error_feedback=True, select="estimate")
    velocity = torch.zeros_like(grad)
    worker = [CompressionState(density=args.density) for _ in bounds]
    server = [CompressionState(density=args.server_k_fraction) for _ in bounds]

    def worker_step() -> None:
        for (a, b), state in zip(bounds, worker):
            worker_sparsify(grad[a:b], codec=codec, state=state, velocity=velocity[a:b], momentum=0.9,
                            dense_step=False)

    def server_step() -> None:
        for (a, b), state in zip(bounds, server):
            server_sparsify(grad[a:b], codec=codec, state=state, dense_step=False)

    rows = []
    for label, density, fn in (("worker", args.density, worker_step), ("server", args.server_k_fraction, server_step)):
        s = timed(fn, device, args.repeats)
        rows.append({"path": label, "what": f"{args.chunks} chunks: {label}_sparsify (estimate, fp16)",
                     "density": density, "k": max(1, round(density * grad.numel())), "seconds": s,
                     "pct_of_step": 100 * s / step_s})
    return rows


def _apply_paths(model: nn.Module, args: argparse.Namespace, device: torch.device, step_s: float) -> list[dict]:
    """A worker's application of one step's update (the server's k, `args.chunks` chunks) under
    momentum correction: through the flat gradient and an SGD pass over every compressed tensor
    (before 2026-12-04), and each chunk straight into the tensors it spans (`add_payload`)."""
    layout = Layout.of(model, 0)
    nd = layout.dense_numel
    params = dict(model.named_parameters())
    flat = torch.cat([params[n].grad.reshape(-1) for n in layout.names])
    bounds = chunks(layout.sparse_numel, args.chunks)
    codec = build_compressor("topk", value_dtype="fp16", error_feedback=True, select="estimate")
    updates = [server_sparsify(flat[nd + a : nd + b], codec=codec, dense_step=False,
                               state=CompressionState(density=args.server_k_fraction)) for a, b in bounds]
    weights = {n: params[n].detach().clone() for n in layout.names}
    compressed = [(weights[n], off) for n, off in zip(layout.names, layout.offsets) if off >= nd]
    buffer = torch.zeros(layout.numel, device=device)
    pieces = [[(weights[name].view(-1), first, end, s, e, -0.1)
               for name, first, end, s, e in chunk] for chunk in chunk_pieces(layout, bounds)]

    def through_grad() -> None:
        for (a, b), update in zip(bounds, updates):
            apply_payload(buffer[nd + a : nd + b], update)
        for w, off in compressed:
            w.view(-1).add_(buffer[off : off + w.numel()], alpha=-0.1)

    def in_place() -> None:
        for chunk, update in zip(pieces, updates):
            add_payload(chunk, update)

    rows = []
    for what, fn in (("through the flat gradient + SGD pass", through_grad), ("in place (add_payload)", in_place)):
        s = timed(fn, device, args.repeats)
        rows.append({"path": "worker", "what": f"apply one update, {args.chunks} chunks: {what}",
                     "density": args.server_k_fraction, "k": sum(u.count for u in updates), "seconds": s,
                     "pct_of_step": 100 * s / step_s})
    return rows


if __name__ == "__main__":
    sys.exit(main())
