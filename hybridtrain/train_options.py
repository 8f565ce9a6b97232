"""A run's training options, typed once: what the API takes, the control plane stores and
forwards, the launch order carries as JSON and the trainer freezes into its `TrainConfig`.

Unset (None) means the strategy's default: the paper benchmark's configuration where
`hybridtrain.strategy_defaults` has one (`TrainOptions.with_defaults`), else the trainer's.
Which options go with which strategy is
`hybridtrain.compat`'s table; the validators here ask it, so every door (the API, the form,
`runs create`, the trainer's own flags) refuses the same runs with the same words. Options are
grouped as the request names them: the exchange's knobs under `compression`, local SGD's under
`local_sgd`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from hybridtrain import compat, contract, strategy_defaults
from hybridtrain.strategy_defaults import describe

# Literals for the OpenAPI schema, built from the one list of each in hybridtrain.contract.
Strategy = Literal[contract.STRATEGIES]  # type: ignore[valid-type]
Allocation = Literal[contract.ALLOCATIONS]  # type: ignore[valid-type]
Device = Literal[contract.DEVICES]  # type: ignore[valid-type]
Flag = Annotated[bool, Field(strict=True)]
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, strict=True)]
SmallCount = Annotated[int, Field(ge=0, le=1_000_000, strict=True)]
# Task arguments travel on every launch order.
MAX_TASK_ARGS_BYTES = 64 * 1024
# The local SGD knobs that sat under `compression` before `local_sgd` existed: still read there
# for one release (docs/api.md), moved into `local_sgd`.
LEGACY_LOCAL_SGD = ("sync_every", "outer_lr", "outer_momentum", "outer_density", "outer_delay")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompressionOptions(_Section):
    """How a strategy exchanges: gradient compression of the compressing strategies, the
    parameter server's pipelining and its per-step variants (the strategy's defaults if unset)."""

    compressor: Literal[contract.COMPRESSORS] | None = Field(  # type: ignore[valid-type]
        default=None, description="how the compressing strategies sparsify a gradient (default topk)")
    value_dtype: Literal[contract.VALUE_DTYPES] | None = Field(  # type: ignore[valid-type]
        default=None, description="the precision of the values a compressed gradient sends (default fp16)")
    select: Literal[contract.SELECT_METHODS] | None = Field(  # type: ignore[valid-type]
        default=None, description="how top-k finds its values (default estimate)")
    density: Fraction | None = Field(
        default=None,
        description="each worker's top-k density to start from, adapted per worker to its link's "
        f"time within [`density_min`, `density_max`] (default {describe('compression.density')})",
    )
    density_min: Fraction | None = Field(
        default=None,
        description=f"the lowest adapted density (default {describe('compression.density_min')}; "
        "with `density` given, 0.4 times it)",
    )
    density_max: Fraction | None = Field(
        default=None,
        description=f"the highest adapted density (default {describe('compression.density_max')}; "
        "with `density` given, twice it)",
    )
    server_k_fraction: Fraction | None = Field(
        default=None,
        description="the share of the aggregated gradient's values the server keeps and sends back "
        f"(default {describe('compression.server_k_fraction')})",
    )
    error_feedback: Flag | None = Field(
        default=None, description="add what compression left out to the next step's gradient; default on")
    momentum_correction: Flag | None = Field(
        default=None,
        description="accumulate momentum on the workers before compression (DGC's momentum "
        "correction) instead of applying it to the sparse update; default on",
    )
    warmup_steps: SmallCount | None = Field(
        default=None,
        description=f"the first steps sent uncompressed (default {describe('compression.warmup_steps')})",
    )
    pipeline_chunks: Annotated[int, Field(ge=1, le=64, strict=True)] | None = Field(
        default=None,
        description="PS strategies: send and aggregate the gradient in this many pipelined chunks "
        "(the server and the wire work on one while the workers compress the next); default "
        f"{describe('compression.pipeline_chunks')}; 1: one piece",
    )
    powersgd_rank: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = Field(
        default=None, description="allreduce-powersgd: the rank of the gradient's low-rank factors (default 2)")
    aggregate_at_sites: Flag | None = Field(
        default=None,
        description="PS strategies across sites: each remote site's workers send their gradients to "
        "the site's relay, which sends one combined frame across the WAN; default off",
    )
    apply_in_forward: Flag | None = Field(
        default=None,
        description="PS strategies with `pipeline_chunks` > 1: step() applies the update's first chunk "
        "and returns; each later chunk is applied during the next forward pass, just before the "
        "first layer that holds it, so the reply's way back hides behind compute with nothing "
        "stale (a parameter must be read in the forward pass of a module holding it, not between "
        "step() and the next forward); default off",
    )

    @model_validator(mode="after")
    def _ordered_densities(self) -> CompressionOptions:
        known = [v for v in (self.density_min, self.density, self.density_max) if v is not None]
        if known != sorted(known):
            raise ValueError("need density_min <= density <= density_max")
        return self


class LocalSgdOptions(_Section):
    """Local SGD's outer steps (`diloco`, `diloco-gc`; the strategy's defaults if unset)."""

    sync_every: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] | None = Field(
        default=None,
        description=f"H, the inner steps each worker takes with the task's own optimizer between outer "
        f"steps; the run exchanges once every H steps (default {describe('local_sgd.sync_every')})",
    )
    outer_lr: Annotated[float, Field(gt=0, le=10, allow_inf_nan=False, strict=True)] | None = Field(
        default=None,
        description=f"the outer Nesterov SGD's learning rate on the workers' mean change "
        f"(default {describe('local_sgd.outer_lr')})",
    )
    outer_momentum: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False, strict=True)] | None = Field(
        default=None,
        description="the outer Nesterov SGD's momentum, 0 for plain SGD "
        f"(default {describe('local_sgd.outer_momentum')})",
    )
    outer_density: Fraction | None = Field(
        default=None,
        description=f"diloco-gc: the top-k density of each worker's parameter change, adapted within half "
        "to twice it; the server keeps 2.5 times it "
        f"(default {describe('local_sgd.outer_density')})",
    )
    outer_delay: Annotated[int, Field(ge=0, le=1_000_000, strict=True)] | None = Field(
        default=None,
        description="apply each outer step this many inner steps after the change was sent, so the "
        f"exchange overlaps them (below `sync_every`; default {describe('local_sgd.outer_delay')}: the workers "
        "wait for it, as the stale steps cost more samples than the wait on the benchmarked runs)",
    )
    asynchronous: Flag | None = Field(
        default=None,
        description="apply each outer step as soon as its mean change has come back, checked at every "
        "inner step, instead of a fixed `outer_delay` later: no worker waits on a slow round unless it "
        "is `max_staleness` inner steps old (replaces `outer_delay`; default off)",
    )
    max_staleness: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] | None = Field(
        default=None,
        description="`asynchronous`: the most inner steps an outer step may land after its change was sent; "
        "a worker waits for it there (1 to H - 1, H being `sync_every`; default H - 1)",
    )
    site_replicas: Flag | None = Field(
        default=None,
        description="each site's workers hold one replica: they average their gradients every inner step "
        "over the site's LAN (through the site's relay worker), and one parameter change per site crosses "
        "the WAN every `sync_every` steps; default off (every worker its own replica)",
    )
    fragments: Annotated[int, Field(ge=1, le=contract.MAX_FRAGMENTS, strict=True)] | None = Field(
        default=None,
        description="streaming: the model goes in this many fragments, each with its outer step every "
        "`sync_every` steps, staggered over them, so each exchange carries 1/fragments of the model and the "
        "peak bandwidth falls as much (at most `sync_every`; the exchange's chunks are the fragments; "
        "default 1, off)",
    )


# Where each option of the compat table sits in a request.
SECTION_OF = {**{name: "compression" for name in CompressionOptions.model_fields},
              **{name: "local_sgd" for name in LocalSgdOptions.model_fields}}


def field_path(option: str) -> str:
    """A run option as the request names it: 'compression.pipeline_chunks', 'rebalance_every'."""
    section = SECTION_OF.get(option)
    return f"{section}.{option}" if section else option


class TrainOptions(BaseModel):
    """What a run trains and how its ranks synchronise; everything else about a launch (ranks,
    checkpoints, membership, where metrics go) is the launch order's own business. Numbers and
    flags are strict, as in every request body: "5" is not a number and 1 is not `true`."""

    model_config = ConfigDict(extra="forbid")

    strategy: Strategy = Field(
        default=contract.DEFAULT_STRATEGY,
        description="how the ranks synchronise: all-reduce, a parameter server, or local SGD (docs/trainer.md)",
    )
    task: Annotated[str, Field(max_length=255)] = Field(
        default=contract.DEFAULT_TASK,
        description="module:function returning a hybridtrain.Task (in the bundle or installed), e.g. "
        "hybridtrain.tasks.digits:widecnn",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict, description='keyword arguments of the task function, a JSON object such as {"lr": 0.05}'
    )
    script: Annotated[str, Field(max_length=255)] | None = Field(
        default=None, description="a training script inside the bundle, run instead of a task"
    )
    global_batch_size: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] = Field(
        default=64, description="B, the samples of one step over all the workers, split among them")
    max_steps: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = Field(
        default=None, description="the steps the run trains (trainer default 300)")
    epochs: Annotated[float, Field(gt=0, le=100_000, allow_inf_nan=False, strict=True)] | None = Field(
        default=None, description="train this many passes over the task's training data instead of `max_steps`")
    target: Annotated[str, Field(max_length=64)] | None = Field(
        default=None, description="an evaluation metric of the task and where it must get, e.g. accuracy>=0.9 "
        "or val_loss<=0.3; the time to it is recorded"
    )
    stop_at_target: Flag = Field(
        default=True,
        description="stop once the target is reached; false records the time to target and "
        "trains on to `max_steps`, so that runs compare final metrics at the same step budget",
    )
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, strict=True)] = Field(
        default=0, description="the seed of the model's initial weights and of every random draw of the run")
    allocation: Allocation | None = Field(
        default=None,
        description="batch split: equal, flops (by the GPUs' FLOPs) or measured (by measured speeds); default by "
        "speed for ps-bz-gc and local SGD, equal for the others; a run that re-splits (`rebalance_every`) "
        "refines it from the times it measures",
    )
    device: Device = Field(default="auto", description="where the ranks compute; auto: a GPU where torch sees one")
    eval_every: Annotated[int, Field(ge=1, le=100_000_000, strict=True)] | None = Field(
        default=None, description="evaluate the task's metrics every N steps (trainer default 50)"
    )
    compression: CompressionOptions | None = None
    local_sgd: LocalSgdOptions | None = Field(
        default=None,
        description="local SGD (diloco, diloco-gc): H and the outer optimizer; see docs/trainer.md",
    )
    rebalance_every: Annotated[int, Field(ge=1, le=1_000_000, strict=True)] | None = Field(
        default=None,
        description="PS strategies: re-split the global batch every N steps from the workers' "
        "observed compute and compression times, starting from the plan (straggler mitigation); "
        f"default {describe('rebalance_every')}, off for the others",
    )

    @model_validator(mode="before")
    @classmethod
    def _legacy_local_sgd(cls, data: Any) -> Any:
        return move_legacy_local_sgd(data)

    @field_validator("task")
    @classmethod
    def _task_ref(cls, value: str) -> str:
        return contract.check_task_ref(value)

    @field_validator("task_args")
    @classmethod
    def _small_json_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            text = json.dumps(value, allow_nan=False, separators=(",", ":"))
        except ValueError as exc:
            raise ValueError(f"task_args must be plain JSON: {exc}") from None
        if len(text.encode()) > MAX_TASK_ARGS_BYTES:
            raise ValueError(f"task_args is {len(text.encode())} bytes of JSON; at most {MAX_TASK_ARGS_BYTES}")
        return value

    @field_validator("target")
    @classmethod
    def _target(cls, value: str | None) -> str | None:
        return None if value is None else str(contract.parse_target(value))

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainOptions:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError("give max_steps or epochs, not both")
        return self

    @model_validator(mode="after")
    def _compatible(self) -> TrainOptions:
        options = self.options()
        found = compat.problems(self.strategy, options)
        if found:
            first = found[0]
            raise field_error(field_path(first.option), compat.describe(first, self.strategy, field_path),
                              options.get(first.option))
        return self

    @model_validator(mode="after")
    def _bounds_hold_the_default_density(self) -> TrainOptions:
        # A density given brings its own band; bounds given alone must hold the strategy's density.
        given = self.compression
        effective = self.with_defaults().compression
        if given is None or given.density is not None or effective is None or effective.density is None:
            return self
        for name, outside in (("density_min", lambda v: v > effective.density),
                              ("density_max", lambda v: v < effective.density)):
            value = getattr(given, name)
            if value is not None and outside(value):
                raise field_error(f"compression.{name}", f"{value:g} leaves out {self.strategy}'s default density "
                                  f"{effective.density:g}: give the density too", value)
        return self

    def options(self) -> dict[str, Any]:
        """The options the compat table rules on, by name (None: the default)."""
        return _flat(dict(self))

    def sections(self) -> dict[str, Any]:
        """The options the strategies' defaults cover, in the request's shape (unset left out)."""
        return {"compression": self.compression.model_dump(exclude_none=True) if self.compression else {},
                "local_sgd": self.local_sgd.model_dump(exclude_none=True) if self.local_sgd else {},
                "rebalance_every": self.rebalance_every}

    def with_defaults(self) -> TrainOptions:
        """These options as the trainer runs them: the strategy's defaults
        (hybridtrain.strategy_defaults) where they leave one unset."""
        filled = strategy_defaults.effective(self.strategy, self.sections())
        return self.model_copy(update={
            "compression": CompressionOptions.model_construct(**filled["compression"]) if filled["compression"] else None,
            "local_sgd": LocalSgdOptions.model_construct(**filled["local_sgd"]) if filled["local_sgd"] else None,
            "rebalance_every": filled["rebalance_every"],
        })

    def for_strategy(self, strategy: str) -> TrainOptions:
        """These options planned for `strategy`: those it does not take dropped (the plan
        preview's side-by-side, the optimizer's suggestion)."""
        return self.model_copy(update={"strategy": strategy, **sections_for(
            strategy, compression=self.compression, local_sgd=self.local_sgd, rebalance_every=self.rebalance_every)})


def sections_for(strategy: str, *, compression: CompressionOptions | None, local_sgd: LocalSgdOptions | None,
                 rebalance_every: int | None = None) -> dict[str, Any]:
    """The option sections with what `strategy` does not take dropped (a section left empty:
    None), as TrainOptions field -> value."""
    kept = compat.for_strategy(strategy, _flat({"compression": compression, "local_sgd": local_sgd,
                                                "rebalance_every": rebalance_every}))
    out: dict[str, Any] = {"rebalance_every": kept["rebalance_every"]}
    for name, section in (("compression", compression), ("local_sgd", local_sgd)):
        values = {k: kept[k] for k in type(section).model_fields if kept[k] is not None} if section else {}
        out[name] = type(section)(**values) if section is not None and values else None
    return out


def move_legacy_local_sgd(data: Any) -> Any:
    """A request body with `compression.sync_every` and the other outer knobs, as requests spelled
    them before `local_sgd`, with those moved there (deprecated; read for one release)."""
    if not isinstance(data, dict) or not isinstance(data.get("compression"), dict):
        return data
    compression = dict(data["compression"])
    moved = {k: compression.pop(k) for k in LEGACY_LOCAL_SGD if k in compression}
    if not moved:
        return data
    local = data.get("local_sgd")
    if isinstance(local, BaseModel):
        local = local.model_dump(exclude_none=True)
    local = dict(local or {})
    both = sorted(k for k in moved if local.get(k) is not None)
    if both:
        raise ValueError(f"give local_sgd.{both[0]}, not also compression.{both[0]} (its old place)")
    return {**data, "compression": compression or None, "local_sgd": {**moved, **local}}


def field_error(path: str, message: str, value: Any = None) -> ValidationError:
    """A validation error located at `path` ('compression.pipeline_chunks'), for a rule checked
    across fields: raised from a model validator, the 422 names the field, not the body."""
    loc = tuple(path.split("."))
    return ValidationError.from_exception_data(
        "TrainOptions", [InitErrorDetails(type=PydanticCustomError("value_error", message), loc=loc, input=value)])


def _flat(fields: dict[str, Any]) -> dict[str, Any]:
    """The compat table's view of (some of) a TrainOptions' fields: the sections' options
    flattened, with `rebalance_every`."""
    flat: dict[str, Any] = {}
    for name in ("compression", "local_sgd"):
        section = fields.get(name)
        if section is not None:
            flat |= dict(section)
    if "rebalance_every" in fields:
        flat["rebalance_every"] = fields["rebalance_every"]
    return flat
