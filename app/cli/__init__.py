"""The `hybridtrain` command: one entry point that hands each subcommand to its package.

`train`, `launch` and `agent` are forwarded untouched to `trainer.cli` and `agents.cli`, so a machine
that only trains needs neither the web stack nor the database drivers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _forwarded(argv: Sequence[str]) -> int | None:
    if argv and argv[0] == "train":
        from trainer.cli import main as train_main

        return train_main(list(argv[1:]))
    if argv and argv[0] == "launch":
        from trainer.cli import launch_main

        return launch_main(list(argv[1:]))
    if argv and argv[0] == "agent":
        from agents.cli import main as agent_main

        return agent_main(list(argv[1:]))
    return None


def build_parser() -> argparse.ArgumentParser:
    """The parser of the control plane's own subcommands."""
    parser = argparse.ArgumentParser(prog="hybridtrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="run the trainer (see `hybridtrain train --help`)")
    sub.add_parser("launch", help="run your own training script on local workers: "
                                  "`hybridtrain launch --workers 4 train.py ARGS`")
    sub.add_parser("agent", help="run a node agent (see `hybridtrain agent --help`)")
    from app.cli import commands, event_commands, token_commands

    commands.register(sub)
    event_commands.register(sub)
    token_commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `hybridtrain` command line."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    forwarded = _forwarded(args_list)
    if forwarded is not None:
        return forwarded
    parser = build_parser()
    args = parser.parse_args(args_list)
    return int(args.func(args) or 0)
