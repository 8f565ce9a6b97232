"""Task profiles: how fast a node trains a task, measured by its agent."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Double, ForeignKey, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, str_enum, utcnow

__all__ = ["ProfileStatus", "TaskProfile"]


class ProfileStatus(enum.StrEnum):
    """pending -> done | failed."""

    pending = "pending"
    done = "done"
    failed = "failed"


class TaskProfile(Base):
    """One measurement of one task (with its args and bundle) on one node."""

    __tablename__ = "task_profiles"

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    # sha256 of the canonical JSON of (bundle_sha256, task, task_args): what the planner looks up.
    task_key: Mapped[str] = mapped_column(String(64), index=True)
    task: Mapped[str] = mapped_column(String(255))
    task_args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # A profile of code that was deleted measures nothing anyone can run again.
    bundle_sha256: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("bundles.sha256", ondelete="CASCADE")
    )
    batch_size: Mapped[int]
    device: Mapped[str] = mapped_column(String(8), default="auto")
    status: Mapped[ProfileStatus] = mapped_column(
        str_enum(ProfileStatus, "status"), default=ProfileStatus.pending
    )
    params: Mapped[int | None] = mapped_column(BigInteger)
    train_samples: Mapped[int | None] = mapped_column(BigInteger)
    eval_samples: Mapped[int | None] = mapped_column(BigInteger)
    samples_per_s: Mapped[float | None] = mapped_column(Double)
    step_s: Mapped[float | None] = mapped_column(Double)
    # (max - min) / median of the samples/s of the profiler's runs kept, and how many runs the
    # agent made (agents.profiles.stable_measurement); null for a profile of one run.
    spread: Mapped[float | None] = mapped_column(Double)
    repeats: Mapped[int | None]
    # Evaluation metric name -> whether higher is better, as the task declares them.
    metrics: Mapped[dict[str, Any] | None]
    # The agent's whole result (trainer.profile's JSON): the performance model's inputs
    # (dense_params, buffer_numel, worker_compress_s, ...) have no columns of their own.
    result: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    measured_at: Mapped[datetime | None]
