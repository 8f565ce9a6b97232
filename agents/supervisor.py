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
Fetching the code, a role's files and the command line naming them are `agents.role_files`.

Per role, one reader thread copies output to `runs/<run>/rank<R>.log` and a bounded buffer
(agents.log_shipping); one watcher thread reports "started", waits for the guard to exit
(without reaping it, so its pid cannot be reused while the group is swept), SIGKILLs what is
left of the group, reaps, flushes the logs and reports "exited" after what the trainer did
not deliver (its spool; after a crash or a kill, its metrics file too: agents.reports). One
shipper thread moves buffered lines to the outbox every `log_flush_interval_s`
(agents.log_shipping).

Nothing is sent from here: every report goes into the durable outbox (agents.outbox), whose
one sender delivers in order once the control plane answers. A role's record in the ledger
(agents.records) is kept after its exit, so a launch order delivered again is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agents.bundles import BundleCache
from agents.errors import BundleError, LaunchError
from agents.groups import Spawner, killpg, wait_group_empty
from agents.log_shipping import LogShipper
from agents.outbox import EVENT, Entry, Message, Outbox, Transport
from agents.records import EXITED, RoleRecords
from agents.reports import toward_server, undelivered_messages
from agents.restart import report_lost_roles
from agents.role_files import DataCache, lay_out, prepare_code
from agents.roles import NOT_STARTED_EXIT_CODE, RoleProcess, exit_reason, from_record, record_of, redact, role_env
from agents.spec import RoleSpec, free_port
from hybridtrain.contract import CAUSE_AGENT_STOPPING, CAUSE_CANCEL

log = logging.getLogger(__name__)

# Exited roles stay in heartbeats this long, so an exit whose event was lost still arrives.
EXITED_RETENTION_S = 600.0


class Supervisor:
    """Starts, watches and stops the trainer roles of this node."""

    def __init__(
        self,
        reporter: Transport,
        *,
        state_dir: Path,
        trainer_command: list[str],
        kill_grace_s: float = 10.0,
        stop_grace_s: float = 25.0,
        log_buffer_lines: int = 2000,
        outbox_log_lines: int = 200_000,
        log_flush_interval_s: float = 1.0,
        role_threads: int | None = None,
        bundles: BundleCache | None = None,
        outbox: Outbox | None = None,
        server_url: str | None = None,
        data_cache: DataCache | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.trainer_command = list(trainer_command)
        self.kill_grace_s = kill_grace_s
        self.stop_grace_s = stop_grace_s
        self.role_threads = role_threads
        self.bundles = bundles
        self.server_url = server_url
        self.data_cache = data_cache
        self._roles: dict[tuple[int, int], RoleProcess] = {}
        # Launches fetching their bundle: a repeat order for one of them is refused.
        self._preparing: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._spawner = Spawner()
        self.records = RoleRecords(self.state_dir)
        # The agent hands in its outbox and starts it once registered; alone (tests, tools)
        # the supervisor keeps and starts one of its own.
        self._owns_outbox = outbox is None
        self.outbox = outbox or Outbox(self.state_dir, reporter)
        self.outbox.on_delivered = self._on_delivered
        if self._owns_outbox:
            self.outbox.start()
        self.logs = LogShipper(self.outbox, self.roles, self._closing, buffer_lines=log_buffer_lines,
                               outbox_lines=outbox_log_lines, interval_s=log_flush_interval_s)
        self.logs.start()

    # -- launching -------------------------------------------------------------------------

    def launch(self, spec: RoleSpec) -> RoleProcess:
        """Start one role; an order for a (run, rank) already started here is a no-op.

        "Already started" includes a rank that ran to its end, also under an earlier agent
        process on this state dir (a broker re-delivering the order): its exit is reported
        again instead. With a bundle, the code is fetched and unpacked first (in the calling
        thread, bounded by the cache's deadlines); if that fails the role is returned already
        exited, its reason reported to the control plane as for any other exit.
        """
        key = (spec.run_id, spec.rank)
        if self._closing.is_set():
            raise LaunchError("the agent is stopping; not starting new roles")
        spec = toward_server(spec, self.server_url)
        if spec.pick_port:
            # Rank 0 listens: on the suggested port if it is free here, else on one that is.
            spec = spec.model_copy(update={"master_port": free_port(spec.master_port)})
        self._end_earlier_attempt(spec)
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
            code_dir = prepare_code(self.bundles, spec, run_dir)
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
            files = lay_out(spec, self.trainer_command, run_dir / f"rank{spec.rank}", code_dir,
                            self.data_cache)
            spec, argv = files.spec, files.argv
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
            role = RoleProcess(spec=spec, proc=proc, log_path=log_path, started_at=time.time(), spool=files.spool,
                               metrics=files.metrics, metrics_from=files.metrics_from)
            self._roles[role.key] = role
            self.records.started(record_of(role))
        log.info(
            "started run %s rank %s (%s) as pid %s: %s",
            spec.run_id, spec.rank, spec.role, proc.pid, " ".join(redact(argv)),
        )
        role.reader = threading.Thread(
            target=self.logs.read, args=(role,), name=f"out-{spec.run_id}-{spec.rank}",
            daemon=True,
        )
        role.reader.start()
        threading.Thread(
            target=self._watch, args=(role,), name=f"watch-{spec.run_id}-{spec.rank}",
            daemon=True,
        ).start()
        return role

    def _end_earlier_attempt(self, spec: RoleSpec) -> None:
        """Stop this rank's role of an earlier attempt (the run restarts) and wait until its
        exit is queued, so that it is reported before the new attempt's start."""
        with self._lock:
            old = self._roles.get((spec.run_id, spec.rank))
        if old is None or old.spec.attempt >= spec.attempt:
            return
        # The control plane also sends a cancel for it; whichever comes first stops it.
        self._stop([old], f"relaunched as attempt {spec.attempt}", cause=CAUSE_CANCEL,
                   grace_s=self.kill_grace_s)
        if not old.finished.wait(timeout=self.kill_grace_s + 30):
            raise LaunchError(
                f"run {spec.run_id} rank {spec.rank}: attempt {old.spec.attempt} did not end; "
                f"not starting attempt {spec.attempt}"
            )

    def _existing(self, spec: RoleSpec) -> RoleProcess | None:
        # Called with self._lock held. A higher `attempt` is a relaunch (the run restarted),
        # not a repeat; launch() has ended the earlier attempt's role by now.
        key = (spec.run_id, spec.rank)
        existing = self._roles.get(key)
        if existing is None:
            record = self.records.get(*key)
            if record is None or record.get("state") != EXITED or not record.get("event"):
                return None
            if int(record.get("attempt") or 0) < spec.attempt:
                return None
            existing = from_record(spec, record, self.state_dir)
            self._roles[key] = existing
        elif existing.spec.attempt < spec.attempt:
            if existing.state == "running":
                raise LaunchError(
                    f"run {spec.run_id} rank {spec.rank}: attempt {existing.spec.attempt} still "
                    f"runs here; not starting attempt {spec.attempt}"
                )
            del self._roles[key]
            return None
        log.warning(
            "run %s rank %s was already started (pid %s, %s); ignoring the repeat",
            spec.run_id, spec.rank, existing.pid, existing.state,
        )
        if existing.exit_event is not None:
            # The control plane may have missed the end (the order came back because the
            # broker lost track of it): tell it again; exits are idempotent there.
            self.outbox.put(EVENT, spec.run_id, existing.exit_event)
        return existing

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
        self.records.started(record_of(role))
        self._report_exit(role)
        return role

    def _role_env(self, spec: RoleSpec, code_dir: Path | None = None) -> dict[str, str]:
        return role_env(os.environ, threads=self.role_threads, user_code=code_dir is not None) | spec.env

    # -- watching --------------------------------------------------------------------------

    def _watch(self, role: RoleProcess) -> None:
        spec = role.spec
        assert role.proc is not None and role.pid is not None
        started = {
            "rank": spec.rank,
            "role": spec.role,
            "attempt": spec.attempt,
            "event": "started",
            "pid": role.pid,
            "t": role.started_at,
        }
        if spec.pick_port:
            # The other ranks' orders wait for this: they connect to it.
            started["port"] = spec.master_port
        self.outbox.put(EVENT, spec.run_id, started)

        self._wait_leader(role)
        with role.lock:
            # Whatever the role left in its group (its own children) goes now, while the
            # unreaped guard still holds the group id, so the id cannot have been reused.
            killpg(role.pid, signal.SIGKILL)
            code = role.proc.wait()
            role.reaped = True
        # SIGKILL is delivered asynchronously: "gone" must mean gone, so wait until no live
        # member of the group is left.
        if not wait_group_empty(role.pid, timeout_s=15.0):
            log.warning("run %s rank %s: processes of group %s outlived SIGKILL for 15 s",
                        *role.key, role.pid)
        role.gone.set()
        if role.reader is not None:
            role.reader.join(timeout=5)
        role.exit_code, role.signal = (code, None) if code >= 0 else (None, -code)
        role.ended_at = time.time()
        role.reason = exit_reason(role)
        role.state = "exited"
        log.info("run %s rank %s exited: %s", *role.key, role.reason or "success")

        self.logs.flush(role, final=True)
        self._report_exit(role)

    def _report_exit(self, role: RoleProcess) -> None:
        """Queue the exit, after what the trainer spooled, and mark the record ended."""
        spec = role.spec
        exited = {
            "rank": spec.rank,
            "role": spec.role,
            # Which launch of the rank ended: an exit of an earlier attempt, arriving after the
            # run restarted, must not count against the new one.
            "attempt": spec.attempt,
            "event": "exited",
            "pid": role.pid,
            "exit_code": role.exit_code,
            "signal": role.signal,
            "cancelled": role.cancel_reason is not None,
            "cause": role.cause,
            "reason": role.reason,
            "tail": list(role.tail),
            "t": role.ended_at,
        }
        reports = undelivered_messages(
            run_id=spec.run_id, rank=spec.rank, spool=role.spool, metrics=role.metrics,
            metrics_from=role.metrics_from, clean=role.exit_code == 0,
        )
        # Reports first, so the run's records are in before its end is. Queued before the
        # record says "exited", so a crash in between reports the exit twice (harmless)
        # rather than never.
        self.outbox.put_many([*reports, Message(EVENT, spec.run_id, exited)])
        role.exit_event = exited
        self.records.exited(spec.run_id, spec.rank, exited)
        if role.spool is not None:
            role.spool.unlink(missing_ok=True)
        role.finished.set()

    def _wait_leader(self, role: RoleProcess) -> None:
        assert role.pid is not None
        try:
            # WNOWAIT: learn of the exit but leave the zombie, keeping the pid (= group id).
            os.waitid(os.P_PID, role.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # SIGCHLD ignored somewhere: the kernel reaped it; wait() below copes
        role.leader_exited.set()

    def _on_delivered(self, entry: Entry, answer: dict[str, Any]) -> None:
        if entry.kind != EVENT or entry.body.get("event") != "started" or answer.get("action") != "stop":
            return
        # The run ended while this launch was in flight. Cancel from another thread: a
        # cancel waits for the exit, whose report queues behind this very sender. A late
        # answer about an earlier attempt must not stop the current one.
        with self._lock:
            role = self._roles.get((entry.run_id, int(entry.body.get("rank", -1))))
        if role is None or role.spec.attempt != entry.body.get("attempt", role.spec.attempt):
            return
        reason = answer.get("reason") or "stopped by the control plane"
        threading.Thread(
            target=self.cancel, args=(entry.run_id,),
            kwargs={"reason": reason, "rank": entry.body.get("rank")}, daemon=True,
        ).start()

    # -- stopping --------------------------------------------------------------------------

    def cancel(self, run_id: int, *, reason: str, rank: int | None = None,
               before_attempt: int | None = None) -> list[int]:
        """Stop the run's roles on this node (with `before_attempt`, only those launched for an
        earlier attempt): SIGTERM their groups, SIGKILL after the grace.

        Returns the ranks that were running. Idempotent: a run with nothing running is a no-op.
        """
        targets = [
            r for r in self.roles()
            if r.spec.run_id == run_id and (rank is None or r.spec.rank == rank)
            and (before_attempt is None or r.spec.attempt < before_attempt)
        ]
        return self._stop(targets, reason, cause=CAUSE_CANCEL, grace_s=self.kill_grace_s)

    def stop_all(self, reason: str = "the agent stopped") -> list[tuple[int, int]]:
        """The agent is stopping (a spot notice, a shutdown): take no new role, SIGTERM every
        role's group, SIGKILL what is left after `stop_grace_s`, and queue their exits."""
        self._closing.set()
        targets = self.roles()
        # Said once per role (the agent's shutdown path may ask twice), with the time in the log.
        running = [r for r in targets if r.pid is not None and not r.leader_exited.is_set() and r.cancel_reason is None]
        if running:
            log.warning("%s: SIGTERM to %s, %.0f s to end", reason,
                        ", ".join(f"run {k[0]} rank {k[1]}" for k in (r.key for r in running)), self.stop_grace_s)
        self._stop(targets, reason, cause=CAUSE_AGENT_STOPPING, grace_s=self.stop_grace_s)
        for role in targets:
            role.finished.wait(timeout=10)
        return [r.key for r in targets if r.cancel_reason == reason]

    def _stop(self, targets: list[RoleProcess], reason: str, *, cause: str, grace_s: float) -> list[int]:
        stopped = []
        for role in targets:
            with role.lock:
                if role.reaped or role.leader_exited.is_set() or role.pid is None:
                    continue
                if role.cancel_reason is None:
                    role.cancel_reason, role.cause = reason, cause
                killpg(role.pid, signal.SIGTERM)
                stopped.append(role)
        deadline = time.monotonic() + grace_s
        for role in stopped:
            if not role.leader_exited.wait(timeout=max(0.0, deadline - time.monotonic())):
                with role.lock:
                    if not role.reaped and role.pid is not None:
                        log.warning("run %s rank %s ignored SIGTERM for %.0f s; killing",
                                    *role.key, grace_s)
                        killpg(role.pid, signal.SIGKILL)
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

    def reap_stale(self) -> list[dict[str, Any]]:
        """Report the roles that died with a previous agent process on this state dir, and
        kill whatever of them is left; returns their records (see agents.restart)."""
        return report_lost_roles(self.records, self.outbox)

    def close(self) -> None:
        """Stop the shipper thread (after stop_all), and the outbox if it is this one's."""
        self._closing.set()
        if self._owns_outbox:
            self.outbox.drain(timeout_s=5.0)
            self.outbox.close()
