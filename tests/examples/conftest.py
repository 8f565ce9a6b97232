"""Fixtures for the examples' tests: import an example's module from its own work dir, as the
trainer does with a run's code bundle (the dir on sys.path), on one torch thread."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
from examples_testing import EXAMPLES


@pytest.fixture(autouse=True)
def one_thread():
    """Tests run on 2 shared cores: never more than one torch thread."""
    torch.set_num_threads(1)


@pytest.fixture
def example(monkeypatch):
    """example(dir, module) -> the module imported from examples/<dir>/, forgotten afterwards."""
    imported = []

    def load(directory: str, module: str):
        monkeypatch.syspath_prepend(str(EXAMPLES / directory))
        imported.append(module)
        return importlib.import_module(module)

    yield load
    for name in imported:
        sys.modules.pop(name, None)
