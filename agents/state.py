"""What a node agent keeps in its state dir: its token and node binding (agent.json), and the
lock that keeps one agent per directory (agent.lock)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from agents.errors import AgentConfigError

STATE_FILE = "agent.json"
LOCK_FILE = "agent.lock"


@dataclass
class AgentState:
    """What the agent keeps across restarts (state_dir/agent.json, mode 0600)."""

    server_url: str
    agent_token: str
    node_id: int | None = None
    node_name: str | None = None
    queue: str | None = None

    @classmethod
    def load(cls, state_dir: Path) -> AgentState | None:
        """The saved state, or None when there is none."""
        path = state_dir / STATE_FILE
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def save(self, state_dir: Path) -> None:
        """Write atomically, readable by the owner only (the token is a credential)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state_dir / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(self.__dict__, fh)
        os.replace(tmp, state_dir / STATE_FILE)

    @property
    def registered(self) -> bool:
        return self.node_id is not None and self.queue is not None


def lock_state_dir(state_dir: Path) -> int:
    """Take the state dir for this process (an flock held until it exits); returns the fd.

    Raises AgentConfigError naming the holder's pid when another live agent has it.
    """
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        where = state_dir.resolve()
        raise AgentConfigError(
            f"another agent (pid {holder}) uses {where}; give this one --state-dir DIR "
            f"(e.g. --state-dir {where}-2)"
        ) from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def new_agent_token() -> str:
    """A fresh agent token: 256 random bits, recognisable by its prefix."""
    return "hta_" + secrets.token_urlsafe(32)
