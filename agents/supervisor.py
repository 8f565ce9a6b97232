"""The supervisor: starts trainer roles as subprocesses, ships their output, reports their
start and exit, and kills their whole process group on cancel or when the agent stops.

Each role runs under `agents.guard` in a new session (its own process group), spawned from
one long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that forked a child exits,
so spawning from short-lived task threads would kill roles when those threads end.

A role whose launch order names a bundle of the user's code runs in `runs/<run>/code`, the
bundle unpacked there (once per run), and the trainer is told so (`--code-dir`): it puts that
directory first on its import path once its own packages are loaded, and PYTHONSAFEPATH keeps
`python -m trainer` from finding a user's own `trainer/` in the working directory first. A
bundle that cannot be fetched or unpacked ends the role before it starts, reported as an exit.

Per role, one reader thread copies output to `runs/<run>/rank<R>.log` and a bounded buffer;
one watcher thread reports "started", waits for the guard to exit (without reaping it, so
its pid cannot be reused while the group is swept), SIGKILLs what is left of the group,
reaps, flushes the logs and reports "exited". One shipper thread sends buffered lines to
the control plane every `log_flush_interval_s`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from agents.bundles import BundleCache
from agents.client import call_with_retry
from agents.errors import BundleError, ControlPlaneError, LaunchError
from agents.spec import RoleSpec, trainer_argv

log = logging.getLogger(__name__)

# Long lines (a tensor printed whole) are cut so one line cannot fill a log batch.
MAX_LINE_CHARS = 4000
LOG_BATCH_LINES = 500
TAIL_LINES = 20
# Exited roles stay in heartbeats this long, so an exit whose event was lost still arrives.
EXITED_RETENTION_S = 600.0
# The exit code reported for a role that could not be started (its bundle failed).
NOT_STARTED_EXIT_CODE = 1
OOM_HINT = " (likely the kernel's out-of-memory killer: check `dmesg`)"


class Reporter(Protocol):
    """Where the supervisor reports to: the control plane client, or a recorder in tests."""

    def role_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]: ...

    def logs(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]: ...


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
    ended_at: float | None = None
    reason: str | None = None
    reported_exit: bool = False
    pending: deque[dict[str, Any]] = field(default_factory=deque)
    dropped: int = 0
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The guard has exited (a zombie still holding the group id); the group is swept and the
    # guard reaped; the exit has been reported (or given up on).
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
        return self.proc.pid if self.proc is not None else None

    def snapshot(self) -> dict[str, Any]:
        """The role as a heartbeat reports it."""
        return {
            "run_id": self.spec.run_id,
            "rank": self.spec.rank,
            "role": self.spec.role,
            "pid": self.pid,
            "state": self.state,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "cancelled": self.cancel_reason is not None,
            "reason": self.reason,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }


class _Spawner:
    """One thread that lives as long as the agent and does every fork."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="role-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)

    def run(self, fn: Callable[[], Any]) -> Any:
        future: Future[Any] = Future()
        self._requests.put((fn, future))
        return future.result()


class Supervisor:
    """Starts, watches and stops the trainer roles of this node."""

    def __init__(
        self,
        reporter: Reporter,
        *,
        state_dir: Path,
        trainer_command: list[str],
        kill_grace_s: float = 10.0,
        log_buffer_lines: int = 2000,
        log_flush_interval_s: float = 1.0,
        role_threads: int | None = None,
        event_retry_s: float = 30.0,
        bundles: BundleCache | None = None,
    ) -> None:
        self.reporter = reporter
        self.state_dir = Path(state_dir)
        self.trainer_command = list(trainer_command)
        self.kill_grace_s = kill_grace_s
        self.log_buffer_lines = log_buffer_lines
        self.log_flush_interval_s = log_flush_interval_s
        self.role_threads = role_threads
        self.event_retry_s = event_retry_s
        self.bundles = bundles
        self._roles: dict[tuple[int, int], RoleProcess] = {}
        # Launches fetching their bundle: a repeat order for one of them is refused.
        self._preparing: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._spawner = _Spawner()
        self._records = self.state_dir / "roles"
        self._records.mkdir(parents=True, exist_ok=True)
        self._shipper = threading.Thread(target=self._ship_loop, name="log-shipper", daemon=True)
        self._shipper.start()

    # -- launching -------------------------------------------------------------------------

    def launch(self, spec: RoleSpec) -> RoleProcess:
        """Start one role; a repeated order for a (run, rank) already started is a no-op.

        With a bundle, the code is fetched and unpacked first (in the calling thread, bounded
        by the cache's deadlines); if that fails the role is returned already exited, its
        reason reported to the control plane as for any other exit.
        """
        key = (spec.run_id, spec.rank)
        if self._closing.is_set():
            raise LaunchError("the agent is stopping; not starting new roles")
        with self._lock:
            existing = self._existing(spec)
            if existing is not None:
                return existing
            if key in self._preparing:
                raise LaunchError(f"run {spec.run_id} rank {spec.rank} is already being started")
            run_dir = self.state_dir / "runs" / str(spec.run_id)
            run_dir.mkdir(parents=True, exist_ok=True)
            self._preparing.add(key)
        try:
            code_dir = self._prepare_code(spec, run_dir)
        except BundleError as exc:
            return self._fail_before_start(spec, run_dir, str(exc))
        finally:
            with self._lock:
                self._preparing.discard(key)
        if self._closing.is_set():
            raise LaunchError("the agent is stopping; not starting new roles")
        with self._lock:
            existing = self._existing(spec)
            if existing is not None:
                return existing
            log_path = run_dir / f"rank{spec.rank}.log"
            argv = with_code_dir(trainer_argv(spec, self.trainer_command), code_dir)
            # -I: the role's cwd holds the user's code, which must not shadow the guard's own
            # package (a user's `agents/` directory, say).
            guard = [sys.executable, "-I", "-m", "agents.guard", str(os.getpid()), "--", *argv]
            env = self._role_env(spec, code_dir)
            try:
                proc = self._spawner.run(
                    lambda: subprocess.Popen(
                        guard,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        cwd=code_dir or run_dir,
                        env=env,
                        start_new_session=True,
                        close_fds=True,
                    )
                )
            except OSError as exc:
                raise LaunchError(f"cannot start run {spec.run_id} rank {spec.rank}: {exc}") from exc
            role = RoleProcess(spec=spec, proc=proc, log_path=log_path, started_at=time.time())
            self._roles[role.key] = role
        self._write_record(role)
        log.info(
            "started run %s rank %s (%s) as pid %s: %s",
            spec.run_id, spec.rank, spec.role, proc.pid, " ".join(_redact(argv)),
        )
        role.reader = threading.Thread(
            target=self._read_output, args=(role,), name=f"out-{spec.run_id}-{spec.rank}",
            daemon=True,
        )
        role.reader.start()
        threading.Thread(
            target=self._watch, args=(role,), name=f"watch-{spec.run_id}-{spec.rank}",
            daemon=True,
        ).start()
        return role

    def _existing(self, spec: RoleSpec) -> RoleProcess | None:
        existing = self._roles.get((spec.run_id, spec.rank))
        if existing is not None:
            log.warning(
                "run %s rank %s was already started (pid %s, %s); ignoring the repeat",
                spec.run_id, spec.rank, existing.pid, existing.state,
            )
        return existing

    def _prepare_code(self, spec: RoleSpec, run_dir: Path) -> Path | None:
        """The unpacked bundle of `spec` (fetched if needed), or None without a bundle."""
        if spec.bundle is None:
            return None
        if self.bundles is None:
            raise BundleError(f"bundle {spec.bundle.short}: this agent has no bundle cache")
        if not spec.report_token:
            raise BundleError(f"bundle {spec.bundle.short}: the launch order carries no run token to fetch it with")
        archive = self.bundles.ensure(spec.bundle, spec.report_token)
        return self.bundles.unpack(archive, run_dir / "code", ref=spec.bundle)

    def _fail_before_start(self, spec: RoleSpec, run_dir: Path, why: str) -> RoleProcess:
        """Record and report a role that ended before its process could start."""
        now = time.time()
        role = RoleProcess(spec=spec, proc=None, log_path=run_dir / f"rank{spec.rank}.log", started_at=now)
        role.state, role.exit_code, role.ended_at = "exited", NOT_STARTED_EXIT_CODE, now
        role.reason = f"rank {spec.rank} ({spec.role}) not started: {why}"
        role.tail.append(why)
        role.reaped = True
        for event in (role.leader_exited, role.gone):
            event.set()
        with self._lock:
            existing = self._roles.get(role.key)
            if existing is not None:
                return existing
            self._roles[role.key] = role
        with contextlib.suppress(OSError), open(role.log_path, "a") as sink:
            sink.write(why + "\n")
        log.warning("run %s rank %s not started: %s", spec.run_id, spec.rank, why)
        threading.Thread(
            target=self._report_exit, args=(role,), name=f"exit-{spec.run_id}-{spec.rank}",
            daemon=True,
        ).start()
        return role

    def _role_env(self, spec: RoleSpec, code_dir: Path | None = None) -> dict[str, str]:
        env = dict(os.environ)
        # Line-buffered output, so logs reach the control plane as they are written.
        env["PYTHONUNBUFFERED"] = "1"
        if self.role_threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.role_threads)
        env.update(spec.env)
        if code_dir is not None:
            env["PYTHONSAFEPATH"] = "1"
        return env

    # -- watching --------------------------------------------------------------------------

    def _read_output(self, role: RoleProcess) -> None:
        assert role.proc.stdout is not None
        with open(role.log_path, "ab", buffering=0) as sink:
            for raw in iter(role.proc.stdout.readline, b""):
                sink.write(raw)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")[:MAX_LINE_CHARS]
                with role.lock:
                    role.tail.append(line)
                    if len(role.pending) >= self.log_buffer_lines:
                        role.pending.popleft()
                        role.dropped += 1
                    role.pending.append({"seq": role.next_seq, "t": time.time(), "line": line})
                    role.next_seq += 1
        role.proc.stdout.close()

    def _watch(self, role: RoleProcess) -> None:
        spec = role.spec
        started = {
            "rank": spec.rank,
            "role": spec.role,
            "event": "started",
            "pid": role.pid,
            "t": role.started_at,
        }
        try:
            answer = self._report_event(spec.run_id, started)
            if answer.get("action") == "stop":
                # The run ended while this launch was in flight. Cancel from another thread:
                # cancel waits for the exit that this very thread observes below.
                reason = answer.get("reason") or "stopped by the control plane"
                threading.Thread(
                    target=self.cancel, args=(spec.run_id,), kwargs={"reason": reason, "rank": spec.rank},
                    daemon=True,
                ).start()
        except ControlPlaneError as exc:
            log.warning("could not report the start of run %s rank %s: %s", *role.key, exc)

        self._wait_leader(role)
        with role.lock:
            # Whatever the role left in its group (its own children) goes now, while the
            # unreaped guard still holds the group id, so the id cannot have been reused.
            _killpg(role.pid, signal.SIGKILL)
            code = role.proc.wait()
            role.reaped = True
        # SIGKILL is delivered asynchronously: "gone" must mean gone, so wait until no live
        # member of the group is left.
        if not _wait_group_empty(role.pid, timeout_s=15.0):
            log.warning("run %s rank %s: processes of group %s outlived SIGKILL for 15 s",
                        *role.key, role.pid)
        role.gone.set()
        if role.reader is not None:
            role.reader.join(timeout=5)
        role.exit_code, role.signal = (code, None) if code >= 0 else (None, -code)
        role.ended_at = time.time()
        role.reason = _exit_reason(role)
        role.state = "exited"
        self._remove_record(role)
        log.info("run %s rank %s exited: %s", *role.key, role.reason or "success")

        self._flush_logs(role, final=True)
        self._report_exit(role)

    def _report_exit(self, role: RoleProcess) -> None:
        spec = role.spec
        exited = {
            "rank": spec.rank,
            "role": spec.role,
            "event": "exited",
            "pid": role.pid,
            "exit_code": role.exit_code,
            "signal": role.signal,
            "cancelled": role.cancel_reason is not None,
            "reason": role.reason,
            "tail": list(role.tail),
            "t": role.ended_at,
        }
        try:
            self._report_event(spec.run_id, exited)
            role.reported_exit = True
        except ControlPlaneError as exc:
            log.warning(
                "could not report the exit of run %s rank %s (the heartbeat carries it): %s",
                *role.key, exc,
            )
        role.finished.set()

    def _wait_leader(self, role: RoleProcess) -> None:
        try:
            # WNOWAIT: learn of the exit but leave the zombie, keeping the pid (= group id).
            os.waitid(os.P_PID, role.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # SIGCHLD ignored somewhere: the kernel reaped it; wait() below copes
        role.leader_exited.set()

    def _report_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        deadline = 3.0 if self._closing.is_set() else self.event_retry_s
        return call_with_retry(self.reporter.role_event, run_id, body, deadline_s=deadline) or {}

    # -- logs ------------------------------------------------------------------------------

    def _ship_loop(self) -> None:
        while not self._closing.wait(self.log_flush_interval_s):
            for role in self.roles():
                if role.state == "running":
                    self._flush_logs(role)

    def _flush_logs(self, role: RoleProcess, *, final: bool = False) -> None:
        with role.ship_lock:
            self._flush_logs_locked(role, final=final)

    def _flush_logs_locked(self, role: RoleProcess, *, final: bool) -> None:
        while True:
            with role.lock:
                if not role.pending:
                    return
                batch = [role.pending.popleft() for _ in range(min(LOG_BATCH_LINES, len(role.pending)))]
                dropped, role.dropped = role.dropped, 0
            body = {"rank": role.spec.rank, "lines": batch, "dropped": dropped}
            try:
                self.reporter.logs(role.spec.run_id, body)
            except ControlPlaneError as exc:
                with role.lock:
                    # Put the batch back in front; what no longer fits is counted as dropped.
                    room = self.log_buffer_lines - len(role.pending)
                    keep = batch[-room:] if room > 0 else []
                    role.pending.extendleft(reversed(keep))
                    role.dropped += dropped + len(batch) - len(keep)
                if final:
                    log.warning("dropping %d log lines of run %s rank %s: %s",
                                len(role.pending), *role.key, exc)
                    role.pending.clear()
                else:
                    log.debug("log shipping for run %s rank %s postponed: %s", *role.key, exc)
                return

    # -- stopping --------------------------------------------------------------------------

    def cancel(self, run_id: int, *, reason: str, rank: int | None = None) -> list[int]:
        """Stop the run's roles on this node: SIGTERM their groups, SIGKILL after the grace.

        Returns the ranks that were running. Idempotent: a run with nothing running is a no-op.
        """
        targets = [
            r for r in self.roles()
            if r.spec.run_id == run_id and (rank is None or r.spec.rank == rank)
        ]
        return self._stop(targets, reason)

    def stop_all(self, reason: str = "the agent stopped") -> list[tuple[int, int]]:
        """Stop every role (the agent is shutting down) and wait for their exit reports."""
        self._closing.set()
        targets = self.roles()
        self._stop(targets, reason)
        for role in targets:
            role.finished.wait(timeout=10)
        return [r.key for r in targets if r.cancel_reason == reason]

    def _stop(self, targets: list[RoleProcess], reason: str) -> list[int]:
        stopped = []
        for role in targets:
            with role.lock:
                if role.reaped or role.leader_exited.is_set():
                    continue
                if role.cancel_reason is None:
                    role.cancel_reason = reason
                _killpg(role.pid, signal.SIGTERM)
                stopped.append(role)
        deadline = time.monotonic() + self.kill_grace_s
        for role in stopped:
            if not role.leader_exited.wait(timeout=max(0.0, deadline - time.monotonic())):
                with role.lock:
                    if not role.reaped:
                        log.warning("run %s rank %s ignored SIGTERM for %.0f s; killing",
                                    *role.key, self.kill_grace_s)
                        _killpg(role.pid, signal.SIGKILL)
        for role in stopped:
            # The watcher sweeps the group and reaps; a stop returns once the processes are gone.
            role.gone.wait(timeout=20)
        return [r.spec.rank for r in stopped]

    # -- state -----------------------------------------------------------------------------

    def roles(self) -> list[RoleProcess]:
        """Every role started by this agent process and not yet forgotten."""
        now = time.time()
        with self._lock:
            for key, role in list(self._roles.items()):
                if role.ended_at is not None and now - role.ended_at > EXITED_RETENTION_S:
                    del self._roles[key]
            return list(self._roles.values())

    def snapshot(self) -> list[dict[str, Any]]:
        """The roles as the heartbeat reports them."""
        return [r.snapshot() for r in self.roles()]

    def _write_record(self, role: RoleProcess) -> None:
        try:
            create_time = psutil.Process(role.pid).create_time()
        except psutil.Error:
            create_time = None
        record = {
            "run_id": role.spec.run_id,
            "rank": role.spec.rank,
            "role": role.spec.role,
            "pid": role.pid,
            "create_time": create_time,
        }
        path = self._record_path(role.spec.run_id, role.spec.rank)
        path.write_text(json.dumps(record))

    def _remove_record(self, role: RoleProcess) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._record_path(role.spec.run_id, role.spec.rank).unlink()

    def _record_path(self, run_id: int, rank: int) -> Path:
        return self._records / f"{run_id}-{rank}.json"

    def reap_stale(self) -> list[dict[str, Any]]:
        """Kill what a previous agent process on this state dir left running; return it.

        A record's group is killed if its leader is the same process (same start time) or
        is gone while members remain: Linux keeps a pid allocated while a group uses it, so
        members of a group whose leader died can only be that role's leftovers.
        """
        stale = []
        for path in sorted(self._records.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                pgid = int(record["pid"])
            except (OSError, ValueError, KeyError):
                path.unlink(missing_ok=True)
                continue
            leader_alive = False
            try:
                leader = psutil.Process(pgid)
                created = record.get("create_time")
                if created is None or abs(leader.create_time() - created) > 0.01:
                    # Another process took the pid after the group dissolved: not ours.
                    path.unlink(missing_ok=True)
                    continue
                leader_alive = True
            except psutil.NoSuchProcess:
                pass
            members = _group_members(pgid)
            if leader_alive or members:
                _killpg(pgid, signal.SIGKILL)
                record["killed"] = sorted({pgid, *members} if leader_alive else set(members))
                log.warning("killed leftovers of run %s rank %s (group %s)",
                            record.get("run_id"), record.get("rank"), pgid)
                stale.append(record)
            path.unlink(missing_ok=True)
        return stale

    def close(self) -> None:
        """Stop the shipper thread (after stop_all)."""
        self._closing.set()


def _killpg(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _wait_group_empty(pgid: int, *, timeout_s: float) -> bool:
    """Poll until process group `pgid` has no live member left; False if some remain.

    Zombies do not count: an orphan killed by SIGKILL stays a zombie until PID 1 reaps it,
    which a container's PID 1 may never do. A loaded machine can take seconds to deliver a
    SIGKILL to a process in uninterruptible sleep, hence a bound of several seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if not _group_members(pgid, live_only=True):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _group_members(pgid: int, *, live_only: bool = False) -> list[int]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and not (live_only and proc.status() == psutil.STATUS_ZOMBIE):
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return members


def _exit_reason(role: RoleProcess) -> str | None:
    spec = role.spec
    who = f"rank {spec.rank} ({spec.role})"
    if role.cancel_reason is not None:
        return f"{who} stopped: {role.cancel_reason}"
    if role.signal is not None:
        try:
            name = signal.Signals(role.signal).name
        except ValueError:
            name = f"signal {role.signal}"
        # SIGKILL from nobody we know of is, on Linux, nearly always the OOM killer.
        hint = OOM_HINT if role.signal == signal.SIGKILL else ""
        return f"{who} was killed by {name}{hint}"
    if role.exit_code:
        last = next((line for line in reversed(role.tail) if line.strip()), "")
        suffix = f": {last.strip()}" if last else ""
        return f"{who} exited with code {role.exit_code}{suffix}"
    return None


def _redact(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--report-token":
            out[i + 1] = "***"
    return out


_current: Supervisor | None = None


def install(supervisor: Supervisor | None) -> None:
    """Make `supervisor` the one the Celery tasks of this process use."""
    global _current
    _current = supervisor


def current() -> Supervisor:
    """The supervisor installed by the running agent."""
    if _current is None:
        raise LaunchError(
            "no supervisor in this process: hybridtrain tasks run inside `hybridtrain agent`"
        )
    return _current


def with_code_dir(argv: list[str], code_dir: Path | None) -> list[str]:
    """`argv` with `--code-dir DIR` among the trainer's options (before a script's `--`)."""
    if code_dir is None:
        return argv
    at = argv.index("--") if "--" in argv else len(argv)
    # Absolute: the role starts in that directory, where a relative path (an agent run with a
    # relative --state-dir, as `hybridtrain local` does) would point below itself.
    return [*argv[:at], "--code-dir", str(Path(code_dir).resolve()), *argv[at:]]
