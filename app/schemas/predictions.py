"""Schemas of predictions: a plan's predicted step and hour (app.perfmodel.predict), the optimizer's
request and answer (POST /api/v1/plans/optimize), and a profile's full result as agents send it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.schemas.common import Id, JsonObject, PublicSchema, Schema
from app.schemas.datasets import DatasetName
from app.schemas.profiles import ProfileMeasurement, ProfileReport
from app.schemas.runs import (
    MAX_TASK_ARGS_BYTES,
    CompressionOptions,
    LocalSgdOptions,
    PlanPublic,
    RunCreate,
    Sha256,
    Strategy,
)
from hybridtrain import contract
from hybridtrain.train_options import move_legacy_local_sgd

_Count = Annotated[int, Field(ge=0, le=2**62, strict=True)]
_Seconds = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]

# The optimizer tries every subset up to app.perfmodel.optimize.EXHAUSTIVE_MAX candidates (1023 subsets at
# 10, ~10 s) and greedy removal beyond; more than this many would keep a request waiting too long.
MAX_OPTIMIZE_CANDIDATES = 12


class ProfileMeasurementFull(ProfileMeasurement):
    """trainer.profile's JSON line with the performance model's inputs typed (so that no NaN or
    stray type reaches the stored result); any other field is still ignored."""

    model_config = ConfigDict(extra="ignore")

    dense_params: _Count | None = None
    buffer_numel: _Count | None = None
    worker_compress_s: _Seconds | None = None
    server_compress_s: _Seconds | None = None
    aggregate_s: _Seconds | None = None
    worker_compress_s_per_kept: _Seconds | None = None
    server_compress_s_per_kept: _Seconds | None = None
    aggregate_s_per_kept: _Seconds | None = None
    aggregate_fixed_s: _Seconds | None = None
    worker_compress_density: _Fraction | None = None
    server_compress_k_fraction: _Fraction | None = None
    dense_aggregate_s_per_element: _Seconds | None = None
    dense_encode_s_per_element: _Seconds | None = None
    powersgd_s: _Seconds | None = None
    powersgd_rank: _Count | None = None
    matrix_shapes: Annotated[list[tuple[_Count, _Count]], Field(max_length=100_000)] | None = None


class ProfileReportFull(ProfileReport):
    """An agent's profile report whose result keeps the model's inputs."""

    result: ProfileMeasurementFull | None = None


class LinkBytesPublic(PublicSchema):
    """Bytes one node sends another in a step (warm-up steps amortised)."""

    src_node_id: int
    dst_node_id: int
    bytes: int


class CostPredictionPublic(PublicSchema):
    """An hour of the predicted run, priced (app.perfmodel.predict.CostPrediction)."""

    samples_per_hour: float
    bytes_by_class_per_hour: dict[str, int]
    egress_usd_per_h: float
    compute_usd_per_h: float
    data_usd_per_h: float = Field(default=0.0, description="the data sets' reads from their stores over the run "
                                                          "(data_usd), spread over its samples at this plan's rate")
    total_usd_per_h: float = Field(description="egress + compute + data")
    usd_per_million_samples: float | None
    egress_share: float | None = Field(description="the gradients' egress over total_usd_per_h (null: nothing priced)")
    unpriced: list[str]
    data_usd: float = Field(default=0.0, description="the data sets' reads over the whole run, $")
    data_bytes: int = Field(default=0, description="bytes the plan's nodes fetch from the data sets' stores over the run")


class PredictionPublic(PublicSchema):
    """One strategy's predicted step (app.perfmodel.predict.Prediction) and the cost of an hour of it."""

    model_config = ConfigDict(extra="allow")

    strategy: str
    samples_per_s: float
    step_s: float
    breakdown: dict[str, float] = Field(description="compute_s, compress_s, upload_s, server_s, download_s (+ overlap_s, eval_s)")
    granularity: float | None = Field(description="compute over communication, the bill's definition")
    per_worker: list[dict[str, Any]]
    bytes_per_step: list[LinkBytesPublic]
    egress_bytes_per_step: int = Field(description="bytes that leave their site each step")
    time_to_max_steps_s: float | None
    assumptions: list[str]
    global_batch: int
    server_node_id: int | None
    node_names: dict[str, str]
    links: list[dict[str, Any]] = Field(description="each link the plan uses: mbps, rtt_ms, source, measured_at")
    phases: list[dict[str, Any]] = Field(
        default_factory=list,
        description="steps first_step..last_step (null: on) of one kind: warm-up, each step of the densities' "
                    "path, the settled state; each with step_s, cross_site_bytes_per_step and densities")
    costs: CostPredictionPublic


class ProfilingPublic(PublicSchema):
    """A node whose profile of the plan's task is under way (or failed lately)."""

    node_id: int
    node_name: str
    profile_id: int
    status: str = Field(description="pending: being measured; failed: see error (not ordered again for 10 min)")
    requested_at: datetime
    age_s: float
    error: str | None = None


class ProfileInputPublic(PublicSchema):
    """The profile behind a node's figures in a plan: its age and its noise."""

    node_id: int
    node_name: str | None
    profile_id: int
    samples_per_s: float | None
    spread: float | None = Field(description="(max - min) / median samples/s of the agent's runs; null: one run")
    repeats: int | None
    measured_at: datetime | None
    age_s: float | None
    source: str = Field(default="profile", description='"profile": the agent\'s profiler; "run": a finished '
                        "run's measured steps (spread over its steps, repeats the steps counted)")
    run_id: int | None = Field(default=None, description="the run whose steps measured it (source run)")


class DataReadPublic(PublicSchema):
    """A data set's bytes one reader of the plan (a site's cache, else a node) fetches from its
    store over the run, and their egress (app.perfmodel.data)."""

    dataset: str
    node_id: int = Field(description="the node billed for the reads: the reader's first")
    node_ids: list[int] = Field(default_factory=list, description="the nodes the reader serves")
    site: str | None = None
    via: str | None = Field(default=None, description='"site cache" (once per site) or "node cache" (once per node)')
    epochs: float | None = Field(default=None, description="epochs fetched: 1 when the cache holds the data set, "
                                                           "else every epoch of the run")
    bytes: int
    traffic_class: str
    usd: float


class StrategyComparisonPublic(PublicSchema):
    """One strategy's predicted throughput and cost on the plan's nodes and links, beside the others."""

    name: str = Field(description='the strategy, or a local SGD one with "+replicas" (sites as replicas)')
    strategy: str
    site_replicas: bool = Field(description="local SGD with each site's workers one replica")
    server_node_id: int | None = Field(description="the parameter server's node (PS strategies)")
    samples_per_s: float
    ideal_share: float = Field(description="samples/s over the sum of the workers' compute-only samples/s")
    wan_bytes_per_sample: float = Field(description="bytes that leave their site per training sample")
    usd_per_million_samples: float | None = Field(description="compute, egress and data reads; null: no samples")
    chosen: bool = Field(description="the plan's own strategy (and its site_replicas)")


class PlanWithPrediction(PlanPublic):
    """A plan and what the model predicts of it (null, with the reason, when it cannot)."""

    prediction: PredictionPublic | None = None
    strategies: list[StrategyComparisonPublic] = Field(
        default_factory=list,
        description="where each strategy wins: every strategy (local SGD with and without sites as replicas) "
                    "predicted on the same nodes with its defaults where the run leaves options unset, most "
                    "samples/s first; empty without a prediction and in each plan of \"strategies\": \"all\"")
    prediction_unavailable: str | None = Field(default=None, description="why there is no prediction")
    profiling: list[ProfilingPublic] = Field(
        default_factory=list, description="nodes being profiled for this plan (with profile_missing)")
    inputs: list[ProfileInputPublic] = Field(
        default_factory=list, description="each node's profile of the task: how old and how noisy")
    data_reads: list[DataReadPublic] = Field(
        default_factory=list, description="each data set's bytes per reader from its store over the run, priced")


class PlanSetPublic(PublicSchema):
    """Every strategy's plan side by side ("strategies": "all")."""

    plans: list[PlanWithPrediction]


class PlanRequest(RunCreate):
    """A run to plan; "strategies": "all" plans every strategy at once."""

    strategies: Literal["all"] | None = Field(
        default=None, description='"all": one plan with its prediction per strategy'
    )
    profile_missing: bool = Field(
        default=False, description="order a profile of the task from each node that has none (see `profiling`)"
    )


class OptimizeRequest(Schema):
    """Candidate nodes (or a cluster), the task and global batch, and the goal with its limits."""

    node_ids: Annotated[list[Id], Field(min_length=1, max_length=256)] | None = None
    cluster_id: Id | None = None
    task: Annotated[str, Field(max_length=255)] = contract.DEFAULT_TASK
    task_args: JsonObject(MAX_TASK_ARGS_BYTES) = Field(default_factory=dict)
    bundle_sha256: Sha256 | None = None
    global_batch_size: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] = 64
    goal: Literal["cost", "fastest"] = Field(
        default="cost", description="cost: lowest $/1M samples; fastest: most samples/s"
    )
    budget_usd_per_h: Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)] | None = None
    deadline_s: Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)] | None = None
    max_steps: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = None
    strategies: Annotated[list[Strategy], Field(min_length=1)] | None = Field(
        default=None, description="the strategies to consider (default all)"
    )
    compression: CompressionOptions | None = None
    local_sgd: LocalSgdOptions | None = None
    eval_every: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = None
    datasets: Annotated[list[DatasetName], Field(max_length=16)] | None = Field(
        default=None, description="registered data sets the run reads: their reads from the stores count in the cost"
    )
    profile_missing: bool = Field(
        default=False, description="order a profile of the task from each candidate that has none: the "
                                   "answer is then 202 with the nodes being profiled, until they are")

    @model_validator(mode="before")
    @classmethod
    def _legacy_local_sgd(cls, data: Any) -> Any:
        return move_legacy_local_sgd(data)

    @model_validator(mode="after")
    def _one_way(self) -> OptimizeRequest:
        if (self.node_ids is None) == (self.cluster_id is None):
            raise ValueError("give exactly one of node_ids and cluster_id")
        if self.node_ids is not None and len(set(self.node_ids)) != len(self.node_ids):
            raise ValueError("node_ids: each node may appear once")
        return self


class OptimizeResultPublic(PublicSchema):
    """The chosen plan with its prediction, and a sentence or two saying why."""

    goal: str
    plan: PlanWithPrediction
    explanation: str
    left_out_node_ids: list[int]
    evaluated: int = Field(description="plans the search predicted")
    runners_up: list[dict[str, Any]] = Field(description="the best plan of each other strategy")
    baseline: dict[str, Any] | None = Field(description="the best plan on every candidate")
