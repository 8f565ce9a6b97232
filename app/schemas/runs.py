"""Schemas of runs: the launch request, its plan, the run as stored, metrics and logs."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from app.models.runs import RunStatus, WorkerStatus
from app.planner import PS_STRATEGIES
from app.schemas.common import Flag, Id, Name, PublicSchema, Schema

# The trainer's choices (trainer/cli.py), repeated here so the control plane, which does not
# install torch, refuses an impossible run with a 422 instead of a failed launch;
# tests/app/test_runs_trainer_contract.py keeps both lists equal.
STRATEGIES = ("allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc")
MODELS = ("smallcnn", "widecnn", "widemlp", "resnet18", "resnet50", "resnet152")
# Training samples per data set, to turn `epochs` into steps (the trainer counts
# floor(n_train / B) steps per epoch).
DATASET_TRAIN_SIZES = {"digits": 1438, "shapes": 8000, "synthetic": 4096}
DEFAULT_MAX_STEPS = 300

Strategy = Literal["allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc"]
ModelName = Literal["smallcnn", "widecnn", "widemlp", "resnet18", "resnet50", "resnet152"]
DatasetName = Literal["digits", "shapes", "synthetic"]
Allocation = Literal["equal", "flops", "measured"]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
SmallCount = Annotated[int, Field(ge=0, le=1_000_000, strict=True)]


class CompressionOptions(Schema):
    """Gradient compression of the ps-gc / ps-bz-gc strategies (trainer defaults if unset)."""

    compressor: Literal["none", "topk", "randomk"] | None = None
    value_dtype: Literal["fp32", "fp16"] | None = None
    select: Literal["estimate", "threshold", "topk", "sort"] | None = None
    density: Fraction | None = None
    density_min: Fraction | None = None
    density_max: Fraction | None = None
    server_k_fraction: Fraction | None = None
    error_feedback: Flag | None = None
    momentum_correction: Flag | None = Field(
        default=None,
        description="accumulate momentum on the workers before compression (DGC's momentum "
        "correction) instead of applying it to the sparse update; default on",
    )
    warmup_steps: SmallCount | None = None
    pipeline_chunks: Annotated[int, Field(ge=1, le=64, strict=True)] | None = Field(
        default=None,
        description="PS strategies: send and aggregate the gradient in this many pipelined chunks "
        "(the server and the wire work on one while the workers compress the next); default 1",
    )
    powersgd_rank: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = None

    @model_validator(mode="after")
    def _ordered_densities(self) -> CompressionOptions:
        lo, mid, hi = self.density_min, self.density, self.density_max
        known = [v for v in (lo, mid, hi) if v is not None]
        if known != sorted(known):
            raise ValueError("need density_min <= density <= density_max")
        return self


class RunCreate(Schema):
    """A run to plan and launch: nodes (or a cluster), strategy and hyperparameters."""

    name: Name
    node_ids: Annotated[list[Id], Field(min_length=1, max_length=256)] | None = None
    cluster_id: Id | None = None
    strategy: Strategy = "ps-bz-gc"
    model: ModelName = "smallcnn"
    dataset: DatasetName = "digits"
    global_batch_size: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] = 64
    lr: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False, strict=True)] = 0.1
    max_steps: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = None
    epochs: Annotated[int, Field(ge=1, le=100_000, strict=True)] | None = None
    target_accuracy: Fraction | None = None
    stop_at_target: Flag = Field(
        default=True,
        description="stop once target_accuracy is reached; false records the time to accuracy and "
        "trains on to max_steps, so that runs compare final accuracy at the same step budget",
    )
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, strict=True)] = 0
    allocation: Allocation | None = Field(
        default=None, description="batch split: default flops for ps-bz-gc, equal otherwise"
    )
    device: Literal["cpu", "cuda", "auto"] = "auto"
    compression: CompressionOptions | None = None
    rebalance_every: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] | None = Field(
        default=None,
        description="PS strategies: re-split the global batch every N steps from the workers' "
        "observed compute and compression times, starting from the plan (straggler mitigation); "
        "off by default",
    )
    eval_every: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = Field(
        default=None, description="evaluate held-out accuracy every N steps (trainer default 50)"
    )
    ps_node_id: Id | None = Field(default=None, description="where the server goes (PS strategies)")

    @model_validator(mode="after")
    def _one_way_each(self) -> RunCreate:
        if (self.node_ids is None) == (self.cluster_id is None):
            raise ValueError("give exactly one of node_ids and cluster_id")
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give max_steps or epochs, not both")
        if self.node_ids is not None and len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError("node_ids: each node may appear once")
        if self.rebalance_every is not None and self.strategy not in PS_STRATEGIES:
            raise ValueError(f"rebalance_every: only PS strategies re-balance, not {self.strategy}")
        chunks = self.compression.pipeline_chunks if self.compression else None
        if chunks not in (None, 1) and self.strategy not in PS_STRATEGIES:
            raise ValueError(f"compression.pipeline_chunks: only PS strategies pipeline, not {self.strategy}")
        return self

    def steps(self) -> int:
        """max_steps, or the steps `epochs` passes over the data take, or the default."""
        if self.max_steps is not None:
            return self.max_steps
        if self.epochs is not None:
            per_epoch = max(1, DATASET_TRAIN_SIZES[self.dataset] // self.global_batch_size)
            return self.epochs * per_epoch
        return DEFAULT_MAX_STEPS


class PlannedWorkerPublic(PublicSchema):
    rank: int
    role: Literal["ps", "worker"]
    node_id: int | None
    node_name: str
    batch_size: int | None
    gpu_model: str | None
    gpu_index: int | None
    speed: float | None
    speed_unit: str | None


class PlanPublic(PublicSchema):
    """The plan of a run: ranks, server placement and batch sizes."""

    strategy: str
    allocation: str
    global_batch_size: int
    max_steps: int
    world_size: int
    ps_node_id: int | None
    master_addr: str
    workers: list[PlannedWorkerPublic]


class RunWorkerPublic(PlannedWorkerPublic):
    status: WorkerStatus
    pid: int | None
    exit_code: int | None
    signal: int | None
    reason: str | None
    started_at: datetime | None
    finished_at: datetime | None


class RunPublic(PublicSchema):
    id: int
    name: str
    status: RunStatus
    reason: str | None
    strategy: str
    model: str
    dataset: str
    global_batch_size: int
    lr: float
    max_steps: int
    epochs: int | None
    target_accuracy: float | None
    stop_at_target: bool
    seed: int
    allocation: str
    device: str
    compression: dict[str, Any]
    rebalance_every: int | None
    eval_every: int | None
    cluster_id: int | None
    ps_node_id: int | None
    master_addr: str | None
    master_port: int | None
    created_by: str
    created_at: datetime
    updated_at: datetime
    launched_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    workers: list[RunWorkerPublic]


# -- metrics -------------------------------------------------------------------------------

MetricName = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.:-]+$")]
Rank = Annotated[int, Field(ge=0, le=1_000_000)]


def _finite_or_none(value: object) -> object:
    # A diverged loss is NaN; JSON cannot carry it back out, so it is stored as null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricRecord(Schema):
    """One measurement, as the trainer sends it (docs/architecture.md)."""

    rank: Rank
    role: Literal["ps", "worker"] | None = None
    step: Annotated[int, Field(ge=0, le=2**31 - 1)]
    t: Annotated[float, Field(ge=0, le=7.3e9, allow_inf_nan=False)]
    name: MetricName
    value: Annotated[float | None, BeforeValidator(_finite_or_none)]
    peer: Rank | None = None


class MetricBatch(Schema):
    records: Annotated[list[MetricRecord], Field(max_length=10_000)]


class MetricsStored(PublicSchema):
    received: int
    stored: int = Field(description="new records; duplicates of stored ones are skipped")


class MetricSeries(PublicSchema):
    """One series: points are [step, t, value], averaged per bucket when downsampled."""

    name: str
    rank: int
    peer: int | None
    count: int = Field(description="stored points of the series (matching `since`)")
    downsampled: bool
    points: list[tuple[int, float, float | None]]


class RunMetrics(PublicSchema):
    run_id: int
    series: list[MetricSeries]
    last_t: float | None = Field(description="pass as `since` to get only newer points")


# -- logs ----------------------------------------------------------------------------------


class RunLogLine(PublicSchema):
    rank: int
    seq: int
    t: float
    line: str


class RunLogs(PublicSchema):
    run_id: int
    lines: list[RunLogLine]


class RunCancel(Schema):
    reason: Annotated[str, Field(max_length=500, pattern=r"^[^\x00]*$")] | None = None

    @field_validator("reason")
    @classmethod
    def _strip(cls, value: str | None) -> str | None:
        return value.strip() or None if value is not None else None
