"""The bill of a run (GET /api/v1/runs/{id}/cost): spend by link, class and node, and throughput.

Dollar figures are numbers rounded to a micro-dollar (app.billing rounds them once, from the
exact sum); JSON numbers keep that precision for any bill a run can run up.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field

from app.schemas.common import PublicSchema


class LinkSpend(PublicSchema):
    """One directed node-to-node link: its bytes, their traffic class and what the sender paid."""

    src: str
    dst: str
    bytes: int
    traffic_class: str
    continent: str | None
    payer: str | None
    usd_per_gb: float
    usd: float


class NodeSpend(PublicSchema):
    """One node's compute spend: its seconds in the run at the rate of its pricing basis."""

    node: str
    seconds: float
    basis: Literal["spot", "on_demand", "amortised"]
    usd_per_hour: float
    usd: float


class GranularityPublic(PublicSchema):
    """Compute seconds over communication seconds (seed 003); `ratio` is null with no communication."""

    compute_s: float
    comm_s: float
    ratio: float | None


class PredictedMetric(PublicSchema):
    """One figure as predicted when the run was created and as measured so far."""

    metric: Literal["samples_per_s", "egress_bytes_per_step", "usd_per_million_samples"]
    predicted: float | None
    measured: float | None
    error_pct: float | None = Field(description="(predicted - measured) / measured, in %")


class PredictedVsMeasured(PublicSchema):
    """The run's stored prediction beside what it measured."""

    metrics: list[PredictedMetric]
    prediction: dict[str, Any] = Field(description="the whole prediction (POST /runs/plan's)")


class RunCost(PublicSchema):
    """What a run cost and delivered, live while it runs and final once it has finished."""

    run_id: int
    status: str
    final: bool
    priced_at: datetime
    egress_usd: float
    data_read_usd: float = Field(default=0.0, description="the part of egress_usd that is data sets read from their stores")
    data_read_bytes: int = 0
    egress_by_class: dict[str, float]
    bytes_by_class: dict[str, int]
    egress_by_link: list[LinkSpend]
    compute_usd: float
    compute_by_node: list[NodeSpend]
    total_usd: float
    samples: int
    usd_per_million_samples: float | None
    samples_per_s: float | None
    time_to_target_s: float | None = Field(
        description="training time until the run's target was first met (null: not met)"
    )
    time_to_accuracy_s: float | None = Field(
        description="deprecated: the same value as time_to_target_s", json_schema_extra={"deprecated": True}
    )
    granularity: GranularityPublic
    granularity_by_worker: dict[str, GranularityPublic]
    unpriced: list[str]
    predicted: PredictedVsMeasured | None = Field(
        default=None, description="predicted beside measured (null: the run has no prediction)"
    )
