"""Fixtures of the deployment-file tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No HYBRIDTRAIN_*/CELERY_*/DATABASE_URL variable of the test's own environment leaks in."""
    for name in list(os.environ):
        if name.startswith(("HYBRIDTRAIN_", "CELERY_")) or name == "DATABASE_URL":
            monkeypatch.delenv(name)
    return monkeypatch
