"""Retries of the agent's client: which answers are retried, and for how long."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from agents.client import ControlPlaneClient, beat_retry_delay_s, retry_conflicts
from agents.errors import ControlPlaneRejected, ControlPlaneUnavailable


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


# -- a shed heartbeat ------------------------------------------------------------------------


def test_a_503_names_its_retry_after():
    def shed(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "1"}, json={"detail": "the server is at capacity; retry"})

    client = ControlPlaneClient("http://control-plane", agent_token="hta_x", transport=httpx.MockTransport(shed))
    with pytest.raises(ControlPlaneUnavailable) as raised:
        client.heartbeat({"roles": []})
    assert raised.value.status_code == 503 and raised.value.retry_after_s == 1.0


def test_a_failure_without_retry_after_waits_for_the_next_beat():
    assert beat_retry_delay_s(None, interval_s=5.0, failures=1) == 5.0


def test_a_shed_beat_goes_again_after_retry_after_spread_by_up_to_half():
    delays = [beat_retry_delay_s(1.0, interval_s=5.0, failures=1, rng=random.Random(seed)) for seed in range(200)]
    assert 1.0 <= min(delays) and max(delays) <= 1.5 and max(delays) - min(delays) > 0.3


def test_refusals_in_a_row_back_off_up_to_the_interval():
    rng = random.Random(7)
    delays = [beat_retry_delay_s(1.0, interval_s=5.0, failures=n, rng=rng) for n in (1, 2, 3, 4, 5)]
    assert 1.0 <= delays[0] <= 1.5 and 2.0 <= delays[1] <= 3.0 and delays[3:] == [5.0, 5.0]


def test_an_agent_keeps_its_connection_between_beats_and_drops_it_before_the_control_plane_does():
    from agents.client import KEEPALIVE_EXPIRY_S
    from agents.config import AgentSettings
    from app.config import Settings

    # Both at 5 s (httpx's and uvicorn's defaults), each beat raced the server's close of the
    # connection it reused: a reset, and a heartbeat lost.
    assert AgentSettings().heartbeat_interval_s < KEEPALIVE_EXPIRY_S < Settings().keep_alive_s
