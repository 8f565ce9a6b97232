"""One worker's compute alone: forward, backward and an SGD step on its batch, no communication.

`python -m agents.testbed.standalone --model M --dataset D --batch N --seconds S` prints one
JSON line with samples/s. Run inside a node's namespace and cgroup, it measures what that
emulated GPU can do at most; the sum over the workers is the benchmark's ideal throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def measure(model_name: str, dataset: str, batch: int, seconds: float, warmup: int = 2) -> dict[str, float]:
    """Train steps on `batch` samples for about `seconds` (after `warmup` steps); samples/s."""
    import torch
    import torch.nn.functional as F

    from trainer.data import load_dataset
    from trainer.models import build_model

    torch.set_num_threads(1)
    data = load_dataset(dataset)
    model = build_model(model_name, data.input_shape, data.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    steps, start = 0, 0.0
    gen = torch.Generator().manual_seed(0)
    while True:
        idx = torch.randint(0, len(data.y_train), (batch,), generator=gen)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
        steps += 1
        if steps == warmup:
            start = time.perf_counter()
        elif steps > warmup and time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    timed = steps - warmup
    return {"samples_per_s": batch * timed / elapsed, "steps": timed, "seconds": elapsed}


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the measurement as one JSON line."""
    p = argparse.ArgumentParser(prog="python -m agents.testbed.standalone")
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.dataset, args.batch, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
