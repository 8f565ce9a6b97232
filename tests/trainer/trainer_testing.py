"""Helpers for the trainer tests: run the CLI as a subprocess, read its metrics, tiny set-ups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from trainer.data import Dataset

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` with one thread per role; returns the finished process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--threads", "1", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def read_metrics(path: Path) -> list[dict]:
    """The JSON-lines records of a run."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(records: list[dict], name: str, rank: int = 0) -> dict[int, float]:
    """step -> value of one metric of one rank."""
    return {r["step"]: r["value"] for r in records if r["name"] == name and r["rank"] == rank}


def tiny_dataset(n: int = 256, features: int = 12, seed: int = 0) -> Dataset:
    """A learnable 3-class problem small enough for exact-arithmetic comparisons."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 3, features // 3, generator=gen)
    w = torch.randn(features, 3, generator=gen)
    y = (x.reshape(n, -1) @ w).argmax(1)
    return Dataset(x, y, x[:64].clone(), y[:64].clone(), 3)


def tiny_mlp(features: int = 12, seed: int = 0) -> nn.Module:
    """No BatchNorm: the gradient of a concatenated batch is then exactly the weighted sum."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(features, 64), nn.Tanh(), nn.Linear(64, 3))
