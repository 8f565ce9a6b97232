"""What a user's task module returns: `hybridtrain.Task`, and how the trainer loads one.

A task is referenced as `module:function` with JSON arguments; the function returns a `Task`.
The trainer imports it on every rank, so everything in it must be importable from the run's
code bundle (or an installed package) and deterministic given the arguments.

    def task(hidden: int = 64, lr: float = 1e-3) -> hybridtrain.Task:
        return hybridtrain.Task(
            model=lambda: MyNet(hidden),
            train_data=MyDataset("train"), eval_data=MyDataset("val"),
            loss=torch.nn.functional.mse_loss,
            optimizer=lambda model: torch.optim.Adam(model.parameters(), lr=lr),
            metrics=[hybridtrain.Metric("mae", mae, higher_is_better=False)],
        )

Batches: the data loader yields what `collate` makes of the samples (by default torch's
`default_collate`); the trainer calls `loss(model(inputs), target)` with `inputs, target =
batch`. A metric's function takes the same `(output, target)` and returns either one value per
sample or the batch's mean; the trainer averages it over the evaluation set's samples, across
workers. `val_loss`, the task's loss on the evaluation data, is always reported when there is
evaluation data.
"""

from __future__ import annotations

import importlib
import inspect
import json
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridtrain.contract import VAL_LOSS, check_metric_name, check_task_ref

if TYPE_CHECKING:  # torch is imported only where a task is built, never by the control plane
    import torch
    from torch import nn


class TaskError(Exception):
    """A task that cannot be loaded or used; the message says what and where, for the run's page."""


@dataclass(frozen=True)
class Metric:
    """A named evaluation scalar: `fn(output, target)` gives per-sample values or a batch mean."""

    name: str
    fn: Callable[[Any, Any], Any]
    higher_is_better: bool = True

    def __post_init__(self) -> None:
        check_metric_name(self.name)
        if self.name == VAL_LOSS:
            raise ValueError(f"metric name {VAL_LOSS!r} is the trainer's: it reports the task's loss on "
                             "its eval_data under that name; give your metric another one")
        if not callable(self.fn):
            raise TypeError(f"metric {self.name!r}: fn must be callable, got {type(self.fn).__name__}")


def _argmax_correct(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=-1) == target).float()


def accuracy() -> Metric:
    """Top-1 accuracy of class logits (higher is better)."""
    return Metric("accuracy", _argmax_correct, higher_is_better=True)


@dataclass(frozen=True)
class Task:
    """Everything the trainer needs to train a user's model; see the module docstring."""

    # Builds a freshly initialised model. Every rank calls it; the replicas then start from
    # worker 1's weights (sent to all), so the factory need not be seeded, but it must build
    # the same architecture everywhere.
    model: Callable[[], nn.Module]
    # Any map-style torch Dataset (or an IterableDataset, read as a stream).
    train_data: Any
    # loss(output, target) -> a scalar tensor, the mean over the batch.
    loss: Callable[[Any, Any], Any]
    # optimizer(model) -> any torch.optim.Optimizer over the model's parameters.
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    eval_data: Any = None
    metrics: Sequence[Metric] = ()
    # schedule(optimizer, max_steps) -> an LR scheduler stepped once per training step.
    schedule: Callable[[Any, int], Any] | None = None
    # collate(list of samples) -> a batch; None uses torch's default_collate.
    collate: Callable[[list[Any]], Any] | None = None
    # transform(sample) -> sample, applied as each sample is read (on the loader's workers).
    transform: Callable[[Any], Any] | None = None
    eval_batch_size: int = 512
    # DataLoader processes per worker (0 reads in the training process).
    data_workers: int = 0

    @property
    def metric_directions(self) -> dict[str, bool]:
        """Every evaluation metric the task reports -> whether higher is better."""
        names = {m.name: m.higher_is_better for m in self.metrics}
        if self.eval_data is not None:
            names.setdefault(VAL_LOSS, False)
        return names


def _check(task: Task, ref: str) -> Task:
    from torch import nn

    problems = []
    if isinstance(task.model, nn.Module):
        problems.append(f"model must be a factory that builds the model (e.g. lambda: {type(task.model).__name__}(...)), "
                        "not a model: every rank builds its own")
    for name in ("model", "loss", "optimizer"):
        if not callable(getattr(task, name)):
            problems.append(f"{name} must be callable, got {type(getattr(task, name)).__name__}")
    for name in ("schedule", "collate", "transform"):
        value = getattr(task, name)
        if value is not None and not callable(value):
            problems.append(f"{name} must be callable or None, got {type(value).__name__}")
    from torch.utils.data import Dataset, IterableDataset

    for name in ("train_data", "eval_data"):
        value = getattr(task, name)
        if value is None and name == "eval_data":
            continue
        if not isinstance(value, (Dataset, IterableDataset)):
            problems.append(f"{name} must be a torch.utils.data.Dataset or IterableDataset, "
                            f"got {type(value).__name__}")
        elif not isinstance(value, IterableDataset) and not hasattr(value, "__len__"):
            problems.append(f"{name}: a map-style Dataset needs __len__")
    if isinstance(task.metrics, (Metric, str)) or not isinstance(task.metrics, (list, tuple)):
        problems.append(f"metrics must be a list of hybridtrain.Metric, got {type(task.metrics).__name__}")
    elif any(not isinstance(m, Metric) for m in task.metrics):
        problems.append("metrics must be hybridtrain.Metric objects, got "
                        f"{[type(m).__name__ for m in task.metrics if not isinstance(m, Metric)]}")
    elif len({m.name for m in task.metrics}) != len(task.metrics):
        problems.append(f"metric names must be unique, got {[m.name for m in task.metrics]}")
    if task.metrics and task.eval_data is None:
        problems.append("metrics are computed on eval_data, which is None")
    if task.eval_batch_size < 1 or task.data_workers < 0:
        problems.append("eval_batch_size must be >= 1 and data_workers >= 0")
    if problems:
        raise TaskError(f"task {ref} returned an unusable Task: " + "; ".join(problems))
    return task


def parse_task_args(text: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Task arguments from JSON text (or a mapping); TaskError unless a JSON object."""
    if text is None or text == "":
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TaskError(f"task arguments are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TaskError(f"task arguments must be a JSON object, got {type(value).__name__}")
    return value


def load_task(ref: str, args: Mapping[str, Any] | None = None) -> Task:
    """Import `module:function`, call it with `args` as keywords, and check what it returns.

    Every failure becomes a TaskError whose message names the task and the cause (with the
    user's traceback, which is what they need to fix it); the original stays chained.
    """
    try:
        check_task_ref(ref)
    except ValueError as exc:
        raise TaskError(str(exc)) from None
    module_name, func_name = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise TaskError(f"task {ref}: no module named {exc.name!r} (is it in the run's code "
                            "bundle, or installed on the node?)") from exc
        raise TaskError(f"task {ref}: importing {module_name} failed:\n{traceback.format_exc()}") from exc
    except Exception as exc:
        raise TaskError(f"task {ref}: importing {module_name} failed:\n{traceback.format_exc()}") from exc
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise TaskError(f"task {ref}: module {module_name} has no function {func_name!r}")
    kwargs = dict(args or {})
    try:
        inspect.signature(func).bind(**kwargs)
    except TypeError as exc:
        raise TaskError(f"task {ref} does not take the arguments {kwargs}: {exc}") from exc
    except ValueError:  # no signature to check (a builtin): the call below says what is wrong
        pass
    try:
        task = func(**kwargs)
    except Exception as exc:
        raise TaskError(f"task {ref} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"task {ref} returned {type(task).__name__}, not a hybridtrain.Task")
    return _check(task, ref)


@dataclass
class TaskInfo:
    """What the control plane learns of a task by profiling it on a node."""

    params: int
    train_samples: int | None
    eval_samples: int | None
    metrics: dict[str, bool] = field(default_factory=dict)
