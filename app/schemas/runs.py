"""Schemas of runs: the launch request, its plan, the run as stored, metrics and logs."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from app.models.runs import RunStatus, WorkerStatus
from app.schemas.checkpoints import CheckpointPublic
from app.schemas.common import Flag, Id, Name, PublicSchema, Schema
from app.schemas.datasets import DatasetName
from app.schemas.events import RunEventPublic
from hybridtrain import contract
from hybridtrain.train_options import (  # noqa: F401 - the request's sections and types, imported from here too
    MAX_TASK_ARGS_BYTES,
    CompressionOptions,
    Device,
    LocalSgdOptions,
    Strategy,
    TrainOptions,
    field_error,
)

# A run given neither max_steps nor epochs trains this many steps.
DEFAULT_MAX_STEPS = 300
MAX_SCRIPT_ARGS = 64
# Runs from the API checkpoint by default, so that a restart loses at most this much.
DEFAULT_CHECKPOINT_EVERY = 100
DEFAULT_CHECKPOINT_EVERY_S = 600.0
DEFAULT_MAX_RESTARTS = 3
DEFAULT_MIN_WORKERS_WAIT_S = 300.0

Sha256 = Annotated[str, Field(max_length=64, pattern=contract.SHA256.pattern, description="sha256 of a bundle, 64 lower-case hex")]
ScriptArg = Annotated[str, Field(max_length=4096, pattern=r"^[^\x00]*$")]


class RunCreate(Schema, TrainOptions):
    """A run to plan and launch: nodes (or a cluster), and its training options (`TrainOptions`:
    what to train, the strategy and its knobs), how it checkpoints, restarts and queues."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Name
    node_ids: Annotated[list[Id], Field(min_length=1, max_length=256)] | None = None
    cluster_id: Id | None = None
    bundle_sha256: Sha256 | None = Field(default=None, description="the code bundle the run imports from")
    script_args: Annotated[list[ScriptArg], Field(max_length=MAX_SCRIPT_ARGS)] | None = Field(
        default=None, description="arguments after `--` on the trainer's command line"
    )
    datasets: Annotated[list[DatasetName], Field(max_length=16)] | None = Field(
        default=None, description="names of registered data sets the run reads (hybridtrain.dataset(name))"
    )
    # Whole epochs: the run's column is an integer (the trainer's own flag takes fractions).
    epochs: Annotated[int, Field(ge=1, le=100_000, strict=True)] | None = None  # type: ignore[assignment]
    ps_node_id: Id | None = Field(default=None, description="where the server goes (PS strategies)")
    checkpoint_every: Annotated[int, Field(ge=0, le=100_000_000, strict=True)] = Field(
        default=DEFAULT_CHECKPOINT_EVERY,
        description="upload a checkpoint to the control plane every N steps (0: never); a run "
        "whose server dies restarts from the latest",
    )
    checkpoint_every_s: Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)] = Field(
        default=DEFAULT_CHECKPOINT_EVERY_S,
        description="also checkpoint when this many seconds have passed since the last one (0: off)",
    )
    max_restarts: Annotated[int, Field(ge=0, le=100, strict=True)] = Field(
        default=DEFAULT_MAX_RESTARTS,
        description="how often the run is relaunched from its latest checkpoint after its server "
        "(or an all-reduce rank) died; beyond it the run fails",
    )
    min_workers: Annotated[int, Field(ge=1, le=100_000, strict=True)] = Field(
        default=1,
        description="PS strategies: below this many live workers training waits for workers "
        "(at most min_workers_wait_s), then the run fails; at most the run's number of workers",
    )
    min_workers_wait_s: Annotated[float, Field(ge=0, le=7 * 86400, allow_inf_nan=False)] = Field(
        default=DEFAULT_MIN_WORKERS_WAIT_S,
        description="how long a PS run waits below min_workers before it fails",
    )
    priority: Annotated[int, Field(ge=-1000, le=1000, strict=True)] = Field(
        default=0,
        description="place in the queue for busy GPUs: higher first, then creation order",
    )
    share_gpus: Flag = Field(
        default=False,
        description="run on GPUs that other sharing runs hold (it waits only for runs that do not share)",
    )
    encrypt_links: Flag = Field(
        default=True,
        description="parameter-server strategies: the ranks talk over TLS keyed by a secret of the run's; "
        "false only where the sites' network already encrypts (a VPN). All-reduce runs over gloo, "
        "which has no TLS, whatever this says",
    )

    @model_validator(mode="after")
    def _script_in_bundle(self) -> RunCreate:
        # Checked after bundle_sha256 and task are known; the 422 still names "script".
        value = self.script
        if value is None:
            return self
        parts = value.split("/")
        if not value or value.startswith("/") or "\\" in value or "\x00" in value or ".." in parts:
            raise field_error("script", f"script {value!r}: a relative path inside the bundle, without '..'", value)
        if self.bundle_sha256 is None:
            raise field_error("script", "script needs bundle_sha256: the bundle the script is in", value)
        if self.task != contract.DEFAULT_TASK:
            raise field_error("script", "give a task or a script, not both", value)
        return self

    @model_validator(mode="after")
    def _one_way_each(self) -> RunCreate:
        if (self.node_ids is None) == (self.cluster_id is None):
            raise ValueError("give exactly one of node_ids and cluster_id")
        if self.node_ids is not None and len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError("node_ids: each node may appear once")
        return self

    def train_options(self) -> TrainOptions:
        """The request's training options alone (what the run stores and forwards)."""
        return TrainOptions.model_validate(self.model_dump(include=set(TrainOptions.model_fields)))

    @property
    def task_key(self) -> str:
        """What task profiles of this run's code, task and arguments are filed under."""
        from app.queries.profiles import profiled_as, task_key

        ref, args = profiled_as(task=self.task, task_args=self.task_args, script=self.script,
                                script_args=self.script_args)
        return task_key(ref, args, self.bundle_sha256)

    def steps(self, train_samples: int | None = None) -> int | None:
        """max_steps; or the steps `epochs` take over `train_samples` (None when the number of
        samples is unknown: the trainer then counts them); or the default."""
        if self.max_steps is not None:
            return self.max_steps
        if self.epochs is not None:
            if not train_samples:
                return None
            return contract.steps_for_epochs(self.epochs, train_samples, self.global_batch_size)
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


class PlanTaskPublic(PublicSchema):
    """What the nodes' task profiles say of the run's task."""

    ref: str
    params: int | None
    train_samples: int | None
    profiled_nodes: list[int] = Field(description="nodes with a finished profile of this task")


class PlanPublic(PublicSchema):
    """The plan of a run: ranks, server placement and batch sizes."""

    strategy: str
    allocation: str
    global_batch_size: int
    max_steps: int | None = Field(description="null when epochs are given and no profile knows the data's size")
    world_size: int
    ps_node_id: int | None
    master_addr: str
    workers: list[PlannedWorkerPublic]
    task: PlanTaskPublic | None = Field(default=None, description="present when the task was profiled")


class RunWorkerPublic(PlannedWorkerPublic):
    status: WorkerStatus
    sharers: int = Field(default=1, description="runs that held this rank's GPU at launch, itself included")
    pid: int | None
    exit_code: int | None
    signal: int | None
    reason: str | None
    started_at: datetime | None
    finished_at: datetime | None


class SiteReadsPublic(PublicSchema):
    """What one site's workers fetched of a data set (app.cache_warmup.SiteReads)."""

    site: str
    node_ids: list[int]
    store_bytes: int
    site_cache_bytes: int
    summary: str


class DataWarmupPublic(PublicSchema):
    """A data set's first epoch through the caches (app.cache_warmup.Warmup)."""

    dataset: str
    state: Literal["warming", "warm", "stopped"] = Field(
        description="warming: the first epoch is under way; warm: it is done; stopped: the run ended within it")
    shards_read: int = Field(description="floor(fraction * shards): the shards the epoch's order has read")
    shards: int
    fraction: float = Field(description="the first epoch's samples read: steps * global batch / samples, at most 1")
    store_bytes: int = Field(description="fetched from the store so far, every site")
    summary: str
    sites: list[SiteReadsPublic]


class RunPublic(PublicSchema):
    id: int
    name: str
    status: RunStatus
    reason: str | None
    strategy: str
    task: str
    task_args: dict[str, Any]
    bundle_sha256: str | None
    script: str | None
    script_args: list[str] | None
    datasets: list[str] | None = None
    global_batch_size: int
    max_steps: int | None = Field(description="null until a run given in epochs learns its steps from the trainer")
    epochs: int | None
    target: str | None
    stop_at_target: bool
    seed: int
    allocation: str
    device: str
    compression: dict[str, Any] = Field(description="the exchange's options as given (effective_options: as run)")
    local_sgd: dict[str, Any] = Field(default_factory=dict, description="local SGD's outer-step options as given")
    rebalance_every: int | None
    effective_options: dict[str, Any] = Field(
        default_factory=dict,
        description="compression, local_sgd and rebalance_every as the trainer runs them: those given, and "
        "the strategy's defaults (the paper benchmark's configuration, docs/user-guide.md) where unset; "
        "an option in neither is the trainer's own default, the same for every strategy",
    )
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
    checkpoint_every: int
    checkpoint_every_s: float
    max_restarts: int
    restarts: int = Field(description="how often the run was relaunched from a checkpoint")
    min_workers: int
    min_workers_wait_s: float
    priority: int = 0
    share_gpus: bool = False
    encrypt_links: bool = False
    queue_position: int | None = Field(
        default=None, description="1 for the next queued run to start; null unless queued"
    )
    waiting_for: list[str] = Field(
        default_factory=list, description="why a queued run has not started (busy GPUs, draining nodes)"
    )
    latest_checkpoint: CheckpointPublic | None = Field(
        default=None, description="the newest checkpoint the trainer uploaded, if any"
    )
    workers: list[RunWorkerPublic]
    events: list[RunEventPublic] = Field(
        default_factory=list, description="membership changes, restarts, checkpoints: oldest first"
    )
    data_warmup: list[DataWarmupPublic] | None = Field(
        default=None, description="GET /runs/{id} of a run that fetches data sets from a store, once it is "
                                  "launched: each one's first epoch through the caches")


class RunAddNodes(Schema):
    """Nodes to add to a running PS run, one worker rank per GPU."""

    node_ids: Annotated[list[Id], Field(min_length=1, max_length=256)]

    @field_validator("node_ids")
    @classmethod
    def _distinct(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError("node_ids: each node may appear once")
        return value


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
