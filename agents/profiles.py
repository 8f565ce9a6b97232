"""Task profiles on a node: run `python -m trainer.profile` in a child process and read its
one JSON line.

The agent process never imports torch: the measurement runs in a child (under the role guard,
so it dies with the agent, in its own process group, so a timeout kills all of it). The child
prints one JSON object on stdout (`{"params": ..., "samples_per_s": ..., ...}`) and exits 0,
or exits non-zero with the reason on stderr.

A profile is a measurement every plan leans on, so two rules make it one a plan can trust:

1. One profile at a time per host (`host_lock`): agents that share a machine (the testbed's
   emulated nodes, several agents on one server) share its CPU, and three of them profiling at
   once measured 42, 422 and 522 samples/s for the same CPU. The lock is an exclusive `flock`
   on one file per host (`profile_lock_path`, default `<tmp>/hybridtrain-profile.lock`): the
   kernel drops it when its holder dies, and it needs no broker or server, so it works the
   same with the embedded broker and with Redis.
2. Repeated until stable (`stable_measurement`): the profiler runs until its last
   `min_repeats` runs agree, the spread of their samples/s, (max - min) / median, within
   `tolerance`, and at most `max_repeats` times; the report is the median run of those kept
   (all runs when it never settled) with `spread`, `repeats` and every run's samples/s added,
   so a plan can say how noisy each input is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.bundles import BundleCache
from agents.client import ControlPlaneClient
from agents.errors import ProfileError
from agents.roles import role_env, signal_name
from agents.spec import ProfileSpec

log = logging.getLogger(__name__)

DEFAULT_COMMAND = [sys.executable, "-m", "trainer.profile"]
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_LOCK_PATH = Path(tempfile.gettempdir()) / "hybridtrain-profile.lock"
DEFAULT_LOCK_WAIT_S = 1800.0
MIN_REPEATS = 2
MAX_REPEATS = 4
# A spread of samples/s within 10 % of the median is stable: the planner's batch split and
# the model's step time are then off by less than that.
STABLE_SPREAD = 0.10
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


@contextlib.contextmanager
def host_lock(path: Path, *, wait_s: float = DEFAULT_LOCK_WAIT_S, poll_s: float = 0.2) -> Iterator[float]:
    """Hold this host's profile lock (an exclusive flock on `path`) inside the block; yields
    the seconds spent waiting for it. ProfileError when another holder keeps it past `wait_s`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # Opened without O_CREAT first: in a sticky world-writable directory (/tmp) the kernel
        # refuses O_CREAT on another user's file (fs.protected_regular), and a read-only
        # descriptor is enough for flock.
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ProfileError(f"cannot open the host's profile lock {path}: {exc}") from exc
    try:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise ProfileError(f"cannot take the host's profile lock {path}: {exc}") from exc
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise ProfileError(
                    f"another profile on this host held {path} for {waited:.0f} s; profiles of one "
                    "host run one at a time so that they do not share its CPU"
                )
            time.sleep(poll_s)
        yield time.monotonic() - start
    finally:
        os.close(fd)  # closing the only descriptor releases the lock


def stable_measurement(
    measure: Callable[[], dict[str, Any]], *, min_repeats: int = MIN_REPEATS,
    max_repeats: int = MAX_REPEATS, tolerance: float = STABLE_SPREAD,
) -> dict[str, Any]:
    """Call `measure` until its samples/s are stable (see the module's docstring); the median
    run's result with `spread`, `repeats` and `samples_per_s_runs` added."""
    runs: list[dict[str, Any]] = []
    window = max(1, min_repeats)
    cap = max(max_repeats, window)

    def rate(run: dict[str, Any]) -> float:
        return float(run.get("samples_per_s") or 0.0)

    def spread_of(some: list[dict[str, Any]]) -> float:
        rates = [rate(r) for r in some]
        median = statistics.median(rates)
        return (max(rates) - min(rates)) / median if median > 0 else 0.0

    while True:
        runs.append(measure())
        # Stable: the last `window` runs agree. A first run slowed by a neighbour (or a cold
        # cache) is left behind once the runs after it settle.
        if len(runs) >= window and spread_of(runs[-window:]) <= tolerance:
            kept = runs[-window:]
            break
        if len(runs) >= cap:
            kept = runs
            log.warning("profile not stable after %d runs: samples/s %s (spread %.0f %%)",
                        len(runs), ", ".join(f"{rate(r):.1f}" for r in runs), 100 * spread_of(runs))
            break
    spread = spread_of(kept)
    # The run whose rate is the median of those kept (the lower middle one for an even count),
    # so that every figure reported comes from one and the same run.
    chosen = sorted(kept, key=rate)[(len(kept) - 1) // 2]
    rates = [rate(r) for r in runs]
    return {**chosen, "spread": spread, "repeats": len(runs), "samples_per_s_runs": rates}


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
    lock_path: Path = DEFAULT_LOCK_PATH
    lock_wait_s: float = DEFAULT_LOCK_WAIT_S
    min_repeats: int = MIN_REPEATS
    max_repeats: int = MAX_REPEATS
    stable_spread: float = STABLE_SPREAD
