"""The command-line flag of each training option, made once from its `TrainOptions` field
(`hybridtrain.train_options`): its name, type or choices, and help. Every command that takes a
training option adds its flag from here, each with its own defaults, required-ness and grouping,
so a flag cannot read one way in one command and another way in the next: `hybridtrain runs
create` (app/cli/run_arguments.py), `hybridtrain train` (trainer/cli.py), `hybridtrain plans
optimize` (app/cli/inventory_commands.py), `hybridtrain profiles list|request`
(app/cli/profile_commands.py) and `python -m trainer.profile` (trainer/profile.py).
"""

from __future__ import annotations

import argparse
import re
import types
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from hybridtrain.train_options import CompressionOptions, LocalSgdOptions, TrainOptions

# Flags not spelled as their field's name in kebab case: users' scripts and the docs use these.
FLAG_NAMES = {"global_batch_size": "--global-batch", "local_sgd.asynchronous": "--async-outer"}
# Switches that are on by default, so they take --no-X as well.
NEGATABLE = frozenset({"stop_at_target", "compression.error_feedback", "compression.momentum_correction"})
METAVARS = {
    "task": "MOD:FN", "task_args": "JSON", "script": "PATH", "target": "METRIC>=VALUE",
    "compression.pipeline_chunks": "N", "local_sgd.sync_every": "H", "local_sgd.outer_delay": "STEPS",
    "local_sgd.max_staleness": "STEPS", "local_sgd.fragments": "P", "rebalance_every": "N", "eval_every": "N",
}
# Flags whose command line differs from the request: a script's arguments are the words after --.
HELP = {"script": "your own training script, run instead of a task: a path inside the code bundle; its "
                  "arguments follow --"}
# An option a description names, in backquotes ("with `density` given"): the help names its flag.
_OPTION_NAME = re.compile(r"`([a-z_]+)`")


@dataclass(frozen=True)
class OptionFlag:
    """One training option's flag: `path` is its TrainOptions field, sections dotted
    ('compression.density'), `dest` the attribute argparse sets."""

    path: str
    flag: str
    dest: str
    kind: type
    choices: tuple[Any, ...] | None
    metavar: str | None
    help: str
    static_default: Any

    def add_to(self, container: Any, default: Any = None, note: str = "", *, required: bool = False,
               kind: type | None = None) -> argparse.Action:
        """Add this flag to a parser, an argument group or a mutually exclusive group; `default`
        is the command's (None: unset, the request's or the strategy's default applies), `note`
        what the help says about this command alone, `required` whether the command needs it,
        `kind` a value type narrower than the option's where the command needs one."""
        help_text = f"{self.help}; {note}" if note else self.help
        if default is None and not required and self.static_default is not None and "default" not in help_text:
            help_text += f" (default {_words(self.static_default)})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        if self.kind is bool:
            action = argparse.BooleanOptionalAction if self.path in NEGATABLE else "store_true"
            return container.add_argument(self.flag, action=action, default=default, required=required,
                                          help=help_text)
        return container.add_argument(self.flag, type=None if self.choices else (kind or self.kind), choices=self.choices,
                                      default=default, required=required, metavar=self.metavar, help=help_text)


@cache
def option_flags() -> dict[str, OptionFlag]:
    """Every training option's flag, by TrainOptions path ('seed', 'local_sgd.sync_every')."""
    fields = {name: field for name, field in TrainOptions.model_fields.items()
              if name not in ("compression", "local_sgd")}
    for section, model in (("compression", CompressionOptions), ("local_sgd", LocalSgdOptions)):
        fields |= {f"{section}.{name}": field for name, field in model.model_fields.items()}
    flags = {path: FLAG_NAMES.get(path, "--" + path.rpartition(".")[2].replace("_", "-")) for path in fields}
    by_name = {path.rpartition(".")[2]: flag for path, flag in flags.items()}

    def flagged(text: str) -> str:
        return _OPTION_NAME.sub(lambda m: by_name.get(m.group(1), m.group(0)), text)

    out: dict[str, OptionFlag] = {}
    for path, field in fields.items():
        kind, choices = _kind(field)
        out[path] = OptionFlag(
            path=path, flag=flags[path], dest=flags[path][2:].replace("-", "_"), kind=kind, choices=choices,
            metavar=METAVARS.get(path), help=HELP.get(path) or flagged(field.description or ""),
            static_default=None if field.default is PydanticUndefined else field.default)
    return out


def add_option(container: Any, path: str, default: Any = None, note: str = "", *,
               required: bool = False, kind: type | None = None) -> argparse.Action:
    """Add the flag of the training option at `path` to `container` (see OptionFlag.add_to)."""
    return option_flags()[path].add_to(container, default, note, required=required, kind=kind)


def _kind(field: FieldInfo) -> tuple[type, tuple[Any, ...] | None]:
    """The flag's value type and its choices: a Literal's values, bool for a switch, str for a
    JSON object (the flag takes its text)."""
    annotation = field.annotation
    while True:
        origin = get_origin(annotation)
        if origin in (Union, types.UnionType):
            annotation = next(a for a in get_args(annotation) if a is not type(None))
        elif origin is Annotated:
            annotation = get_args(annotation)[0]
        else:
            break
    if origin is Literal:
        return str, get_args(annotation)
    if origin is dict:
        return str, None
    return annotation, None


def _words(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
