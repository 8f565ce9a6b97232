"""Checkpoints: one file per checkpoint step holding everything a run resumes from, with any
set of workers (docs/elastic.md). Under a parameter server the server writes it (its own
aggregation state, plus the model and optimizer state one live worker sends: the replicas are
equal); under all-reduce, rank 0 writes it. Written atomically; the newest KEEP are kept."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch

from trainer.config import RESUMABLE_CHANGES, SECRET_FIELDS, TrainConfig

KEEP = 2
FORMAT = "hybridtrain-run/1"
_FILE = re.compile(r"^run-step-(\d{8})\.pt$")


def run_path(directory: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` is kept."""
    return Path(directory) / f"run-step-{step:08d}.pt"


def save(directory: str | Path, step: int, state: dict[str, Any], cfg: TrainConfig) -> Path:
    """Write `state` with the step and the config atomically, then prune all but the newest KEEP."""
    path = run_path(directory, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    # The run's report token never goes into a file that is uploaded and kept.
    config = {k: (None if k in SECRET_FIELDS else v) for k, v in cfg.to_dict().items()}
    torch.save({"format": FORMAT, "step": step, "config": config, **state}, tmp)
    os.replace(tmp, path)
    for old in saved_steps(directory)[:-KEEP]:
        run_path(directory, old).unlink(missing_ok=True)
    return path


def saved_steps(directory: str | Path) -> list[int]:
    """Steps with a complete checkpoint file, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _FILE.match(p.name)))


def latest(directory: str | Path) -> Path | None:
    """The newest checkpoint file in `directory`, or None."""
    steps = saved_steps(directory)
    return run_path(directory, steps[-1]) if steps else None


def read(data: bytes | str | Path, cfg: TrainConfig) -> dict[str, Any]:
    """A checkpoint's state from its bytes or file, refusing one of a different experiment."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    state = torch.load(source, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("not a hybridtrain checkpoint (or one written by an older version: per-rank files "
                         "are no longer read)")
    saved = TrainConfig.from_dict(state["config"])
    diff = [
        f"{k}: checkpoint {getattr(saved, k)!r} vs now {getattr(cfg, k)!r}"
        for k in saved.to_dict()
        if k not in RESUMABLE_CHANGES and getattr(saved, k) != getattr(cfg, k)
    ]
    if diff:
        raise ValueError("cannot resume a different run configuration: " + "; ".join(diff))
    return state


def to_bytes(obj: Any) -> bytes:
    """torch.save of `obj` into bytes (an optimizer's state travels this way)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """The inverse of `to_bytes`."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
