"""A command line's training options: its flags or its --options-json, validated into the one
typed `TrainOptions` a launch order also carries, then mapped to the `TrainConfig` fields they set.
`trainer.cli` adds the process's own share (workers, rank, files) on top."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from hybridtrain.compat import TAKES, describe, problems
from hybridtrain.contract import default_allocation, parse_target
from hybridtrain.option_flags import option_flags
from hybridtrain.train_options import TrainOptions, field_path


class UsageError(ValueError):
    """A command line that names an impossible run."""


# The training options' flags (hybridtrain.option_flags): TrainOptions field (sections dotted) ->
# the parser's dest. The command line maps into the same typed options that a launch order
# also carries as --options-json.
OPTION_DESTS = {path: flag.dest for path, flag in option_flags().items()}


def _flag(option: str) -> str:
    """The flag of a training option ('compression.pipeline_chunks', 'sync_every')."""
    name = option.rpartition(".")[2]
    found = option_flags().get(option) or option_flags().get(field_path(name))
    return found.flag if found else "--" + name.replace("_", "-")


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainOptions:
    """The training options of a command line: its flags, or its --options-json (not both)."""
    given = {path: getattr(args, dest) for path, dest in OPTION_DESTS.items()
             if getattr(args, dest) != parser.get_default(dest)}
    if args.target_accuracy is not None:
        given["target"] = args.target_accuracy
    if args.options_json is not None:
        # The strategy and device flags always have a value; only a changed one was given.
        if given:
            first = next(iter(given))
            flag = "--target-accuracy" if first == "target" and args.target_accuracy is not None else _flag(first)
            raise UsageError(f"{flag}: --options-json carries the run's training options; give them there")
        try:
            return TrainOptions.model_validate_json(args.options_json)
        except ValidationError as exc:
            raise UsageError(f"--options-json: {_first_error(exc, lambda path: path)}") from None
    # A flag door of its own words: the one table, each rule named by its flags.
    _check_combinations(args, parser)
    values: dict[str, Any] = {"strategy": args.strategy, "device": args.device}
    for path, value in given.items():
        section, _, name = path.rpartition(".")
        (values.setdefault(section, {}) if section else values)[name] = value
    values["target"] = _target(args)
    values["task_args"] = _task_args(args.task_args)
    if args.global_batch is None and args.batch_sizes:
        values["global_batch_size"] = sum(args.batch_sizes)
    try:
        return TrainOptions.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise UsageError(_first_error(exc, _flag)) from None


def _first_error(exc: ValidationError, name: Callable[[str], str]) -> str:
    error = exc.errors()[0]
    path = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{name(path)}: {message}" if path else message


def _task_args(text: str) -> dict[str, Any]:
    try:
        task_args = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--task-args is not valid JSON: {exc}") from None
    if not isinstance(task_args, dict):
        raise UsageError(f"--task-args must be a JSON object, got {text!r}")
    return task_args


def option_fields(opts: TrainOptions) -> dict[str, Any]:
    """The TrainConfig fields that `opts` sets: those given, the strategy's defaults
    (hybridtrain.strategy_defaults) for those it leaves unset; TrainConfig's own for the rest."""
    opts = opts.with_defaults()
    compression = opts.compression.model_dump(exclude_none=True) if opts.compression else {}
    if "aggregate_at_sites" in compression:
        compression["site_aggregation"] = compression.pop("aggregate_at_sites")
    local_sgd = opts.local_sgd.model_dump(exclude_none=True) if opts.local_sgd else {}
    fields: dict[str, Any] = {
        "strategy": opts.strategy, "task": opts.task, "task_args": json.dumps(opts.task_args, sort_keys=True),
        "script": opts.script, "global_batch": opts.global_batch_size, "epochs": opts.epochs,
        "target": opts.target, "stop_at_target": opts.stop_at_target, "seed": opts.seed, "device": opts.device,
        # A run that re-splits (rebalance_every given, or its strategy's default) starts from the
        # split it was given and refines it from measured times, as a run from the API does.
        "allocation": opts.allocation or ("measured" if opts.rebalance_every else default_allocation(opts.strategy)),
        **compression, **local_sgd,
    }
    if opts.rebalance_every is not None:
        fields["rebalance_every"] = opts.rebalance_every
    if opts.max_steps is not None:
        fields["max_steps"] = opts.max_steps
    if opts.eval_every is not None:
        fields["eval_every"] = opts.eval_every
    return fields


def _check_combinations(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The options given against the strategy and each other: hybridtrain.compat's one table
    (an option left at its default is unset, as in a request)."""
    names = [*TAKES, *(n for n in ("momentum_correction", "compressor") if n not in TAKES)]
    dests = {n: OPTION_DESTS.get(field_path(n), n) for n in names}
    options = {n: (None if getattr(args, d) == parser.get_default(d) else getattr(args, d)) for n, d in dests.items()}
    found = problems(args.strategy, options)
    if found:
        raise UsageError(describe(found[0], args.strategy, _flag))


def _target(args: argparse.Namespace) -> str | None:
    if args.target is not None and args.target_accuracy is not None:
        raise UsageError("give --target or --target-accuracy, not both")
    text = args.target if args.target is not None else (
        None if args.target_accuracy is None else f"accuracy>={args.target_accuracy:g}")
    if text is None:
        return None
    try:
        return str(parse_target(text))
    except ValueError as exc:
        raise UsageError(f"--target: {exc}") from None
