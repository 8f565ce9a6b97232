"""What the control plane's orders carry, and the trainer command line built from them.

The control plane sends a `RoleSpec` as plain JSON inside the `launch_role` task; the agent
validates it and appends the flags to its configured trainer command
(`python -m trainer --role ps|worker --rank R ... --options-json '{...}' [-- SCRIPT ARGS]`): the
run's training options travel as one typed JSON object (`hybridtrain.train_options`), the
deployment's own settings (checkpoints, membership, sites) as flags. A `ProfileSpec` is the
order of the `profile_task` task: measure one task on this node.
"""

from __future__ import annotations

import re
import socket
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hybridtrain.contract import DEVICES, RESERVED_FLAGS, SHA256, check_task_ref
from hybridtrain.data_access import DatasetAccess
from hybridtrain.train_options import TrainOptions

_FLAG_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
# Environment a launch may set: thread counts and device/communication knobs, nothing that
# changes which code runs (no PATH, LD_PRELOAD or PYTHONPATH from the wire).
_ENV_PREFIXES = ("OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "HYBRIDTRAIN_")

Scalar = str | int | float | bool
OptionValue = Scalar | list[Annotated[str | int | float, Field()]] | None
MAX_SCRIPT_ARGS = 64


class BundleRef(BaseModel):
    """A bundle of the user's code: its sha256 and the control-plane path that serves it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sha256: str
    path: str = Field(max_length=1000)

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        if not SHA256.match(value):
            raise ValueError(f"bundle.sha256: expected 64 lowercase hex digits, got {value!r}")
        return value

    @field_validator("path")
    @classmethod
    def _api_path(cls, value: str) -> str:
        # Only a path on the agent's own control plane: a full URL would send the run's
        # token to whoever the order names.
        if not value.startswith("/api/v1/") or any(c in value for c in "\0?#\r\n ") or "/../" in value + "/":
            raise ValueError(f"bundle.path: expected a path under /api/v1/, got {value!r}")
        return value

    @property
    def short(self) -> str:
        """The digest as messages name it."""
        return self.sha256[:12] + "\u2026"


class RoleSpec(BaseModel):
    """One role of one run, as the control plane planned it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: int = Field(ge=1)
    rank: int = Field(ge=0)
    role: Literal["ps", "worker"]
    world_size: int = Field(ge=1)
    master_addr: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    # Rank 0: master_port is a suggestion; the agent keeps it if it is free on this node, else
    # binds a free one, and names the port in the rank's `started` event.
    pick_port: bool = False
    # Every worker's batch size in rank order, so each rank knows its own share and alpha.
    batch_sizes: list[int] = Field(default_factory=list)
    report_url: str | None = None
    report_token: str | None = None
    # PS strategies: the run's shared secret for TLS between its ranks (trainer.linktls).
    link_secret: str | None = Field(default=None, max_length=200)
    # What the run trains and how it synchronises, handed to the trainer as `--options-json`
    # (None: an order from a control plane that predates it, whose `options` carry them as flags).
    train_options: TrainOptions | None = None
    # The rest of the trainer's flags, e.g. {"checkpoint-every": 100, "sites": "4,4,9"}.
    options: dict[str, OptionValue] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    # The user's code, unpacked on the node and made the role's cwd and PYTHONPATH.
    bundle: BundleRef | None = None
    # Handed to the user's script after a literal `--`.
    script_args: list[str] = Field(default_factory=list, max_length=MAX_SCRIPT_ARGS)
    # Where checkpoints are uploaded and, with the `resume` option, the latest is read from.
    checkpoint_url: str | None = Field(default=None, max_length=2000)
    # The data sets the run reads, with their store's credentials: handed to the role in a file
    # only it can read (`--datasets-file`), never on its command line (hybridtrain.datasets).
    datasets: list[DatasetAccess] = Field(default_factory=list, max_length=16)
    # Admit this rank into a run that is already training (a node added mid-run).
    join: bool = False
    # The run's restart count when this order was made: a launch of a rank the agent already
    # runs is a repeat when the attempt is the same, a relaunch when it is higher.
    attempt: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _rank_in_world(self) -> RoleSpec:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        return self

    @field_validator("checkpoint_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
            raise ValueError(f"checkpoint_url: expected an http(s) URL without query, got {value!r}")
        return value

    @field_validator("batch_sizes")
    @classmethod
    def _positive_batches(cls, sizes: list[int]) -> list[int]:
        if any(n < 1 for n in sizes):
            raise ValueError(f"batch_sizes must all be >= 1, got {sizes}")
        return sizes

    @field_validator("options")
    @classmethod
    def _plain_flags(cls, options: dict[str, OptionValue]) -> dict[str, OptionValue]:
        for name in options:
            flag = name.replace("_", "-")
            if not _FLAG_NAME.match(name):
                raise ValueError(f"options: {name!r} is not a flag name")
            if flag in RESERVED_FLAGS:
                raise ValueError(f"options: {name!r} is set by the spec itself")
        return options

    @field_validator("env")
    @classmethod
    def _allowed_env(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if not key.startswith(_ENV_PREFIXES) or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
                raise ValueError(
                    f"env: {key!r} is not allowed (prefixes: {', '.join(_ENV_PREFIXES)})"
                )
        return env

    @field_validator("script_args")
    @classmethod
    def _no_nul(cls, args: list[str]) -> list[str]:
        for i, arg in enumerate(args):
            if "\0" in arg:
                raise ValueError(f"script_args[{i}]: contains a NUL character")
        return args


class ProfileSpec(BaseModel):
    """A profile order: time task `task` (from `bundle`, if any) at `batch_size` on `device`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    task_args: dict[str, Any] = Field(default_factory=dict)
    bundle: BundleRef | None = None
    batch_size: int = Field(ge=1, le=1 << 20)
    device: str = "auto"

    @field_validator("task")
    @classmethod
    def _task_ref(cls, value: str) -> str:
        return check_task_ref(value)

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value not in DEVICES:
            raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {value!r}")
        return value


def _render(value: Scalar | list[str | int | float]) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def trainer_argv(spec: RoleSpec, command: list[str]) -> list[str]:
    """The full command line of a role: `command` + the spec's flags and its training options
    as one `--options-json` [+ `--` script args].

    Options render as `--name value`; True as a bare `--name`; False and None are left out;
    lists join with commas (the trainer's convention, as in `--speeds 1,0.89`).
    """
    argv = [
        *command,
        "--role",
        spec.role,
        "--rank",
        str(spec.rank),
        "--world-size",
        str(spec.world_size),
        "--master-addr",
        spec.master_addr,
        "--master-port",
        str(spec.master_port),
    ]
    if spec.batch_sizes:
        argv += ["--batch-sizes", _render(spec.batch_sizes)]
    if spec.report_url:
        argv += ["--report-url", spec.report_url]
    if spec.checkpoint_url:
        argv += ["--checkpoint-url", spec.checkpoint_url]
    if spec.join:
        argv.append("--join")
    if spec.train_options is not None:
        argv += ["--options-json", spec.train_options.model_dump_json(exclude_none=True)]
    for name, value in spec.options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, _render(value)]
    if spec.script_args:
        argv += ["--", *spec.script_args]
    return argv


def free_port(preferred: int, host: str = "") -> int:
    """`preferred` if a listener can bind it on `host` (all addresses by default) now, else a
    port the kernel hands out free. The socket is closed before the trainer binds: a small
    window, against the seconds a port reported in a heartbeat would stay unclaimed."""
    for port in (preferred, 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError("no free TCP port on this node")
