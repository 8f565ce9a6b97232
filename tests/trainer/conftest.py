"""Fixtures for the trainer tests: one torch thread per process (other engineers share the cores)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tests run on 2 shared cores: never more than one torch thread."""
    torch.set_num_threads(1)
