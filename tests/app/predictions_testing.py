"""Helpers of the prediction tests: a task profile whose stored result carries the model's
inputs (as an agent reports trainer.profile's JSON line)."""

from __future__ import annotations

from typing import Any

from app.models import ProfileStatus, TaskProfile
from app.models.base import utcnow
from app.queries.profiles import task_key

TASK = "hybridtrain.tasks.digits:widecnn"
# A profile result as trainer.profile prints it (the model's inputs included).
RESULT: dict[str, Any] = {
    "params": 1_000_000, "dense_params": 10_000, "buffer_numel": 0, "train_samples": 10_000,
    "eval_samples": 1000, "batch": 32, "samples_per_s": 500.0, "step_s": 0.064,
    "worker_compress_s": 0.01, "server_compress_s": 0.01, "aggregate_s": 0.002, "metrics": {},
}


def add_profile(session, node_id: int, *, task: str = TASK, **changes: Any) -> None:  # type: ignore[no-untyped-def]
    """A finished profile of `task` on the node, with its whole result stored (committed)."""
    result = RESULT | changes
    session.add(TaskProfile(
        node_id=node_id, task_key=task_key(task, {}, None), task=task, task_args={}, batch_size=32,
        device="cpu", status=ProfileStatus.done, params=result["params"],
        train_samples=result["train_samples"], eval_samples=result["eval_samples"],
        samples_per_s=result["samples_per_s"], step_s=result["step_s"], metrics={}, result=result,
        created_by="admin", measured_at=utcnow(),
    ))
    session.commit()
