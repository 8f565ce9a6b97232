"""Settings of the control plane: the one place that reads the environment."""

from __future__ import annotations

import ipaddress
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_EXAMPLE_SECRET = "local-development-secret-change-me"


class Settings(BaseSettings):
    """Control-plane configuration; environment variables override the embedded defaults."""

    model_config = SettingsConfigDict(env_prefix="HYBRIDTRAIN_", extra="ignore")

    environment: Literal["local", "production"] = "local"
    # Embedded defaults let `make run` work on a laptop with no servers at all.
    database_url: str = Field(
        default="sqlite+pysqlite:///./var/hybridtrain.db",
        validation_alias=AliasChoices("DATABASE_URL", "HYBRIDTRAIN_DATABASE_URL"),
    )
    celery_broker_url: str = Field(
        default="sqla+sqlite:///./var/broker.db",
        validation_alias=AliasChoices("CELERY_BROKER_URL", "HYBRIDTRAIN_CELERY_BROKER_URL"),
    )
    # The broker as agents on other machines reach it (e.g. redis://cp.example.org:6379/0),
    # handed to each agent at registration; None hands out celery_broker_url. On Redis the
    # agent gets it with a user of its own node instead of these credentials.
    broker_url_for_agents: str | None = None
    # On Redis, give each node's agent an ACL user limited to its own queue's keys (the
    # control plane's broker user then needs the ACL commands). False hands every agent the
    # shared credentials of broker_url_for_agents, for a Redis without ACL rights.
    broker_node_users: bool = True
    admin_token: str | None = None
    # The bearer token Prometheus sends to GET /metrics. Unset, /metrics answers only clients
    # on this host that no proxy relayed, so a control plane on a public address does not hand
    # its run names, node names and spend to anyone (docs/deploy.md, "Monitoring").
    metrics_token: SecretStr | None = Field(default=None, min_length=16)
    secret_key: str = _EXAMPLE_SECRET
    # The wheel that GET /dist/<its name> hands to joining machines (`pip wheel --no-deps .`);
    # None builds one from the source tree this control plane runs from (app/agent_wheel.py).
    agent_wheel: Path | None = None
    # The address agents and trainers use to reach this control plane.
    public_url: str = "http://127.0.0.1:8000"
    heartbeat_timeout_s: float = 30.0
    # A run whose ranks have not all started this long after launch fails; torch's import,
    # data loading and a slow broker fit well inside.
    launch_timeout_s: float = 180.0
    # How often the control plane looks for silent nodes and stuck launches.
    monitor_interval_s: float = 5.0
    # Capacity (docs/control-plane.md, "Capacity"): how many requests are worked on at once, per
    # lane. An admitted request holds at most one pooled connection and one worker thread at a
    # time, so the pool and AnyIO's thread limiter are sized from these (`db_pool_size`,
    # `worker_threads`) and an admitted request never waits for either. Readers, pages and CI
    # share the api lane; agents' reports and trainers' metrics have their own, heartbeats
    # theirs, so no crowd can make nodes look dead; uploads of bundles and checkpoints theirs.
    api_slots: int = Field(default=8, ge=1, le=1000)
    agent_slots: int = Field(default=4, ge=1, le=1000)
    # Heartbeats alone: neither readers nor agents' logs and metrics can make a node look dead.
    # `heartbeat_slots` beats work on the database at once (a batch of plain beats being written
    # is one); `heartbeats_admitted` are admitted at once, the others waiting for their batch,
    # which holds neither a thread nor a connection (app/beat_batches.py).
    heartbeat_slots: int = Field(default=2, ge=1, le=1000)
    heartbeats_admitted: int = Field(default=500, ge=1, le=100_000)
    upload_slots: int = Field(default=2, ge=1, le=100)
    # A request that finds its lane full waits for a slot, this many at most per lane and this
    # long at most; beyond either it is answered 503 with Retry-After at once.
    admission_queue: int = Field(default=64, ge=0, le=100_000)
    admission_wait_s: float = Field(default=2.0, ge=0, le=60)
    # Live run pages: how many may be open, and the threads (each with its connection) their
    # polls share.
    max_streams: int = Field(default=200, ge=1, le=100_000)
    stream_threads: int = Field(default=2, ge=1, le=100)
    # Threads beyond the lanes' slots, for work that holds no connection (static files, the
    # exit of a request's dependencies).
    spare_threads: int = Field(default=8, ge=1, le=1000)
    # How long an idle keep-alive connection stays open (uvicorn's default is 5 s). Above the
    # agents' 20 s (agents/client.py), itself above their 5 s between heartbeats: an agent keeps
    # its one connection, and closes it itself, so a beat never meets the server's close.
    keep_alive_s: int = Field(default=30, ge=1, le=3600)
    # How long a checkout waits for a pooled connection before the request gets a 503; with
    # the pool sized as above it never should.
    db_pool_timeout_s: float = Field(default=10.0, gt=0, le=300)
    # Largest JSON (or form) body any route reads, in bytes; bundles and checkpoints have
    # their own limits below. Larger bodies get 413 while being read.
    json_max_bytes: int = Field(default=1024 * 1024, gt=0)
    # How long a client may take to send a JSON (or form) body or a report, in all: a client
    # that trickles its body must not hold its admission slot for long (uploads excepted).
    body_timeout_s: float = Field(default=10.0, gt=0, le=600)
    # Largest body of an agent's report (heartbeat, logs, spooled metrics) or a trainer's
    # metrics batch: 10,000 records of a few hundred bytes each fit.
    report_max_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # Largest accepted bundle of users' code (a gzipped tar), in bytes; larger uploads get 413.
    bundle_max_bytes: int = Field(default=64 * 1024 * 1024, gt=0)
    # Where bundles are kept as <sha256>.tar.gz; None keeps them in the database.
    bundle_dir: Path | None = None
    # The S3(-compatible) store of data sets (docs/datasets.md): its endpoint (None: AWS's own),
    # region and keys. The control plane reads a data set's index with them at registration and
    # hands them to the roles of the runs that read it, never to a bundle.
    dataset_s3_endpoint_url: str | None = None
    dataset_s3_region: str = "us-east-1"
    dataset_s3_access_key_id: SecretStr | None = None
    dataset_s3_secret_access_key: SecretStr | None = None
    # Where data sets uploaded to the control plane are kept (`hybridtrain datasets upload`),
    # one folder per data set; None: uploads are refused. Each file at most dataset_file_max_bytes.
    dataset_dir: Path | None = None
    dataset_file_max_bytes: int = Field(default=4 * 1024**3, gt=0)
    # Largest accepted checkpoint upload, in bytes; larger ones get 413.
    checkpoint_max_bytes: int = Field(default=1024 * 1024 * 1024, gt=0)
    # Where checkpoints are kept as files (share it between control-plane hosts); None keeps
    # them in the database.
    checkpoint_dir: Path | None = None
    # A launch order whose rank has not reported its start this long after it was sent is sent
    # again (the agent ignores a launch of a rank it already runs).
    launch_resend_s: float = Field(default=45.0, gt=0)
    # After a PS run's server succeeded, its workers get this long to end by themselves
    # before the stragglers are cancelled.
    finish_grace_s: float = Field(default=60.0, ge=0)
    # A cancelled run reads `cancelling`, its GPUs held, until its agents report every role
    # gone; past this, its unreported ranks count as gone and their online nodes are drained
    # for someone to check (the roles outlive SIGTERM by about 2 s, the agent's SIGKILL by
    # its kill grace, 10 s).
    cancel_timeout_s: float = Field(default=60.0, gt=0)

    # Addresses (IPs or CIDRs, comma-separated) of the TLS proxies in front of this control
    # plane: only their X-Forwarded-Proto/-For are believed, for the scheme (Secure cookies)
    # and the client address (logs). Empty: no proxy header is believed.
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Secure session cookies: True always, False never, None when the (forwarded) scheme is https.
    cookie_secure: bool | None = None

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _split_trusted_proxies(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies_are_networks(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"trusted_proxies: {item!r} is not an IP address or CIDR") from exc
        return value

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _empty_metrics_token_is_unset(cls, value: object) -> object:
        # `HYBRIDTRAIN_METRICS_TOKEN: ${HYBRIDTRAIN_METRICS_TOKEN:-}` in a compose file gives "".
        return None if value == "" else value

    @model_validator(mode="after")
    def _refuse_example_secret_outside_local(self) -> Settings:
        if self.secret_key == _EXAMPLE_SECRET:
            if self.environment != "local":
                raise ValueError(
                    "HYBRIDTRAIN_SECRET_KEY is the example value; set a real secret in production"
                )
            warnings.warn(
                "using the example HYBRIDTRAIN_SECRET_KEY: fine on a laptop, never in production",
                stacklevel=2,
            )
        return self

    @property
    def db_pool_size(self) -> int:
        """Connections the pool keeps: one per lane slot and stream thread, one for the
        liveness monitor (/healthz has an engine of its own)."""
        return self.lane_slots + self.stream_threads + 1

    @property
    def worker_threads(self) -> int:
        """Tokens of AnyIO's default thread limiter, which runs sync handlers and dependencies."""
        return self.lane_slots + self.spare_threads

    @property
    def lane_slots(self) -> int:
        """Requests admitted at once, all lanes together."""
        return self.api_slots + self.agent_slots + self.heartbeat_slots + self.upload_slots

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()


class ClientSettings(BaseSettings):
    """Where the `hybridtrain runs|nodes` commands find the control plane, and as whom."""

    model_config = SettingsConfigDict(env_prefix="HYBRIDTRAIN_", extra="ignore")

    url: str = "http://127.0.0.1:8000"
    token: str | None = None


def get_client_settings() -> ClientSettings:
    """The client settings from the environment (HYBRIDTRAIN_URL, HYBRIDTRAIN_TOKEN)."""
    return ClientSettings()
