"""Runs and what they produce: the plan (one row per rank), lifecycle, metrics and logs; and
the agents bound to nodes."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, TimestampMixin, str_enum, utcnow

__all__ = [
    "NodeAgent",
    "Run",
    "RunLog",
    "RunMetric",
    "RunStatus",
    "RunWorker",
    "WorkerStatus",
]


# Metric and log rows outgrow int4 on a busy control plane; SQLite auto-increments only an
# INTEGER PRIMARY KEY (which is 64-bit there anyway).
_BIG_ID = BigInteger().with_variant(Integer, "sqlite")


class RunStatus(enum.StrEnum):
    """queued -> launching -> running -> succeeded | failed | cancelled."""

    queued = "queued"  # planned and stored, launch orders not sent yet
    launching = "launching"  # launch orders sent; not every rank has started
    running = "running"  # every rank has started
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED_RUN_STATUSES


FINISHED_RUN_STATUSES = frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled})
ACTIVE_RUN_STATUSES = frozenset({RunStatus.queued, RunStatus.launching, RunStatus.running})


class WorkerStatus(enum.StrEnum):
    """One rank: planned -> launched -> running -> succeeded | failed | cancelled."""

    planned = "planned"
    launched = "launched"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


FINISHED_WORKER_STATUSES = frozenset(
    {WorkerStatus.succeeded, WorkerStatus.failed, WorkerStatus.cancelled}
)


class NodeAgent(Base):
    """The agent bound to a node: only the hash of the token it made up is stored."""

    __tablename__ = "node_agents"

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The join token it registered with: while the node keeps that join token, another agent
    # presenting it is refused (the token is one-time); a rotated join token may rebind.
    join_token_hash: Mapped[str] = mapped_column(String(64))
    hostname: Mapped[str | None] = mapped_column(String(255))
    registered_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(TimestampMixin, Base):
    """A training run across nodes, its plan's parameters and where it stands."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("created_by", "idempotency_key"),
        CheckConstraint("global_batch_size > 0", name="global_batch_size_positive"),
        CheckConstraint("max_steps > 0", name="max_steps_positive"),
        Index("ix_runs_status_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    status: Mapped[RunStatus] = mapped_column(
        str_enum(RunStatus, "status"), default=RunStatus.queued
    )
    reason: Mapped[str | None] = mapped_column(Text)
    strategy: Mapped[str] = mapped_column(String(32))
    # What is trained: a task reference `module:function` and its JSON arguments, or (with
    # `script`) the user's own training script inside the bundle.
    task: Mapped[str] = mapped_column(String(255))
    task_args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # No foreign key: a finished run keeps naming its code after the bundle is deleted (the
    # bundle's delete refuses while an active run uses it).
    bundle_sha256: Mapped[str | None] = mapped_column(String(64), index=True)
    script: Mapped[str | None] = mapped_column(String(255))
    script_args: Mapped[list[str] | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    global_batch_size: Mapped[int]
    # NULL while a run given in epochs waits for the trainer to report the steps they take.
    max_steps: Mapped[int | None]
    epochs: Mapped[int | None]
    # "accuracy>=0.9", "val_loss<=0.3" (hybridtrain.contract.parse_target).
    target: Mapped[str | None] = mapped_column(String(64))
    # False: the run records its time to target and trains on to max_steps.
    stop_at_target: Mapped[bool] = mapped_column(default=True, server_default=true())
    seed: Mapped[int] = mapped_column(default=0)
    allocation: Mapped[str] = mapped_column(String(16))  # equal, flops, measured
    device: Mapped[str] = mapped_column(String(8), default="auto")
    compression: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Re-split the global batch every N steps from observed compute times (None: never).
    rebalance_every: Mapped[int | None]
    # Evaluate every N steps (None: the trainer's default).
    eval_every: Mapped[int | None]
    cluster_id: Mapped[int | None] = mapped_column(ForeignKey("clusters.id", ondelete="SET NULL"))
    ps_node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    master_addr: Mapped[str | None] = mapped_column(String(255))
    master_port: Mapped[int | None]
    # The per-run secret the trainer presents with its metrics; only its hash is stored.
    metrics_token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_by: Mapped[str] = mapped_column(String(128))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    # sha256 of the request that created the run: a reused key with another body is refused.
    request_fingerprint: Mapped[str | None] = mapped_column(String(64))
    launched_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # The model's prediction when the run was created (app.queries.predictions), priced; None
    # where a node had no profile of the task. Its page sets it beside what the run measured.
    prediction: Mapped[dict[str, Any] | None]

    workers: Mapped[list[RunWorker]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True,
        order_by="RunWorker.rank",
    )


class RunWorker(Base):
    """One rank of a run as planned (node, role, batch size) and as it went."""

    __tablename__ = "run_workers"
    __table_args__ = (
        UniqueConstraint("run_id", "rank"),
        CheckConstraint("rank >= 0", name="rank_nonnegative"),
        CheckConstraint("batch_size IS NULL OR batch_size > 0", name="batch_size_positive"),
        Index("ix_run_workers_node_id_status", "node_id", "status"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int]
    role: Mapped[str] = mapped_column(String(8))  # ps, worker
    # SET NULL keeps the history of runs whose node was later deleted; node_name stays.
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    node_name: Mapped[str] = mapped_column(String(128))
    batch_size: Mapped[int | None]
    gpu_model: Mapped[str | None] = mapped_column(String(64))
    gpu_index: Mapped[int | None]
    speed: Mapped[float | None]  # the planner's s_m, in `speed_unit`
    speed_unit: Mapped[str | None] = mapped_column(String(16))  # tflops, samples_per_s
    status: Mapped[WorkerStatus] = mapped_column(
        str_enum(WorkerStatus, "status"), default=WorkerStatus.planned
    )
    pid: Mapped[int | None]
    exit_code: Mapped[int | None]
    signal: Mapped[int | None]
    reason: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    run: Mapped[Run] = relationship(back_populates="workers")


class RunMetric(Base):
    """One measurement of one rank at one step (docs/architecture.md, "Trainer → control plane").

    The unique key is the dedup key of the wire contract, and its column order also serves
    the reads (a run's series by name, then rank). `peer` is -1 when the record has none, since
    NULLs never collide in a unique index.
    """

    __tablename__ = "run_metrics"
    __table_args__ = (UniqueConstraint("run_id", "name", "rank", "peer", "step"),)

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int]
    peer: Mapped[int] = mapped_column(default=-1)
    step: Mapped[int]
    t: Mapped[float] = mapped_column(Double)
    # NULL for a non-finite measurement (a diverged loss), which JSON cannot carry.
    value: Mapped[float | None] = mapped_column(Double)


class RunLog(Base):
    """One line of a role's output, as its agent shipped it; the newest lines are kept."""

    __tablename__ = "run_logs"
    __table_args__ = (UniqueConstraint("run_id", "rank", "seq"),)

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    rank: Mapped[int]
    seq: Mapped[int] = mapped_column(BigInteger)
    t: Mapped[float] = mapped_column(Double)
    line: Mapped[str] = mapped_column(Text)
