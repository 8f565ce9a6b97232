"""The agent's heartbeat loop against a control plane that sheds a beat (a full heartbeat lane
answers 503 with Retry-After): the beat goes again after Retry-After, not an interval later."""

from __future__ import annotations

import hashlib
import threading

from agent_testing import FakeControlPlane, wait_until

from agents.agent import Agent
from agents.config import AgentSettings

TOKEN = "hta_" + "b" * 40
INTERVAL_S = 4.0


def _beating(plane: FakeControlPlane, tmp_path) -> tuple[Agent, threading.Thread]:
    plane.agent_token_hash = hashlib.sha256(TOKEN.encode()).hexdigest()
    agent = Agent(AgentSettings(server_url=plane.url, state_dir=tmp_path, heartbeat_interval_s=INTERVAL_S))
    agent.client.set_agent_token(TOKEN)
    loop = threading.Thread(target=agent._heartbeat_loop, daemon=True)
    loop.start()
    return agent, loop


def test_a_shed_heartbeat_goes_again_after_its_retry_after(control_plane, tmp_path):
    control_plane.shed_beats = 1
    agent, loop = _beating(control_plane, tmp_path)
    try:
        wait_until(lambda: control_plane.heartbeats, 3 * INTERVAL_S, "a heartbeat taken after the shed one")
    finally:
        agent._stop.set()
        loop.join(10)

    shed, taken = control_plane.beat_times[:2]
    # Retry-After 1 s, spread by up to half: well before the next regular beat.
    assert 1.0 <= taken - shed < INTERVAL_S - 1.0
