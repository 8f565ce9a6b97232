"""The node agent's life: detect the hardware, bind to the node record, heartbeat, and run a
Celery worker on the node's own queue until stopped, then stop every role it started.

Registration is idempotent by construction: the agent makes up its own agent token, saves it
in the state dir *before* registering, and sends it along with the join token; the control
plane stores only its hash. If the answer is lost, a retry with the same pair succeeds, and
after a restart the saved token is all the agent needs.

One agent per state dir (`agents.state`): the agent holds an flock on `{state_dir}/agent.lock`
while it runs, so a second agent pointed at the same directory exits at once instead of
re-registering over the first and reaping its roles. SIGTERM (a spot VM's preemption notice,
or a shutdown) stops the roles with `stop_grace_s` to end cleanly and reports their exits
before the agent exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from agents import probe, profiles, task_context
from agents import supervisor as supervision
from agents.bundles import BundleCache
from agents.client import ControlPlaneClient, beat_retry_delay_s, call_with_retry, retry_conflicts
from agents.config import AgentSettings
from agents.errors import AgentAuthError, AgentConfigError, ControlPlaneError, ControlPlaneRejected
from agents.gpu_usage import GpuUsage
from agents.hardware import Hardware, detect_in_child
from agents.outbox import Outbox
from agents.role_files import DataCache
from agents.state import AgentState, lock_state_dir, new_agent_token

log = logging.getLogger(__name__)

STOP_REASON = "spot notice / agent stopping"
# How long a stopping agent waits for its outbox to empty; the rest waits on disk for the
# next agent on this state dir.
OUTBOX_DRAIN_S = 5.0


class Agent:
    """One node agent process."""

    def __init__(
        self, settings: AgentSettings, *, client: ControlPlaneClient | None = None, gpu_usage: GpuUsage | None = None,
    ) -> None:
        if not settings.server_url:
            raise AgentConfigError("no control plane given: pass --server URL")
        self.settings = settings
        self.state_dir = Path(settings.state_dir)
        self.client = client or ControlPlaneClient(
            settings.server_url, timeout_s=settings.http_timeout_s
        )
        self.state: AgentState | None = None
        self.hardware: Hardware | None = None
        self.supervisor: supervision.Supervisor | None = None
        self._stop = threading.Event()
        self._fatal: str | None = None
        self._worker: Any = None
        self._lock_fd: int | None = None
        self.outbox: Outbox | None = None
        self.probe_server: probe.ProbeServer | None = None
        # Whether the agent consumes with the node's own broker user (the control plane then
        # re-creates it should the broker lose it).
        self._broker_user = False
        self.gpu_usage = gpu_usage or GpuUsage()

    # -- registration ---------------------------------------------------------------------

    def detect_hardware(self) -> Hardware:
        """Detect the machine and, unless disabled, measure the reference model (in a child
        process: the agent itself never imports torch)."""
        hw = detect_in_child(
            self.settings.server_url, benchmark_seconds=self.settings.benchmark_seconds,
            timeout_s=self.settings.hardware_timeout_s,
        )
        if self.settings.advertise_address:
            hw.address = self.settings.advertise_address
        self.hardware = hw
        return hw

    def start_probe_server(self) -> probe.ProbeServer | None:
        """Start the link probe server on the advertised address (or all addresses when that
        one cannot be bound, as behind NAT); None when disabled by probe_port -1."""
        if self.settings.probe_port < 0:
            return None
        host = (self.hardware.address if self.hardware else None) or "0.0.0.0"
        port = self.settings.probe_port
        limits = {"max_seconds": self.settings.probe_max_seconds}
        try:
            server = probe.ProbeServer(host, port, **limits).start()
        except OSError as exc:
            if host == "0.0.0.0":
                log.warning("no link probe server: cannot bind port %d: %s", port, exc)
                return None
            log.warning("cannot bind the probe server to %s (%s); binding all addresses", host, exc)
            try:
                server = probe.ProbeServer("0.0.0.0", port, **limits).start()
            except OSError as again:
                log.warning("no link probe server: cannot bind port %d: %s", port, again)
                return None
        self.probe_server = server
        return server

    def hardware_json(self) -> dict[str, Any]:
        """The hardware report, with the probe server's port when one runs and how this node
        reads data sets (the plan prices their reads by it)."""
        assert self.hardware is not None
        data = self.hardware.to_json()
        if self.probe_server is not None:
            data["probe_port"] = self.probe_server.port
        data["data_cache"] = {"bytes": self.settings.data_cache_bytes,
                              "site_cache": self.settings.data_site_cache_url is not None}
        return data

    def register(self) -> AgentState:
        """Bind to the node: reuse the saved agent token, or register with the join token."""
        assert self.hardware is not None
        server = self.settings.server_url
        assert server is not None
        saved = AgentState.load(self.state_dir)
        if saved is not None and saved.server_url != server:
            log.warning("state dir %s belongs to %s, not %s: registering anew",
                        self.state_dir, saved.server_url, server)
            saved = None
        if saved is not None and saved.registered:
            self.client.set_agent_token(saved.agent_token)
            try:
                answer = call_with_retry(
                    self.client.heartbeat, self._heartbeat_body(first=True), deadline_s=60
                )
                self.state = saved
                self._apply_heartbeat_answer(answer)
                log.info("resumed as node %s (%s) on queue %s", saved.node_id, saved.node_name, saved.queue)
                return saved
            except AgentAuthError as exc:
                if self.settings.join_token is None:
                    raise AgentAuthError(
                        f"the saved agent token was refused ({exc}); pass a new --token"
                    ) from exc
                log.warning("saved agent token refused (%s); registering with the join token", exc)
                saved = None
        if self.settings.join_token is None:
            raise AgentConfigError(
                f"no agent token in {self.state_dir} and no join token: pass --token JOIN_TOKEN"
            )
        # A pending state (token, no node yet) is reused so a retry sends the same token.
        state = saved if saved is not None else AgentState(server_url=server, agent_token=new_agent_token())
        state.save(self.state_dir)
        answer = retry_conflicts(
            self.client.register,
            join_token=self.settings.join_token.get_secret_value(),
            agent_token=state.agent_token,
            hardware=self.hardware_json(),
            deadline_s=max(60.0, self.settings.register_conflict_retry_s),
            conflict_deadline_s=self.settings.register_conflict_retry_s,
        )
        state.node_id = int(answer["node_id"])
        state.node_name = answer.get("node_name")
        state.queue = str(answer["queue"])
        state.save(self.state_dir)
        self.client.set_agent_token(state.agent_token)
        self.state = state
        log.info("registered as node %s (%s) on queue %s", state.node_id, state.node_name, state.queue)
        return state

    def broker_url(self, state: AgentState) -> str:
        """The broker this agent consumes its queue from: the one configured, else the one the
        control plane hands out (on Redis, with a user of this node's own)."""
        from agents.celery_app import embedded_broker_exists, is_embedded_broker, redact_url

        if self.settings.broker_url:
            return self.settings.broker_url
        try:
            answer = call_with_retry(self.client.broker, deadline_s=60)
        except ControlPlaneRejected as exc:
            if exc.status_code == 404:
                raise AgentConfigError(
                    f"the control plane at {self.settings.server_url} hands out no broker (an older "
                    "version?): pass --broker-url"
                ) from exc
            raise
        url = str(answer["url"])
        if is_embedded_broker(url) and not embedded_broker_exists(url):
            raise AgentConfigError(
                f"the control plane at {self.settings.server_url} keeps its orders in its embedded "
                f"broker ({url}), which only agents on its own machine reach: run the control plane "
                "with a Redis broker that agents reach (CELERY_BROKER_URL and "
                "HYBRIDTRAIN_BROKER_URL_FOR_AGENTS, docs/deploy.md), or pass --broker-url"
            )
        self._broker_user = bool(answer.get("node_user"))
        log.info("node %s takes its orders from %s%s", state.node_id, redact_url(url),
                 " as the node's own broker user" if self._broker_user else "")
        return url

    # -- heartbeat ------------------------------------------------------------------------

    def _heartbeat_body(self, *, first: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {
            "roles": self.supervisor.snapshot() if self.supervisor else [],
            "load": {
                "cpu_percent": psutil.cpu_percent(interval=None),
                "memory_available_gb": round(psutil.virtual_memory().available / 2**30, 2),
            },
            "t": time.time(),
            "broker_user": self._broker_user,
        }
        gpus = self.gpu_usage.read()
        if gpus is not None:
            body["gpus"] = gpus
        if first and self.hardware is not None:
            body["hardware"] = self.hardware_json()
        return body

    def _apply_heartbeat_answer(self, answer: dict[str, Any]) -> None:
        # The control plane lists roles it considers finished (a cancel order lost while this
        # node was offline, a run failed elsewhere): stop them here too.
        for item in answer.get("stop", []) or []:
            if self.supervisor is None:
                continue
            threading.Thread(
                target=self.supervisor.cancel,
                args=(int(item["run_id"]),),
                kwargs={"reason": item.get("reason") or "stopped by the control plane",
                        "rank": item.get("rank"), "before_attempt": item.get("before_attempt")},
                daemon=True,
            ).start()

    def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval_s
        failures = 0
        wait = interval
        while not self._stop.wait(wait):
            wait = interval
            try:
                self._apply_heartbeat_answer(self.client.heartbeat(self._heartbeat_body()))
                if failures:
                    log.info("control plane reachable again after %d missed heartbeats", failures)
                failures = 0
            except AgentAuthError as exc:
                # The node was deleted or its token revoked: this agent has no business left.
                self._fatal = f"heartbeat refused: {exc}"
                log.error("%s; stopping the agent", self._fatal)
                self.request_stop()
                return
            except ControlPlaneError as exc:
                failures += 1
                # A shed beat goes again soon: the node's silence then stays far inside the
                # liveness pass's grace (app/lifecycle/liveness.py).
                wait = beat_retry_delay_s(exc.retry_after_s, interval_s=interval, failures=failures)
                log.warning("heartbeat failed (%d in a row): %s; next in %.1f s", failures, exc, wait)

    # -- running --------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the agent to stop: ends the Celery worker, which ends `run`."""
        self._stop.set()
        if self._worker is not None:
            # The worker runs in the main thread; Celery's SIGTERM handler is its proven
            # warm-shutdown path, so take it rather than stopping the blueprint from here.
            os.kill(os.getpid(), signal.SIGTERM)

    def run(self) -> int:
        """Register, then consume the node's queue until stopped; returns the exit status."""
        from celery import signals as celery_signals

        from agents import tasks  # noqa: F401  (registers the tasks on the app)
        from agents.celery_app import app, configure, prepare_embedded_broker

        if threading.current_thread() is threading.main_thread():
            # Until Celery installs its own handlers, a SIGTERM (a spot notice while starting)
            # ends the start instead of killing the agent where it stands.
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, lambda *_: self._stop.set())
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        # Before anything else touches the state dir: a second agent must not reap the
        # first one's roles or register over it.
        self._lock_fd = lock_state_dir(self.state_dir)
        self.detect_hardware()
        bundles = BundleCache(
            self.state_dir, self.client, deadline_s=self.settings.bundle_download_timeout_s
        )
        # Delivery starts once registered: every entry needs the agent token.
        self.outbox = outbox = Outbox(self.state_dir, self.client)
        sup = supervision.Supervisor(
            self.client,
            state_dir=self.state_dir,
            trainer_command=self.settings.trainer_command,
            kill_grace_s=self.settings.kill_grace_s,
            stop_grace_s=self.settings.stop_grace_s,
            log_buffer_lines=self.settings.log_buffer_lines,
            outbox_log_lines=self.settings.outbox_log_lines,
            log_flush_interval_s=self.settings.log_flush_interval_s,
            role_threads=self.settings.role_threads,
            bundles=bundles,
            outbox=outbox,
            server_url=self.settings.server_url,
            data_cache=DataCache(self.settings.data_cache_dir or self.state_dir / "data-cache",
                                 self.settings.data_cache_bytes, self.settings.data_site_cache_url),
        )
        for record in sup.reap_stale():
            log.warning("run %s rank %s died with the previous agent; reporting its exit%s",
                        record.get("run_id"), record.get("rank"),
                        f" (killed leftovers {record['killed']})" if record.get("killed") else "")
        if outbox.pending():
            log.info("%d report(s) from before this agent started wait to be delivered", outbox.pending())
        self.supervisor = sup
        self.start_probe_server()
        state = self.register()
        outbox.start()
        task_context.install(task_context.TaskContext(
            supervisor=sup,
            profiling=profiles.Profiling(
                client=self.client, cache=bundles, state_dir=self.state_dir,
                command=self.settings.profile_command, timeout_s=self.settings.profile_timeout_s,
                threads=self.settings.role_threads, lock_path=self.settings.profile_lock_path,
                lock_wait_s=self.settings.profile_lock_wait_s, min_repeats=self.settings.profile_min_repeats,
                max_repeats=self.settings.profile_max_repeats, stable_spread=self.settings.profile_stable_spread,
            ),
            client=self.client, node_id=state.node_id,
        ))
        heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        heartbeat.start()

        broker_url = self.broker_url(state)
        configure(app, broker_url, node_id=state.node_id)
        prepare_embedded_broker(broker_url)

        def announce_ready(**_: Any) -> None:
            log.info("agent ready: node %s consuming queue %s", state.node_id, state.queue)
            if self._stop.is_set():
                # Asked to stop while the worker started, before its handlers were in place.
                os.kill(os.getpid(), signal.SIGTERM)

        def stop_roles_now(**_: Any) -> None:
            # Celery's warm shutdown drains its broker loop first (up to ~4 s on the SQL
            # transport); stopping the roles meanwhile keeps the agent inside the usual 10 s
            # stop grace of systemd and docker.
            threading.Thread(target=sup.stop_all, args=(STOP_REASON,), daemon=True).start()

        celery_signals.worker_ready.connect(announce_ready, weak=False)
        celery_signals.worker_shutting_down.connect(stop_roles_now, weak=False)
        try:
            self._worker = app.Worker(
                hostname=f"node{state.node_id}@{socket.gethostname()}",
                queues=[state.queue],
                pool="threads",
                concurrency=self.settings.concurrency,
                loglevel=self.settings.log_level,
                without_gossip=True,
                without_mingle=True,
                without_heartbeat=True,
                optimization="fair",
                redirect_stdouts=False,
                quiet=True,
            )
            if not self._stop.is_set():
                self._worker.start()
        finally:
            self._stop.set()
            log.info("stopping: ending every role this agent started")
            stopped = sup.stop_all(STOP_REASON)
            if stopped:
                log.info("stopped %d role(s): %s", len(stopped), stopped)
            sup.close()
            if not outbox.drain(OUTBOX_DRAIN_S):
                log.warning("%d report(s) not delivered yet; the next agent on %s delivers them",
                            outbox.pending(), self.state_dir)
            outbox.close()
            task_context.install(None)
            if self.probe_server is not None:
                self.probe_server.close()
            try:
                self.client.heartbeat(self._heartbeat_body())
            except ControlPlaneError:
                pass
            self.client.close()
        if self._fatal:
            return 3
        return int(getattr(self._worker, "exitcode", 0) or 0)
