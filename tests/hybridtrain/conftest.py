"""Fixtures for the hybridtrain package tests: one torch thread (the cores are shared)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tests run on 2 shared cores: never more than one torch thread."""
    torch.set_num_threads(1)
