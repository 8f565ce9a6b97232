"""Fixtures of the agent tests: a recording control plane and agent processes."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from agent_testing import STUB_COMMAND, AgentProcess, FakeControlPlane

from tests.redis_dbs import private_redis


@pytest.fixture
def control_plane() -> Iterator[FakeControlPlane]:
    """A fresh recording control plane for one test."""
    plane = FakeControlPlane()
    yield plane
    plane.close()


@pytest.fixture
def start_agent(tmp_path: Path) -> Iterator[Callable[..., AgentProcess]]:
    """Start agent processes; any still running at the end are SIGKILLed."""
    started: list[AgentProcess] = []

    def start(
        plane: FakeControlPlane, broker_url: str, *, join: bool = True, state_dir: Path | None = None,
        extra: list[str] | None = None,
    ) -> AgentProcess:
        argv = [
            "--server", plane.url,
            "--state-dir", str(state_dir or tmp_path / "agent-state"),
            "--broker-url", broker_url,
            "--heartbeat-interval", "0.5",
            "--kill-grace", "3",
            "--benchmark-seconds", "0",
            "--trainer-command", json.dumps(STUB_COMMAND),
            *(extra or []),
        ]
        if join:
            argv += ["--token", plane.JOIN_TOKEN]
        agent = AgentProcess(argv, tmp_path / f"agent-{len(started)}.log")
        started.append(agent)
        return agent

    yield start
    for agent in started:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()


@pytest.fixture
def sqlite_broker(tmp_path: Path) -> str:
    """An embedded SQLite broker of the test's own."""
    from agents.celery_app import prepare_embedded_broker

    url = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    prepare_embedded_broker(url)
    return url


@pytest.fixture(scope="session")
def agent_redis_url(redis_url: str) -> str:
    """A Redis database of the agent tests' own."""
    return private_redis(redis_url, 10)
