"""Schemas of the agent endpoints (docs/architecture.md, "Agent ↔ control plane")."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from app.schemas.common import JsonObject, PublicSchema, Schema, plain_json

Secret = Annotated[str, Field(min_length=16, max_length=256, pattern=r"^[A-Za-z0-9_\-.~+/=]+$")]
Rank = Annotated[int, Field(ge=0, le=1_000_000)]
Seconds = Annotated[float, Field(ge=0, le=7.3e9, allow_inf_nan=False)]
SmallText = Annotated[str, Field(max_length=255)]
MAX_LINE = 4000
# What an agent may report about its node, kept whole on the node and served with it: the
# agents' own reports are a few kilobytes (64 GPUs' devices included).
MAX_HARDWARE_BYTES = 64 * 1024
MAX_LOAD_BYTES = 4 * 1024


def _clean_line(value: object) -> object:
    # Output is whatever a process printed: Postgres text cannot hold NUL, and one line must
    # not be able to fill the table.
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")[:MAX_LINE]
    return value


CleanLine = Annotated[str, BeforeValidator(_clean_line), Field(max_length=MAX_LINE)]


class DetectedGpu(Schema):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=128)]
    count: Annotated[int, Field(ge=1, le=1024)]
    memory_gb: Annotated[float, Field(ge=0, le=100_000)] | None = None


class Benchmark(Schema):
    model_config = ConfigDict(extra="allow")

    samples_per_s: Annotated[float, Field(gt=0, le=1e12, allow_inf_nan=False)]


class DataCacheReport(Schema):
    """How the agent reads data sets: its node cache's bound, and whether through its site's cache."""

    model_config = ConfigDict(extra="allow")

    bytes: Annotated[int, Field(ge=1, le=2**62)]
    site_cache: bool = False


class HardwareReport(Schema):
    """What the agent found; kept whole on the node, the known fields read by the planner."""

    model_config = ConfigDict(extra="allow")

    hostname: SmallText | None = None
    address: SmallText | None = None
    cpu_cores: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    memory_gb: Annotated[float, Field(ge=0, le=1e9)] | None = None
    gpus: Annotated[list[DetectedGpu], Field(max_length=64)] = []
    benchmark: Benchmark | None = None
    data_cache: DataCacheReport | None = None

    @model_validator(mode="after")
    def _bounded(self) -> HardwareReport:
        # The known fields are bounded one by one; the rest (a newer agent's) only as a whole.
        plain_json(self.model_dump(mode="python"), max_bytes=MAX_HARDWARE_BYTES, what="the hardware report")
        return self


class AgentRegister(Schema):
    join_token: Secret
    agent_token: Secret = Field(description="made up by the agent; only its hash is stored")
    hardware: HardwareReport


class AgentRegistered(PublicSchema):
    node_id: int
    node_name: str
    queue: str
    heartbeat_interval_s: float


class AgentBroker(PublicSchema):
    url: str = Field(description="The broker to consume the node's queue from, with this node's "
                     "own user on Redis; embedded SQL brokers reach agents on the same machine only")
    node_user: bool = Field(description="Whether the URL carries a user limited to this node's queue")


class RoleState(Schema):
    model_config = ConfigDict(extra="ignore")

    run_id: Annotated[int, Field(ge=1, le=2**31 - 1)]
    rank: Rank
    role: Literal["ps", "worker"]
    pid: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    state: Literal["running", "exited"]
    exit_code: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    signal: Annotated[int, Field(ge=0, le=255)] | None = None
    cancelled: bool = False
    reason: Annotated[str, BeforeValidator(_clean_line), Field(max_length=MAX_LINE)] | None = None
    # The run's restart count the role was launched with; an exit of an earlier attempt is stale.
    attempt: Annotated[int, Field(ge=0, le=10_000)] | None = None
    # Why the agent stopped the role (hybridtrain.contract.STOP_CAUSES; a newer agent's other
    # causes are kept as text rather than refusing its report).
    cause: SmallText | None = None


class GpuReading(Schema):
    """One GPU's utilisation (0..1) and memory, as NVML reads it on the node."""

    model_config = ConfigDict(extra="ignore")

    index: Annotated[int, Field(ge=0, le=255)]
    name: Annotated[str, Field(max_length=128)] = ""
    utilization: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
    memory_used_bytes: Annotated[int, Field(ge=0, le=2**50)]
    memory_total_bytes: Annotated[int, Field(ge=0, le=2**50)]


class Heartbeat(Schema):
    model_config = ConfigDict(extra="ignore")

    t: Seconds | None = None
    hardware: HardwareReport | None = None
    load: JsonObject(MAX_LOAD_BYTES) | None = None
    roles: Annotated[list[RoleState], Field(max_length=1024)] = []
    # The agent consumes with the broker user the control plane handed it, which a restarted
    # Redis may have forgotten: the control plane re-creates it.
    broker_user: bool = False
    # Absent where the agent has no NVML (no driver, no GPU): the node keeps its last readings.
    gpus: Annotated[list[GpuReading], Field(max_length=64)] | None = None


class StopOrder(PublicSchema):
    run_id: int
    rank: int | None
    reason: str
    # Set where only the roles of earlier attempts must stop: the beat that listed the old
    # process may be answered after the restart's new one has started in its place.
    before_attempt: int | None = None


class HeartbeatAnswer(PublicSchema):
    node_id: int
    status: str
    stop: list[StopOrder]


class RoleEvent(Schema):
    model_config = ConfigDict(extra="ignore")

    rank: Rank
    role: Literal["ps", "worker"]
    event: Literal["started", "exited"]
    pid: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    exit_code: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    signal: Annotated[int, Field(ge=0, le=255)] | None = None
    cancelled: bool = False
    reason: CleanLine | None = None
    attempt: Annotated[int, Field(ge=0, le=10_000)] | None = None
    # Why the agent stopped the role, when it did (hybridtrain.contract.STOP_CAUSES).
    cause: SmallText | None = None
    # A started rank 0: the port it listens on, which its agent took free on the node.
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    tail: Annotated[list[CleanLine], Field(max_length=200)] = []
    t: Seconds | None = None


class RoleEventAnswer(PublicSchema):
    run_status: str
    action: Literal["stop"] | None = None
    reason: str | None = None


class LogLine(Schema):
    seq: Annotated[int, Field(ge=0, le=2**62)]
    t: Seconds
    line: CleanLine


class LogBatch(Schema):
    rank: Rank
    lines: Annotated[list[LogLine], Field(max_length=5000)]
    dropped: Annotated[int, Field(ge=0, le=2**62)] = 0


class LogsStored(PublicSchema):
    stored: int
