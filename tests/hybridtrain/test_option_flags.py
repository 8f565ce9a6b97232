"""The training options' flags, made once from their TrainOptions fields: one flag per option,
its type and choices from the field, its help from the description with options named by their
flags, and `hybridtrain runs create` declaring the same flags as `hybridtrain train`."""

from __future__ import annotations

import argparse

from hybridtrain.contract import STRATEGIES
from hybridtrain.option_flags import option_flags
from hybridtrain.train_options import CompressionOptions, LocalSgdOptions, TrainOptions


def _leaf_paths() -> set[str]:
    top = {name for name in TrainOptions.model_fields if name not in ("compression", "local_sgd")}
    return (top | {f"compression.{name}" for name in CompressionOptions.model_fields}
            | {f"local_sgd.{name}" for name in LocalSgdOptions.model_fields})


def _runs_create_parser() -> argparse.ArgumentParser:
    from app.cli.run_commands import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    runs = parser._subparsers._group_actions[0].choices["runs"]  # noqa: SLF001 - argparse has no public lookup
    return runs._subparsers._group_actions[0].choices["create"]  # noqa: SLF001


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


def test_runs_create_declares_its_training_options_as_the_trainer_does():
    from trainer.cli import build_parser

    trainer = _by_flag(build_parser())
    create = _by_flag(_runs_create_parser())
    shared = [option_flags()[p].flag for p in option_flags() if option_flags()[p].flag in create]
    assert len(shared) >= 30
    for flag in shared:
        mine, theirs = create[flag], trainer[flag]
        assert (mine.dest, mine.type, mine.choices, mine.metavar, type(mine)) == \
               (theirs.dest, theirs.type, theirs.choices, theirs.metavar, type(theirs)), flag
