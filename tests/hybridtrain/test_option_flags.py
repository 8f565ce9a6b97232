"""The training options' flags, made once from their TrainOptions fields: one flag per option,
its type and choices from the field, its help from the description with options named by their
flags, and every other command that takes a training option (`runs create`, `plans optimize`,
`profiles list|request`, `python -m trainer.profile`) declaring it as `hybridtrain train` does."""

from __future__ import annotations

import argparse

import pytest

from hybridtrain.contract import STRATEGIES
from hybridtrain.option_flags import option_flags
from hybridtrain.train_options import CompressionOptions, LocalSgdOptions, TrainOptions


def _leaf_paths() -> set[str]:
    top = {name for name in TrainOptions.model_fields if name not in ("compression", "local_sgd")}
    return (top | {f"compression.{name}" for name in CompressionOptions.model_fields}
            | {f"local_sgd.{name}" for name in LocalSgdOptions.model_fields})


def _subcommand(*names: str) -> argparse.ArgumentParser:
    """The parser of `hybridtrain NAMES...`, e.g. ("runs", "create")."""
    from app.cli import build_parser

    parser = build_parser()
    for name in names:
        parser = parser._subparsers._group_actions[0].choices[name]  # noqa: SLF001 - argparse has no public lookup
    return parser


def _profiler_parser() -> argparse.ArgumentParser:
    from trainer.profile import build_parser

    return build_parser()


# Each command that takes training options, and the options it must take from the shared table.
COMMANDS = {
    "plans optimize": (lambda: _subcommand("plans", "optimize"),
                       {"task", "task_args", "global_batch_size", "max_steps"}),
    "profiles list": (lambda: _subcommand("profiles", "list"), {"task", "task_args"}),
    "profiles request": (lambda: _subcommand("profiles", "request"), {"task", "task_args", "device"}),
    "trainer.profile": (_profiler_parser, {"task", "task_args", "device"}),
}


def _by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}  # noqa: SLF001


def test_every_training_option_has_a_flag():
    assert set(option_flags()) == _leaf_paths()


def test_flags_keep_their_names_where_they_differ_from_the_field():
    flags = option_flags()
    assert (flags["global_batch_size"].flag, flags["local_sgd.asynchronous"].flag) == ("--global-batch", "--async-outer")


def test_a_literal_option_takes_its_values_as_choices():
    assert option_flags()["strategy"].choices == STRATEGIES


def test_a_help_names_the_options_it_mentions_by_their_flags():
    assert "[--density-min, --density-max]" in option_flags()["compression.density"].help


# Where a command takes a narrower type than the trainer: a run's epochs are whole (the API's column).
NARROWER = {("runs create", "--epochs"): int}


def _same_as_the_trainers(command: argparse.ArgumentParser, name: str = "") -> list[str]:
    """The training options' flags `command` declares, each checked against `hybridtrain train`'s."""
    from trainer.cli import build_parser

    trainer = _by_flag(build_parser())
    mine = _by_flag(command)
    shared = [flag.flag for flag in option_flags().values() if flag.flag in mine]
    for flag in shared:
        ours, theirs = mine[flag], trainer[flag]
        assert (ours.dest, ours.type, ours.choices, ours.metavar, type(ours)) == \
               (theirs.dest, NARROWER.get((name, flag), theirs.type), theirs.choices, theirs.metavar, type(theirs)), flag
    return shared


def test_runs_create_declares_its_training_options_as_the_trainer_does():
    assert len(_same_as_the_trainers(_subcommand("runs", "create"), "runs create")) >= 30


@pytest.mark.parametrize("command", COMMANDS)
def test_other_commands_declare_their_training_options_as_the_trainer_does(command):
    make, paths = COMMANDS[command]
    assert set(_same_as_the_trainers(make())) == {option_flags()[p].flag for p in paths}


@pytest.mark.parametrize("command", COMMANDS)
def test_other_commands_take_their_training_options_help_from_the_table(command):
    make, paths = COMMANDS[command]
    flags = _by_flag(make())
    for path in paths:
        assert flags[option_flags()[path].flag].help.startswith(option_flags()[path].help.replace("%", "%%")), path
