"""Task profiles on a node: run `python -m trainer.profile` in a child process and read its
one JSON line.

The agent process never imports torch: the measurement runs in a child (under the role guard,
so it dies with the agent, in its own process group, so a timeout kills all of it). The child
prints one JSON object on stdout (`{"params": ..., "samples_per_s": ..., ...}`) and exits 0,
or exits non-zero with the reason on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.bundles import BundleCache
from agents.client import ControlPlaneClient
from agents.errors import ProfileError
from agents.roles import role_env, signal_name
from agents.spec import ProfileSpec

DEFAULT_COMMAND = [sys.executable, "-m", "trainer.profile"]
DEFAULT_TIMEOUT_S = 300.0
# How much of the child's stderr a failure report carries.
ERROR_TAIL_LINES = 15
ERROR_MAX_CHARS = 3000


def profile_argv(spec: ProfileSpec, command: list[str]) -> list[str]:
    """`command` + the profile flags of `spec`."""
    return [
        *command,
        "--task", spec.task,
        "--task-args", json.dumps(spec.task_args, separators=(",", ":")),
        "--batch", str(spec.batch_size),
        "--device", spec.device,
    ]


def run_profile(
    argv: list[str],
    *,
    cwd: Path,
    code_dir: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run the profiler `argv` in `cwd` and return the JSON object it printed; `threads`: the
    OMP/MKL threads the node's roles get (the agent's --role-threads).

    Raises ProfileError with the child's last stderr lines (or the reason) when it fails,
    times out or prints no JSON object.
    """
    # The user's code runs here as in a role (agents.supervisor): without the agent's own
    # settings and credentials, and on the roles' threads (an agent started with --role-threads
    # but no OMP_NUM_THREADS would otherwise profile on one thread per core).
    env = role_env(os.environ, threads=threads, user_code=code_dir is not None)
    if code_dir is not None:
        argv = [*argv, "--code-dir", str(Path(code_dir).resolve())]  # absolute: cwd is that directory
    guard = [sys.executable, "-I", "-m", "agents.guard", str(os.getpid()), "--", *argv]
    try:
        proc = subprocess.Popen(
            guard, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        raise ProfileError(f"cannot start the profiler: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # The guard is not reaped yet (communicate had not waited), so its pid still names
        # this group and no other: the whole group goes, the profiler's children included.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise ProfileError(f"the profile did not finish within {timeout_s:g} s{_tail(err, ': ')}") from None
    if proc.returncode != 0:
        how = (
            f"was killed by {signal_name(-proc.returncode)}" if proc.returncode < 0
            else f"exited with code {proc.returncode}"
        )
        raise ProfileError(f"the profiler {how}{_tail(err, ': ')}")
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict):
                return result
    raise ProfileError(f"the profiler printed no JSON result{_tail(err, ': ')}")


def _tail(stderr: bytes, prefix: str) -> str:
    lines = [line for line in stderr.decode("utf-8", "replace").splitlines() if line.strip()]
    text = "\n".join(lines[-ERROR_TAIL_LINES:])[-ERROR_MAX_CHARS:]
    return prefix + text if text else ""


@dataclass
class Profiling:
    """What the `profile_task` Celery task needs from the running agent."""

    client: ControlPlaneClient
    cache: BundleCache
    state_dir: Path
    command: list[str] = field(default_factory=lambda: list(DEFAULT_COMMAND))
    timeout_s: float = DEFAULT_TIMEOUT_S
    # The agent's --role-threads: a profile computes as the node's roles will.
    threads: int | None = None
