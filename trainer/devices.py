"""Which device a rank trains on, and moving a batch there."""

from __future__ import annotations

from typing import Any

import torch


def resolve_device(name: str, local_rank: int) -> torch.device:
    """cpu, cuda (one GPU per local rank, round robin) or auto."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def to_device(obj: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) moved to `device`; copies from pinned host
    memory to a GPU are non-blocking."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=obj.is_pinned()) if obj.device != device else obj
    if isinstance(obj, (list, tuple)):
        moved = [to_device(x, device) for x in obj]
        return type(obj)(moved) if not hasattr(obj, "_fields") else type(obj)(*moved)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
