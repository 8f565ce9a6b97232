"""hybridtrain: train your own PyTorch code data-parallel across on-prem and cloud GPUs.

Two ways in (docs/user-guide.md):
- a task module: a function returning `hybridtrain.Task`, run by `hybridtrain train --task`,
  `hybridtrain runs create --task` and the dashboard;
- your own loop, changed by a few lines and started by `hybridtrain launch`:
  `init()`, `prepare_model()`, `data_loader()`, `DistributedOptimizer`, `evaluate()`;
- either way, `dataset(name)` reads a data set of the run's, each worker its share (docs/datasets.md).

Imports are lazy: `import hybridtrain` costs nothing until torch-backed names are used, so the
control plane imports `hybridtrain.contract` without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DistributedOptimizer",
    "Metric",
    "Task",
    "TaskError",
    "accuracy",
    "data_loader",
    "dataset",
    "evaluate",
    "init",
    "prepare_model",
]

_LAZY = {
    "Task": "hybridtrain.task",
    "Metric": "hybridtrain.task",
    "TaskError": "hybridtrain.task",
    "accuracy": "hybridtrain.task",
    "init": "trainer.loop",
    "prepare_model": "trainer.loop",
    "data_loader": "trainer.loop",
    "dataset": "hybridtrain.datasets",
    "DistributedOptimizer": "trainer.distributed_optimizer",
    "evaluate": "trainer.loop",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridtrain' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
