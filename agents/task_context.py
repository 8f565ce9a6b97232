"""What the running agent lends the Celery tasks of its process: its supervisor, the profile
task's settings, its control-plane client and its node id. Celery calls a task by name with
the order's arguments only, so `hybridtrain agent` installs these once it has registered and
removes them when it stops; `agents.tasks` hands them on as explicit arguments."""

from __future__ import annotations

from dataclasses import dataclass

from agents.client import ControlPlaneClient
from agents.errors import AgentError
from agents.profiles import Profiling
from agents.supervisor import Supervisor


@dataclass(frozen=True)
class TaskContext:
    """The agent's parts its tasks use."""

    supervisor: Supervisor
    profiling: Profiling
    client: ControlPlaneClient
    node_id: int | None


_current: TaskContext | None = None


def install(context: TaskContext | None) -> None:
    """Make `context` the one this process's tasks use (None when the agent stops)."""
    global _current
    _current = context


def current() -> TaskContext:
    """The running agent's context; AgentError in a process without an agent."""
    if _current is None:
        raise AgentError("no agent in this process: hybridtrain tasks run inside `hybridtrain agent`")
    return _current
