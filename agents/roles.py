"""A role this agent started, and the words its end is reported in.

`RoleProcess` is the supervisor's record of one trainer process (or of a role that ended under
an earlier agent process, rebuilt from the ledger); the helpers turn how it ended into the
reason the control plane shows.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.groups import create_time
from agents.spec import RoleSpec

# Long lines (a tensor printed whole) are cut so one line cannot fill a log batch.
MAX_LINE_CHARS = 4000
TAIL_LINES = 20
# The exit code reported for a role that could not be started (its bundle failed).
NOT_STARTED_EXIT_CODE = 1
OOM_HINT = " (likely the kernel's out-of-memory killer: check `dmesg`)"
RESTARTED_REASON = "its agent restarted"


@dataclass
class RoleProcess:
    """A role this agent started, and what became of it."""

    spec: RoleSpec
    # None for a role that failed before its process started.
    proc: subprocess.Popen[bytes] | None
    log_path: Path
    started_at: float
    state: str = "running"  # running, exited
    exit_code: int | None = None
    signal: int | None = None
    cancel_reason: str | None = None
    cause: str | None = None
    ended_at: float | None = None
    reason: str | None = None
    spool: Path | None = None
    # The trainer's metrics file, and its size when this role was launched.
    metrics: Path | None = None
    metrics_from: int = 0
    exit_event: dict[str, Any] | None = None
    pending: deque[dict[str, Any]] = field(default_factory=deque)
    dropped: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The guard has exited (a zombie still holding the group id); the group is swept and the
    # guard reaped; the exit is queued in the outbox.
    leader_exited: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    reaped: bool = False
    reader: threading.Thread | None = None
    # Lines carry a sequence number: batches may arrive out of order after a retry.
    next_seq: int = 0
    ship_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> tuple[int, int]:
        return (self.spec.run_id, self.spec.rank)

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.exit_event.get("pid") if self.exit_event else None

    def snapshot(self) -> dict[str, Any]:
        """The role as a heartbeat reports it."""
        return {
            "run_id": self.spec.run_id,
            "rank": self.spec.rank,
            "role": self.spec.role,
            "attempt": self.spec.attempt,
            "pid": self.pid,
            "state": self.state,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "cancelled": self.cancel_reason is not None,
            "cause": self.cause,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(path: str | None) -> list[str]:
    """The last lines of a role's log file, as an exit event carries them."""
    if not path:
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line[:MAX_LINE_CHARS] for line in data.splitlines()[-TAIL_LINES:]]


def from_record(spec: RoleSpec, record: dict[str, Any], state_dir: Path) -> RoleProcess:
    """An ended role of an earlier agent process, rebuilt from its record."""
    event = dict(record["event"])
    ended = float(event.get("t") or record.get("updated") or time.time())
    role = RoleProcess(
        spec=spec, proc=None, started_at=ended, state="exited",
        log_path=state_dir / "runs" / str(spec.run_id) / f"rank{spec.rank}.log",
        exit_code=event.get("exit_code"), signal=event.get("signal"), cause=event.get("cause"),
        ended_at=ended, reason=event.get("reason"), exit_event=event, reaped=True,
    )
    if event.get("cancelled"):
        role.cancel_reason = event.get("reason") or "stopped"
    for flag in (role.leader_exited, role.gone, role.finished):
        flag.set()
    return role


def record_of(role: RoleProcess) -> dict[str, Any]:
    """The ledger's record of a started role (agents.records): what `from_record` and
    `agents.restart` need after the agent process that started it is gone."""
    spec = role.spec
    return {
        "run_id": spec.run_id,
        "rank": spec.rank,
        "role": spec.role,
        "pid": role.pid,
        "create_time": create_time(role.pid),
        "log": str(role.log_path),
        "spool": str(role.spool) if role.spool else None,
        "metrics": str(role.metrics) if role.metrics else None,
        "metrics_from": role.metrics_from,
        "report_url": spec.report_url,
        "report_token": spec.report_token,
        "attempt": spec.attempt,
    }


def exit_reason(role: RoleProcess) -> str | None:
    spec = role.spec
    who = f"rank {spec.rank} ({spec.role})"
    if role.cancel_reason is not None:
        return f"{who} stopped: {role.cancel_reason}"
    if role.signal is not None:
        name = signal_name(role.signal)
        # SIGKILL from nobody we know of is, on Linux, nearly always the OOM killer.
        hint = OOM_HINT if role.signal == signal.SIGKILL else ""
        return f"{who} was killed by {name}{hint}"
    if role.exit_code:
        last = next((line for line in reversed(role.tail) if line.strip()), "")
        suffix = f": {last.strip()}" if last else ""
        return f"{who} exited with code {role.exit_code}{suffix}"
    return None


def redact(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--report-token":
            out[i + 1] = "***"
    return out


# The role's report token, in a file only the agent's user can read (never on a command line).
TOKEN_FILE = "report-token"
# The run's link secret (trainer.linktls), likewise.
LINK_SECRET_FILE = "link-secret"
# What stays with the agent: its own and the control plane's settings (the broker URL with its
# password, the agent's token, database URLs). The rest of the node's environment (PATH, CUDA,
# a cloud's credentials for the user's data) passes to the role as on any job runner; the
# role's own variables come from its launch order.
_AGENT_ONLY_PREFIXES = ("HYBRIDTRAIN_", "CELERY_")
_AGENT_ONLY_NAMES = frozenset({"DATABASE_URL", "REDIS_URL", "BROKER_URL"})


def role_base_env(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The node's environment for a role, without the agent's own settings and credentials."""
    return {k: v for k, v in environ.items()
            if not k.startswith(_AGENT_ONLY_PREFIXES) and k not in _AGENT_ONLY_NAMES}


def role_env(environ: dict[str, str] | os._Environ[str], *, threads: int | None = None,
             user_code: bool = False) -> dict[str, str]:
    """What a role or a profile of the user's code starts from: `role_base_env`, output line
    buffered (logs reach the control plane as they are written), `threads` OMP/MKL threads."""
    env = role_base_env(environ)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    if user_code:
        # The trainer puts the user's code (--code-dir, the working directory) first on its
        # import path once its own packages are loaded: `python -m trainer` must not find a
        # user's own `trainer/` there first.
        env["PYTHONSAFEPATH"] = "1"
    return env


def signal_name(signum: int) -> str:
    """SIGKILL, SIGSEGV, ... or "signal N" for a number Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def write_secret(path: Path, value: str) -> Path:
    """Write `value` to `path`, readable by this user only (created so, never widened)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value + "\n")
    return path
