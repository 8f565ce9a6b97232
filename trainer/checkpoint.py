"""Checkpoints: one file per rank per step, written atomically; resume from the newest step that
every rank still has (agreed over the process group, so per-machine directories work too)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from trainer.config import RESUMABLE_CHANGES, TrainConfig

KEEP = 2
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def rank_path(directory: str | Path, step: int, rank: int) -> Path:
    """Where rank `rank` keeps its state of step `step`."""
    return Path(directory) / f"step-{step:08d}" / f"rank-{rank}.pt"


def save(directory: str | Path, step: int, rank: int, state: dict[str, Any], cfg: TrainConfig) -> Path:
    """Write `state` plus the config atomically, then prune all but the newest KEEP steps."""
    path = rank_path(directory, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "rank": rank, "config": cfg.to_dict(), **state}, tmp)
    os.replace(tmp, path)
    for old in saved_steps(directory, rank)[:-KEEP]:
        rank_path(directory, old, rank).unlink(missing_ok=True)
    return path


def saved_steps(directory: str | Path, rank: int) -> list[int]:
    """Steps this rank has a complete file for, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / f"rank-{rank}.pt").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def agreed_resume_step(directory: str | Path, rank: int) -> int:
    """The newest step every rank can resume from (0 if any rank has none); collective call."""
    import torch.distributed as dist

    steps = saved_steps(directory, rank)
    mine = torch.tensor([steps[-1] if steps else 0], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    step = int(mine.item())
    if step and step not in steps:
        raise RuntimeError(
            f"rank {rank}: the ranks agree to resume at step {step}, but {directory} only has {steps}"
        )
    return step


def load(directory: str | Path, step: int, rank: int, cfg: TrainConfig) -> dict[str, Any]:
    """Read this rank's state of `step`, refusing one written by a different experiment."""
    state = torch.load(rank_path(directory, step, rank), map_location="cpu", weights_only=False)
    saved = TrainConfig.from_dict(state["config"])
    diff = [
        f"{k}: checkpoint {getattr(saved, k)!r} vs now {getattr(cfg, k)!r}"
        for k in saved.to_dict()
        if k not in RESUMABLE_CHANGES and getattr(saved, k) != getattr(cfg, k)
    ]
    if diff:
        raise ValueError("cannot resume a different run configuration: " + "; ".join(diff))
    return state
