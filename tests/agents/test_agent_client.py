"""Retries of the agent's client: which answers are retried, and for how long."""

from __future__ import annotations

import time

import pytest

from agents.client import retry_conflicts
from agents.errors import ControlPlaneRejected


def _conflicts(n: int):
    calls = []

    def register() -> dict:
        calls.append(time.monotonic())
        if len(calls) <= n:
            raise ControlPlaneRejected("409 retry", status_code=409)
        return {"node_id": 1}

    return register, calls


def test_retry_conflicts_retries_a_409_until_it_is_answered():
    register, calls = _conflicts(2)

    assert retry_conflicts(register, deadline_s=10, conflict_deadline_s=10, first_delay_s=0.01) == {"node_id": 1}
    assert len(calls) == 3


def test_retry_conflicts_gives_up_on_a_409_after_its_bound():
    register, calls = _conflicts(1000)

    start = time.monotonic()
    with pytest.raises(ControlPlaneRejected, match="409"):
        retry_conflicts(register, deadline_s=10, conflict_deadline_s=0.3, first_delay_s=0.05, max_delay_s=0.1)

    assert time.monotonic() - start < 1.0 and len(calls) > 1


def test_retry_conflicts_does_not_retry_other_rejections():
    calls = []

    def register() -> dict:
        calls.append(1)
        raise ControlPlaneRejected("422 bad hardware", status_code=422)

    with pytest.raises(ControlPlaneRejected, match="422"):
        retry_conflicts(register, deadline_s=10, conflict_deadline_s=10, first_delay_s=0.01)
    assert len(calls) == 1
