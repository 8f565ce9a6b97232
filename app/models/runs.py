"""Runs and what they produce: the plan (one row per rank), lifecycle, metrics and logs; and
the agents bound to nodes."""

from __future__ import annotations

import enum
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, TimestampMixin, str_enum, utcnow
# Imported here so that its table is registered with the runs' (ON DELETE CASCADE).
from app.models.checkpoints import RunCheckpoint
from hybridtrain.strategy_defaults import effective
from hybridtrain.train_options import CompressionOptions

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
    """queued -> launching -> running <-> degraded; running|degraded -> restarting -> launching;
    any active state -> succeeded | failed | cancelled, a launched one through cancelling
    (app.lifecycle.states has the table)."""

    queued = "queued"  # planned and stored, launch orders not sent yet
    launching = "launching"  # launch orders sent; not every rank has started
    running = "running"  # every rank has started
    degraded = "degraded"  # a worker was lost or left; the server trains on without it
    restarting = "restarting"  # the server (or an all-reduce rank) died: relaunching from a checkpoint
    # Cancelled; its agents are stopping its roles, and its GPUs stay held until they report
    # every one gone (or `cancel_timeout_s` passes).
    cancelling = "cancelling"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED_RUN_STATUSES

    @property
    def over(self) -> bool:
        """Whether the run will train no more: finished, or cancelling (nothing new starts)."""
        return self in FINISHED_RUN_STATUSES or self == RunStatus.cancelling


FINISHED_RUN_STATUSES = frozenset({RunStatus.succeeded, RunStatus.failed, RunStatus.cancelled})
ACTIVE_RUN_STATUSES = frozenset(
    {RunStatus.queued, RunStatus.launching, RunStatus.running, RunStatus.degraded, RunStatus.restarting,
     RunStatus.cancelling}
)


class WorkerStatus(enum.StrEnum):
    """One rank: planned -> launched -> running -> succeeded | failed | cancelled | left."""

    planned = "planned"
    launched = "launched"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    left = "left"  # a worker that left cleanly (a spot notice) while its run went on


FINISHED_WORKER_STATUSES = frozenset(
    {WorkerStatus.succeeded, WorkerStatus.failed, WorkerStatus.cancelled, WorkerStatus.left}
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
        CheckConstraint(
            "checkpoint_every >= 0 AND checkpoint_every_s >= 0 AND max_restarts >= 0 "
            "AND restarts >= 0 AND min_workers >= 1 AND min_workers_wait_s >= 0",
            name="lifecycle_settings_valid",
        ),
        Index("ix_runs_status_id", "status", "id"),
        Index("ix_runs_status_priority_id", "status", "priority", "id"),
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
    # Names of the data sets the run reads (hybridtrain.dataset(name)); None: none.
    datasets: Mapped[list[str] | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
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
    # Local SGD's outer steps (hybridtrain.train_options.LocalSgdOptions, unset keys left out).
    local_sgd: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}")
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
    # When a cancel of the launched run was asked for: it reads `cancelling` from then until
    # its agents report every role gone.
    cancel_requested_at: Mapped[datetime | None]
    # The model's prediction when the run was created (app.queries.predictions), priced; None
    # where a node had no profile of the task. Its page sets it beside what the run measured.
    prediction: Mapped[dict[str, Any] | None]
    # Checkpoints (uploaded to the control plane) every N steps and every S seconds; 0 is off.
    checkpoint_every: Mapped[int] = mapped_column(default=0, server_default="0")
    checkpoint_every_s: Mapped[float] = mapped_column(Double, default=0.0, server_default="0")
    # How often the control plane relaunches the run from its latest checkpoint after its
    # server (or an all-reduce rank) died, and how often it has.
    max_restarts: Mapped[int] = mapped_column(default=0, server_default="0")
    restarts: Mapped[int] = mapped_column(default=0, server_default="0")
    # PS strategies: below this many live workers the server waits min_workers_wait_s, then fails.
    min_workers: Mapped[int] = mapped_column(default=1, server_default="1")
    min_workers_wait_s: Mapped[float] = mapped_column(Double, default=300.0, server_default="300")
    # The queue for busy GPUs: higher priority first, then creation order (app.lifecycle.schedule).
    priority: Mapped[int] = mapped_column(default=0, server_default="0")
    # True: the run may hold its GPUs together with other runs that share (never with one that does not).
    share_gpus: Mapped[bool] = mapped_column(default=False, server_default=false())
    # PS strategies: the ranks' connections are mutual TLS keyed by the run's secret
    # (trainer.linktls). Runs stored before this column existed ran in the clear.
    encrypt_links: Mapped[bool] = mapped_column(default=True, server_default=false())
    # The final bill, once the run and each of its ranks ended (app.queries.final_bills): its
    # total, whether something in it had no price, and when it was stored. NULL: billed live (a
    # run in flight, or an ended one whose bill was cleared and is not stored again yet).
    billed_usd: Mapped[Decimal | None] = mapped_column(Numeric(16, 6))
    billed_unpriced: Mapped[bool | None]
    billed_at: Mapped[datetime | None]

    workers: Mapped[list[RunWorker]] = relationship(
        back_populates="run", cascade="all, delete-orphan", passive_deletes=True,
        order_by="RunWorker.rank",
    )
    # The newest first; the store keeps only the last few (app.checkpoints.KEPT).
    checkpoints: Mapped[list[RunCheckpoint]] = relationship(
        viewonly=True, order_by="RunCheckpoint.step.desc()",
    )

    @property
    def latest_checkpoint(self) -> RunCheckpoint | None:
        """The newest uploaded checkpoint, if any."""
        return self.checkpoints[0] if self.checkpoints else None

    @property
    def effective_options(self) -> dict[str, Any]:
        """compression, local_sgd and rebalance_every as the run's trainer runs them: as given,
        with the strategy's defaults where unset (hybridtrain.strategy_defaults)."""
        # A run stored before an option was removed (`overlap`) launches without it.
        compression = {k: v for k, v in (self.compression or {}).items() if k in CompressionOptions.model_fields}
        return effective(self.strategy, {"compression": compression, "local_sgd": dict(self.local_sgd or {}),
                                         "rebalance_every": self.rebalance_every})


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
    # How many runs held this rank's GPU when the run launched, itself included: its bill
    # counts 1/sharers of the GPU (the share at launch, app.lifecycle.schedule).
    sharers: Mapped[int] = mapped_column(default=1, server_default="1")
    status: Mapped[WorkerStatus] = mapped_column(
        str_enum(WorkerStatus, "status"), default=WorkerStatus.planned
    )
    pid: Mapped[int | None]
    exit_code: Mapped[int | None]
    signal: Mapped[int | None]
    reason: Mapped[str | None] = mapped_column(Text)
    # When this rank's current launch was ordered (the launch timeout counts from it), and
    # when that order was last sent (an order unanswered for long is sent again).
    launched_at: Mapped[datetime | None]
    ordered_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]

    run: Mapped[Run] = relationship(back_populates="workers")


class RunMetric(Base):
    """One measurement of one rank at one step (docs/architecture.md, "Trainer → control plane").

    Each record is stored once per (run, rank, stream, seq): the trainer numbers the records
    of each process, so a resent batch is skipped while a step trained again after a restart
    (another process, another stream) is kept. A record without a stream (an older trainer) is
    keyed by what identified it before: stream `~{name}/{peer}`, seq its step. The series
    index serves the reads (a run's series by name, then rank). `peer` is -1 when the record
    has none, since NULLs never collide in a unique index.
    """

    __tablename__ = "run_metrics"
    __table_args__ = (
        Index("uq_run_metrics_run_id_rank_stream_seq", "run_id", "rank", "stream", "seq", unique=True),
        Index("ix_run_metrics_series", "run_id", "name", "rank", "peer", "step"),
    )

    id: Mapped[int] = mapped_column(_BIG_ID, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(32))
    rank: Mapped[int]
    peer: Mapped[int] = mapped_column(default=-1)
    step: Mapped[int]
    t: Mapped[float] = mapped_column(Double)
    # NULL for a non-finite measurement (a diverged loss), which JSON cannot carry.
    value: Mapped[float | None] = mapped_column(Double)
    stream: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(BigInteger)


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
