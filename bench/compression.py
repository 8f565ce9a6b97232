"""Compression cost of a 25M-parameter gradient against that model's step compute, same device.

    .venv/bin/python bench/compression.py --out results-compression.json

1. One training step (forward + backward) of each model is timed: `resnet50` (25.6M parameters,
   ImageNet head, 3x32x32 inputs with the small-input stem) and `widemlp` (25.5M parameters, the
   communication-bound model, digits-shaped inputs). Its real gradient is the codecs' input.
2. Each top-k selection method (sampled threshold with exact correction, torch.topk, full sort)
   is timed alone at the worker density and at the server's k = params/32.
3. The whole worker path (error feedback + selection + fp16 values + wire encoding) and the whole
   server path (same, at params/32) are timed and compared with the step compute (< 10%).
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

from trainer.compression import (
    SELECT_METHODS,
    CompressionState,
    build_compressor,
    select_topk,
)
from hybridtrain.tasks.models import build
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

    print(f"\n{name}: {params / 1e6:.1f}M parameters, batch {args.batch}, device {device}, "
          f"{args.threads} thread(s); step compute (fwd+bwd) {step_s * 1e3:.1f} ms")
    print("| path | what | density | k | ms | % of step |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['what']} | {r['density']:.4f} | {r['k']} | "
              f"{r['seconds'] * 1e3:.1f} | {r['pct_of_step']:.1f} |")
    return {"model": name, "params": params, "batch": args.batch, "device": str(device),
            "threads": args.threads, "step_compute_s": step_s, "rows": rows}


if __name__ == "__main__":
    sys.exit(main())
