"""The agent takes its broker from the control plane unless one is configured, and says
plainly when the one handed over cannot be reached from this machine."""

from __future__ import annotations

import hashlib

import pytest
from agent_testing import FakeControlPlane

from agents.agent import Agent
from agents.state import AgentState
from agents.celery_app import redact_url
from agents.client import ControlPlaneClient
from agents.config import AgentSettings
from agents.errors import AgentConfigError

TOKEN = "hta_broker-test-token"


@pytest.fixture
def plane(control_plane: FakeControlPlane) -> FakeControlPlane:
    """The recording control plane, with this agent already bound to its node."""
    control_plane.agent_token_hash = hashlib.sha256(TOKEN.encode()).hexdigest()
    return control_plane


def _agent(plane: FakeControlPlane, tmp_path, **settings: object) -> tuple[Agent, AgentState]:
    client = ControlPlaneClient(plane.url, agent_token=TOKEN)
    agent = Agent(AgentSettings(server_url=plane.url, state_dir=tmp_path, **settings), client=client)
    return agent, AgentState(server_url=plane.url, agent_token=TOKEN, node_id=plane.node_id, queue=plane.queue)


def test_a_configured_broker_is_used_without_asking(plane, tmp_path):
    agent, state = _agent(plane, tmp_path, broker_url="redis://10.0.0.9:6379/0")

    assert agent.broker_url(state) == "redis://10.0.0.9:6379/0"


def test_without_one_the_agent_takes_the_broker_the_control_plane_hands_over(plane, tmp_path):
    plane.broker = {"url": "redis://hybridtrain-node-7:pw@10.0.0.1:6379/0", "node_user": True}
    agent, state = _agent(plane, tmp_path)

    assert agent.broker_url(state) == "redis://hybridtrain-node-7:pw@10.0.0.1:6379/0"
    assert agent._heartbeat_body()["broker_user"] is True


def test_an_embedded_broker_of_another_machine_stops_the_agent_with_what_to_set(plane, tmp_path):
    plane.broker = {"url": f"sqla+sqlite:///{tmp_path / 'not-here' / 'broker.db'}", "node_user": False}
    agent, state = _agent(plane, tmp_path)

    with pytest.raises(AgentConfigError, match="only agents on its own machine reach.*HYBRIDTRAIN_BROKER_URL_FOR_AGENTS"):
        agent.broker_url(state)


def test_an_embedded_broker_on_this_machine_is_taken(plane, tmp_path):
    (tmp_path / "broker.db").touch()
    plane.broker = {"url": f"sqla+sqlite:///{tmp_path / 'broker.db'}", "node_user": False}
    agent, state = _agent(plane, tmp_path)

    assert agent.broker_url(state) == f"sqla+sqlite:///{tmp_path / 'broker.db'}"


def test_a_control_plane_that_hands_out_no_broker_asks_for_broker_url(plane, tmp_path):
    agent, state = _agent(plane, tmp_path)

    with pytest.raises(AgentConfigError, match="pass --broker-url"):
        agent.broker_url(state)


def test_logged_broker_urls_hide_the_password():
    assert redact_url("redis://hybridtrain-node-7:s3cret@h:6379/0") == "redis://hybridtrain-node-7:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
