"""Settings of the node agent: the one module of `agents/` that reads the environment.

The agent runs on machines that may have neither the control plane's code paths nor its
environment, so it has its own settings object rather than sharing `app.config`.
"""

from __future__ import annotations

import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The same embedded default as the control plane's `app.config`: a `make run` on one machine
# needs no broker server, and both processes resolve it against the same working directory.
EMBEDDED_BROKER_URL = "sqla+sqlite:///./var/broker.db"


class AgentSettings(BaseSettings):
    """Node-agent configuration; `hybridtrain agent` flags override the environment."""

    model_config = SettingsConfigDict(env_prefix="HYBRIDTRAIN_AGENT_", extra="ignore")

    # Where the control plane answers, e.g. http://cp.example:8000 (no /api/v1 suffix).
    server_url: str | None = Field(
        default=None, validation_alias=AliasChoices("HYBRIDTRAIN_AGENT_SERVER", "server_url")
    )
    # The node's one-time join token; unused once the state directory holds an agent token.
    join_token: SecretStr | None = Field(
        default=None, validation_alias=AliasChoices("HYBRIDTRAIN_AGENT_TOKEN", "join_token")
    )
    state_dir: Path = Path("./var/agent")
    # The broker this agent takes its orders from. Unset (the default), the control plane
    # hands it over at registration: on Redis with a user of this node's own, limited to its
    # queue (docs/deploy.md, "How an agent gets its orders"). Set it only where agents reach
    # the broker at another address than the control plane's broker_url_for_agents says.
    broker_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices(
            "CELERY_BROKER_URL", "HYBRIDTRAIN_AGENT_BROKER_URL", "broker_url"
        ),
    )
    # Five beats fit in the control plane's 30 s offline threshold, so one lost beat is harmless.
    heartbeat_interval_s: float = Field(default=5.0, gt=0)
    # The address other nodes use to reach this one (the server rank binds here); found from
    # the route to the control plane when unset.
    advertise_address: str | None = None
    # Threads of the Celery pool: launches and cancels are short, but a cancel may wait out
    # `kill_grace_s`, and a launch must not queue behind it.
    concurrency: int = Field(default=4, ge=2)
    # How long a cancelled role gets between SIGTERM and SIGKILL of its process group.
    kill_grace_s: float = Field(default=10.0, ge=0)
    # How long roles get when the agent itself gets SIGTERM (a spot VM's preemption notice,
    # or a shutdown): workers leave at their next step boundary, a server checkpoints. Clouds
    # give 30 s (GCP, Azure) to 2 min (AWS); 25 s leaves room to report the exits.
    stop_grace_s: float = Field(default=25.0, ge=0)
    # Output lines held in memory per role between flushes to the outbox, and while the
    # outbox is full; the oldest are dropped (and counted) beyond this.
    log_buffer_lines: int = Field(default=2000, ge=10)
    # Log lines the durable outbox holds for a control plane that is down (~100 MB at worst).
    outbox_log_lines: int = Field(default=200_000, ge=100)
    log_flush_interval_s: float = Field(default=1.0, gt=0)
    # Data sets' shards on this node (default: <state_dir>/data-cache), at most this many
    # bytes; least recently used shards go first (docs/datasets.md).
    data_cache_dir: Path | None = None
    data_cache_bytes: int = Field(default=20 * 1024**3, ge=1)
    # This site's cache (`hybridtrain datasets serve-cache`), e.g. http://10.0.0.5:8700: shards
    # are read through it, so each crosses the WAN once per site. Unset: from the store.
    data_site_cache_url: str | None = None
    # Seconds of the reference-model measurement at start; 0 skips it.
    benchmark_seconds: float = Field(default=2.0, ge=0)
    # The command that runs a trainer role; the role's flags are appended.
    trainer_command: list[str] = Field(default_factory=lambda: [sys.executable, "-m", "trainer"])
    # Longest a bundle download may take (the control plane fails launches after 180 s).
    bundle_download_timeout_s: float = Field(default=150.0, gt=0)
    # The command that profiles a task (`profile_task`); the profile's flags are appended.
    profile_command: list[str] = Field(
        default_factory=lambda: [sys.executable, "-m", "trainer.profile"]
    )
    profile_timeout_s: float = Field(default=300.0, gt=0)
    # One profile at a time per host: every agent of a machine takes this file's flock
    # (agents.profiles.host_lock), so it must be the same path for all of them.
    profile_lock_path: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()) / "hybridtrain-profile.lock")
    profile_lock_wait_s: float = Field(default=1800.0, gt=0)
    # A profile runs the profiler at least min and at most max times, until the spread of
    # its samples/s is within profile_stable_spread (agents.profiles.stable_measurement).
    profile_min_repeats: int = Field(default=2, ge=1, le=20)
    profile_max_repeats: int = Field(default=4, ge=1, le=20)
    profile_stable_spread: float = Field(default=0.10, ge=0)
    # Sets OMP_NUM_THREADS/MKL_NUM_THREADS of every role when given (CPU nodes sharing cores).
    role_threads: int | None = Field(default=None, ge=1)
    http_timeout_s: float = Field(default=10.0, gt=0)
    # Longest the hardware detection child (`python -m agents.hardware`) may take, beyond
    # its measurement; past it the agent registers what it can see without torch.
    hardware_timeout_s: float = Field(default=120.0, gt=0)
    # Longest a transient 409 at registration is retried before the agent gives up.
    register_conflict_retry_s: float = Field(default=60.0, ge=0)
    # Port of the link probe server (agents.probe): 0 picks a free one, -1 runs none.
    probe_port: int = Field(default=0, ge=-1, le=65535)
    # Longest bulk send this node's probe server accepts from another node.
    probe_max_seconds: float = Field(default=30.0, gt=0)
    log_level: str = "INFO"

    @field_validator("server_url")
    @classmethod
    def _strip_trailing_slash(cls, value: str | None) -> str | None:
        return value.rstrip("/") if value else value


@lru_cache
def get_settings() -> AgentSettings:
    """The process-wide agent settings, read once from the environment."""
    return AgentSettings()
