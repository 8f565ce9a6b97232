"""What a launch order carries, and the trainer command line built from it.

The control plane sends a `RoleSpec` as plain JSON inside the `launch_role` task; the agent
validates it and appends the flags to its configured trainer command
(`python -m trainer --role ps|worker --rank R ...`).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Flags the spec sets itself; `options` may not override them.
_RESERVED_FLAGS = frozenset(
    {
        "role",
        "rank",
        "world-size",
        "master-addr",
        "master-port",
        "batch-sizes",
        "report-url",
        "report-token",
    }
)
_FLAG_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
# Environment a launch may set: thread counts and device/communication knobs, nothing that
# changes which code runs (no PATH, LD_PRELOAD or PYTHONPATH from the wire).
_ENV_PREFIXES = ("OMP_", "MKL_", "CUDA_", "NCCL_", "GLOO_", "TORCH_", "HYBRIDTRAIN_")

Scalar = str | int | float | bool
OptionValue = Scalar | list[Annotated[str | int | float, Field()]] | None


class RoleSpec(BaseModel):
    """One role of one run, as the control plane planned it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: int = Field(ge=1)
    rank: int = Field(ge=0)
    role: Literal["ps", "worker"]
    world_size: int = Field(ge=1)
    master_addr: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    # Every worker's batch size in rank order, so each rank knows its own share and alpha.
    batch_sizes: list[int] = Field(default_factory=list)
    report_url: str | None = None
    report_token: str | None = None
    # The rest of the trainer's flags, e.g. {"strategy": "ps-bz-gc", "max-steps": 200}.
    options: dict[str, OptionValue] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _rank_in_world(self) -> RoleSpec:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        return self

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
            if flag in _RESERVED_FLAGS:
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


def _render(value: Scalar | list[str | int | float]) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def trainer_argv(spec: RoleSpec, command: list[str]) -> list[str]:
    """The full command line of a role: `command` + the spec's flags.

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
    if spec.report_token:
        argv += ["--report-token", spec.report_token]
    for name, value in spec.options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, _render(value)]
    return argv
