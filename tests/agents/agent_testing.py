"""Helpers of the agent tests: a recording control plane on the HTTP seam, agent processes,
and checks that processes are really gone."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLE_STUB = Path(__file__).with_name("role_stub.py")
STUB_COMMAND = [sys.executable, str(ROLE_STUB)]


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def pids_from_logs(lines: list[str]) -> dict[str, int]:
    """The pids a role stub prints on its first line: role, child, pgid."""
    for line in lines:
        if line.startswith("PIDS "):
            return {k: int(v) for k, v in (p.split("=") for p in line.split()[1:])}
    return {}


class FakeControlPlane:
    """Records what agents send to the agent endpoints of docs/architecture.md and answers as
    the control plane does: a stand-in at the HTTP seam for tests of the agent alone."""

    JOIN_TOKEN = "join-" + uuid.uuid4().hex

    def __init__(self) -> None:
        self.node_id = 7
        self.queue = f"node.test-{uuid.uuid4().hex[:8]}"
        self.agent_token_hash: str | None = None
        self.registrations: list[dict[str, Any]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.logs: list[tuple[int, dict[str, Any]]] = []
        self.stop_orders: list[dict[str, Any]] = []
        self.profiles: list[tuple[int, dict[str, Any]]] = []
        # GET path -> (the token it wants, None for the agent's, the bytes); GETs are recorded.
        self.files: dict[str, tuple[str | None, bytes]] = {}
        self.downloads: list[str] = []
        self.download_delay_s = 0.0
        # Trainer reports: (run_id, token, body), the token the run's (a trainer's post to the
        # run's metrics endpoint) or None (its agent's delivery of the spool).
        self.reports: list[tuple[int, str | None, dict[str, Any]]] = []
        # While set, every POST is answered 503, as by a control plane that is restarting.
        self.down = False
        # Registrations answered 409 ("retry") before one is taken.
        self.conflicts = 0
        # Heartbeats answered 503 with Retry-After, as by a full heartbeat lane, before one is
        # taken; `beat_times` has when each heartbeat arrived (time.monotonic), shed or not.
        self.shed_beats = 0
        self.retry_after_s = 1
        self.beat_times: list[float] = []
        # The answer to POST /agent/broker; None answers 404, as a control plane that hands
        # out no broker.
        self.broker: dict[str, Any] | None = None
        self.lock = threading.Lock()
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                status, answer, *extra = plane.handle(self.path, self.headers.get("Authorization"), body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                for name, value in (extra[0] if extra else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                status, data = plane.serve(self.path, self.headers.get("Authorization"))
                self.send_response(status)
                self.send_header("Content-Type", "application/gzip" if status == 200 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # Polled every 20 ms, not serve_forever's 500: close() waits for the next poll.
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def _authorized(self, auth: str | None) -> bool:
        if not auth or not auth.startswith("Bearer ") or self.agent_token_hash is None:
            return False
        return hashlib.sha256(auth[7:].encode()).hexdigest() == self.agent_token_hash

    def handle(self, path: str, auth: str | None, body: dict[str, Any]) -> tuple[Any, ...]:
        """(status, answer) or (status, answer, headers)."""
        with self.lock:
            if self.down:
                return 503, {"detail": "control plane restarting"}
            parts = path.strip("/").split("/")
            if len(parts) == 5 and parts[2] == "runs" and parts[4] == "metrics":
                token = auth[7:] if auth and auth.startswith("Bearer ") else None
                self.reports.append((int(parts[3]), token, body))
                return 200, {"stored": len(body.get("records", []))}
            if path == "/api/v1/agent/register":
                if body.get("join_token") != self.JOIN_TOKEN:
                    return 401, {"detail": "unknown join token"}
                if self.conflicts > 0:
                    self.conflicts -= 1
                    return 409, {"detail": "another registration of this node is in progress; retry"}
                digest = hashlib.sha256(body["agent_token"].encode()).hexdigest()
                if self.agent_token_hash not in (None, digest):
                    return 409, {"detail": "join token already used"}
                self.agent_token_hash = digest
                self.registrations.append(body)
                return 201, {"node_id": self.node_id, "node_name": "n1", "queue": self.queue}
            if not self._authorized(auth):
                return 401, {"detail": "bad agent token"}
            if path == "/api/v1/agent/broker":
                return (404, {"detail": "Not Found"}) if self.broker is None else (200, self.broker)
            if path == "/api/v1/agent/heartbeat":
                self.beat_times.append(time.monotonic())
                if self.shed_beats > 0:
                    self.shed_beats -= 1
                    return 503, {"detail": "the server is at capacity; retry"}, {"Retry-After": str(self.retry_after_s)}
                self.heartbeats.append(body)
                stop, self.stop_orders = self.stop_orders, []
                return 200, {"node_id": self.node_id, "status": "online", "stop": stop}
            if len(parts) == 5 and parts[3] == "profiles":
                if body.get("status") == "done" and "samples_per_s" not in (body.get("result") or {}):
                    return 422, {"detail": [{"loc": ["body", "result", "samples_per_s"], "msg": "Field required"}]}
                self.profiles.append((int(parts[4]), body))
                return 200, {"id": int(parts[4]), "status": body.get("status")}
            if len(parts) == 6 and parts[3] == "runs" and parts[5] == "metrics":
                self.reports.append((int(parts[4]), None, body))
                return 200, {"received": len(body.get("records", [])), "stored": len(body.get("records", []))}
            if len(parts) == 6 and parts[3] == "runs" and parts[5] in ("events", "logs"):
                run_id = int(parts[4])
                (self.events if parts[5] == "events" else self.logs).append((run_id, body))
                return 200, {"run_status": "running"}
            return 404, {"detail": "not found"}

    def serve(self, path: str, auth: str | None) -> tuple[int, bytes]:
        """Answer a GET of a file registered in `files`, as the bundle endpoints do."""
        with self.lock:
            self.downloads.append(path)
            entry = self.files.get(path)
            delay = self.download_delay_s
        if delay:
            time.sleep(delay)
        if entry is None:
            return 404, json.dumps({"detail": "Bundle not found"}).encode()
        token, data = entry
        # A file registered without a token is the agent's to fetch (profile bundles).
        allowed = self._authorized(auth) if token is None else auth == f"Bearer {token}"
        if not allowed:
            return 401, json.dumps({"detail": "bad token"}).encode()
        return 200, data

    def downloads_of(self, path: str) -> int:
        with self.lock:
            return self.downloads.count(path)

    def events_of(self, run_id: int, event: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [b for r, b in self.events if r == run_id and (event is None or b["event"] == event)]

    def records_of(self, run_id: int) -> list[dict[str, Any]]:
        """The trainer records posted for `run_id`, in the order they arrived."""
        with self.lock:
            return [r for run, _, body in self.reports if run == run_id for r in body["records"]]

    def lines_of(self, run_id: int, rank: int) -> list[str]:
        with self.lock:
            batches = [b for r, b in self.logs if r == run_id and b["rank"] == rank]
        lines = sorted((line for b in batches for line in b["lines"]), key=lambda x: x["seq"])
        return [x["line"] for x in lines]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class AgentProcess:
    """A real `hybridtrain agent` in its own process, as an operator would start it."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "agent", *argv],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"agent ignored signal {sig} for {timeout} s:\n{self.output()[-3000:]}")
        finally:
            self._log.close()


def role_spec(run_id: int, rank: int = 1, **options: Any) -> dict[str, Any]:
    """A launch order as the control plane sends it, for the role stub."""
    return {
        "run_id": run_id,
        "rank": rank,
        "role": "ps" if rank == 0 else "worker",
        "world_size": 4,
        "master_addr": "127.0.0.1",
        "master_port": 29500,
        "batch_sizes": [20, 8, 4],
        "report_url": f"http://127.0.0.1:1/api/v1/runs/{run_id}/metrics",
        "report_token": "run-secret",
        "train_options": {"strategy": "ps-bz-gc"},
        "options": options,
        "env": {"OMP_NUM_THREADS": "1"},
    }



def make_bundle(files: dict[str, str | bytes], *, extra: list[tarfile.TarInfo] | None = None) -> bytes:
    """A gzipped tar of `files` (relative path -> content), plus raw `extra` members."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return gzip.compress(raw.getvalue())


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wait_registered(plane: FakeControlPlane, agent: AgentProcess, timeout: float = 60) -> None:
    """Wait until `agent` has registered, heartbeats and consumes its queue."""

    def ready() -> bool:
        if agent.proc.poll() is not None:
            pytest.fail(f"agent exited with {agent.proc.returncode}:\n{agent.output()[-3000:]}")
        return bool(plane.heartbeats) and "ready" in agent.output()

    wait_until(ready, timeout, "the agent to register, heartbeat and start its worker")


def publish(broker_url: str, plane: FakeControlPlane, task: str, args: list[Any], **kwargs: Any) -> None:
    """Put an order on the plane's node queue as the control plane does (under the node's key
    prefix on Redis)."""
    from agents.celery_app import make_celery, node_transport_options

    celery = make_celery(broker_url)
    try:
        options = node_transport_options(broker_url, plane.node_id)
        with celery.connection_for_write(transport_options=options) as connection:
            celery.send_task(task, args=args, queue=plane.queue, connection=connection, **kwargs)
    finally:
        celery.close()


def send_launch(broker_url: str, plane: FakeControlPlane, run_id: int, rank: int = 1, **options: Any) -> float:
    """Publish a launch of the role stub on the plane's node queue; returns when it was sent."""
    from agents.celery_app import LAUNCH_ROLE

    sent = time.time()
    publish(broker_url, plane, LAUNCH_ROLE, [run_id, rank, role_spec(run_id, rank, **options)])
    return sent
