"""The trainer's report batch (docs/architecture.md, "Trainer → control plane: metrics"): its
records are measurements or run events, each numbered in its process's stream."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from app.schemas.common import Schema
from app.schemas.runs import MetricRecord, Rank
from hybridtrain import contract

EventKind = Literal[tuple(sorted(contract.EVENT_KINDS))]  # type: ignore[valid-type]
Stream = Annotated[str, Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$",
                              description="the reporting process's id; (rank, stream, seq) is stored once")]
Seq = Annotated[int, Field(ge=0, le=2**62, description="the record's number in its stream: 0, 1, 2, ...")]
Step = Annotated[int, Field(ge=0, le=2**31 - 1)]
UnixTime = Annotated[float, Field(ge=0, le=7.3e9, allow_inf_nan=False)]


class _Numbered:
    """Stream and seq come together: half a key would store a record once per delivery."""

    stream: str | None
    seq: int | None

    @model_validator(mode="after")
    def _stream_with_seq(self) -> Any:
        if self.stream is not None and self.seq is None:
            raise ValueError("seq is required with stream")
        if self.seq is not None and self.stream is None:
            raise ValueError("stream is required with seq")
        return self


class StreamedMetricRecord(_Numbered, MetricRecord):
    """A measurement with its stream and sequence number (both absent from older trainers)."""

    stream: Stream | None = None
    seq: Seq | None = None


class TrainerEventRecord(_Numbered, Schema):
    """A run event reported by the trainer in its metrics stream."""

    rank: Rank
    role: Literal["ps", "worker"] | None = None
    step: Step
    t: UnixTime
    event: EventKind
    subject: Rank | None = None
    detail: Annotated[str, Field(max_length=4000, pattern=r"^[^\x00]*$")] = ""
    stream: Stream | None = None
    seq: Seq | None = None


def _record_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "event" if "event" in value else "metric"
    return "event" if isinstance(value, TrainerEventRecord) else "metric"


ReportRecord = Annotated[
    Annotated[StreamedMetricRecord, Tag("metric")] | Annotated[TrainerEventRecord, Tag("event")],
    Discriminator(_record_kind),
]


class ReportBatch(Schema):
    """What the trainer (or its agent, from the spool) POSTs to /runs/{id}/metrics."""

    records: Annotated[list[ReportRecord], Field(max_length=10_000)]
