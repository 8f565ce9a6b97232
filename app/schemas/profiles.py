"""Schemas of task profiles: a task's measured speed on a node."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from app.models import ProfileStatus
from app.schemas.common import Id, JsonObject, PublicSchema, Schema
from app.schemas.runs import MAX_TASK_ARGS_BYTES
from hybridtrain.contract import DEFAULT_TASK

TaskRef = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")]
Sha256 = Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]{64}$")]
Device = Literal["cpu", "cuda", "auto"]
_Count = Annotated[int, Field(ge=0, le=2**62, strict=True)]
_Rate = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


class ProfileCreate(Schema):
    task: TaskRef = DEFAULT_TASK
    task_args: JsonObject(MAX_TASK_ARGS_BYTES) = Field(default_factory=dict)
    bundle_sha256: Sha256 | None = None
    node_ids: list[Id] = Field(min_length=1, max_length=256)
    batch_size: int = Field(default=32, ge=1, le=65536, strict=True)
    device: Device = "auto"


class ProfileMeasurement(Schema):
    """The one JSON line of `python -m trainer.profile`."""

    # Later trainers may print more fields: they are ignored, not refused, so an agent newer
    # than this control plane can still report.
    model_config = ConfigDict(extra="ignore")

    params: _Count
    train_samples: _Count | None = None
    eval_samples: _Count | None = None
    batch: Annotated[int, Field(ge=1, le=2**31 - 1, strict=True)]
    samples_per_s: _Rate
    step_s: _Rate
    metrics: dict[Annotated[str, Field(max_length=32)], bool] = Field(
        default_factory=dict, max_length=64
    )
    # How much the agent's repeated runs disagreed ((max - min) / median samples/s), and how
    # many it made; absent from an agent that runs the profiler once.
    spread: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] | None = None
    repeats: Annotated[int, Field(ge=1, le=1000, strict=True)] | None = None
    samples_per_s_runs: Annotated[list[_Rate], Field(max_length=1000)] | None = None


class ProfileReport(Schema):
    """What an agent POSTs when a profile has run: its measurement, or why it failed."""

    status: Literal["done", "failed"]
    result: ProfileMeasurement | None = None
    # Any length is taken (a traceback's tail); the stored text is cut to MAX_ERROR_CHARS.
    error: Annotated[str, Field(max_length=1_000_000)] | None = None


class TaskProfilePublic(PublicSchema):
    id: int
    node_id: int
    task_key: str
    task: str
    task_args: dict[str, Any]
    bundle_sha256: str | None
    batch_size: int
    device: str
    status: ProfileStatus
    params: int | None
    train_samples: int | None
    eval_samples: int | None
    samples_per_s: float | None
    step_s: float | None
    spread: float | None = Field(
        default=None, description="(max - min) / median samples/s of the runs kept; null: one run; from a run "
                                  "(created_by \"run N\"): (p90 - p10) / median samples/s of its steps")
    repeats: int | None = Field(default=None, description="how many times the agent ran the profiler (from a run: "
                                                          "the steps counted)")
    metrics: dict[str, bool] | None
    result: dict[str, Any] | None = Field(
        default=None, description="everything the profiler measured (the performance model's inputs)")
    error: str | None
    created_by: str
    created_at: datetime
    measured_at: datetime | None
