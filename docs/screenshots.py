"""Regenerate the dashboard's screenshots (docs/screenshots/) from the real pages: `make screenshots`.

Starts the control plane (`hybridtrain server`) on a temporary SQLite database and a free
loopback port, fills it through its own HTTP API, then signs in through the login page in
headless Chromium (Debian's, /usr/bin/chromium) and saves one PNG per page. Nothing outside the
temporary folder and the output folder is written; `--out DIR` sends the pictures elsewhere.

What is real: every page, form and chart is the product's own, served by `hybridtrain server`;
the admin token comes from `hybridtrain tokens create`, the others from the API. Sites, nodes,
prices, a cluster, site links, a code bundle (examples/charlm packed as `runs create --workdir`
packs it), a data set (written with `hybridtrain.datasets`, uploaded as `datasets upload` does)
and runs are made through /api/v1; the last node is added through the Nodes page's form. Each
node's agent registers with the join token the control plane handed out, heartbeats, takes its
orders (launches, profiles, cancels) from its queue on the broker and reports its roles' starts
and exits on the agents' routes (`agents.client`); each rank reports its metrics and run events
with the token its launch order carried, and the server uploads its checkpoints with it. So the
control plane itself runs every run's life: launch, a worker leaving on a spot notice, the
server's death and the restart from the latest checkpoint, a node added while training, the
end, and a run queued behind a busy GPU.

What is filled in: no trainer or GPU runs. The agents' hardware and GPU readings, the task
profiles (the model's shapes as `python -m trainer.profile` measured them on shapes:widecnn, the
speeds scaled to each GPU model's FP32 TFLOPs), the link figures and every metric value (a loss
curve, throughput from a step-time model, byte counts from the top-k densities) are made up
here, plausible but not measured. The control plane stamps lifecycle times with its clock, and
the runs here are lived in seconds: once seeded, those timestamps are moved onto the story's
clock (the runs ended within the last hour, the live one started minutes ago): the one edit
the script makes to the database directly.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the repository's packages, whatever the cwd

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
VIEWPORT = {"width": 1440, "height": 900}
DEFAULT_OUT = ROOT / "docs" / "screenshots"
# The temporary control plane's secret: any but the example value (which warns at every start).
SECRET_KEY = "screenshots-" + "0123456789abcdef" * 3
TASK = "hybridtrain.tasks.shapes:widecnn"
TASK_ARGS = {"lr": 0.05}
RANDOM = random.Random(20261207)

# What `python -m trainer.profile --task hybridtrain.tasks.shapes:widecnn --batch 64` printed
# (the model's structure and data sizes); the speeds are set per GPU model below.
PROFILE = {
    "params": 3356362, "dense_params": 2698, "buffer_numel": 2688,
    "matrix_shapes": [[192, 27], [384, 1728], [768, 3456], [10, 3072]],
    "train_samples": 8000, "eval_samples": 2000, "batch": 64,
    "worker_compress_s_per_kept": 5.3e-08, "server_compress_s_per_kept": 0.0, "aggregate_s_per_kept": 0.0,
    "worker_compress_density": 0.01, "server_compress_k_fraction": 0.03125,
    "dense_aggregate_s_per_element": 1.2e-09, "dense_encode_s_per_element": 7.6e-11, "powersgd_rank": 2,
    "metrics": {"accuracy": True, "val_loss": False},
}
# widecnn's samples/s on a T4 at batch 64 (made up; the other GPUs scale by FP32 TFLOPs).
T4_SAMPLES_PER_S = 1250.0
TFLOPS = {"T4": 8.1, "A100 40GB": 19.5, "V100 PCIe": 14.0, "RTX 8000": 16.3}


# How long a call is retried while the control plane is unavailable (5xx, no answer).
RETRY_S = 300.0
_STARTED = time.monotonic()


def say(text: str) -> None:
    """One line of progress, with the seconds since the start."""
    print(f"screenshots: {time.monotonic() - _STARTED:5.1f} s  {text}", flush=True)


class ScreenshotError(Exception):
    """A step failed; the message says which and why."""


# -- the control plane ----------------------------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ControlPlane:
    url: str
    admin_token: str
    database_url: str
    broker_url: str
    workdir: Path


@contextlib.contextmanager
def control_plane(workdir: Path) -> Iterator[ControlPlane]:
    """`hybridtrain server` on a fresh SQLite database in `workdir`, with an admin token made by
    `hybridtrain tokens create`; stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database_url = f"sqlite+pysqlite:///{workdir}/hybridtrain.db"
    broker_url = f"sqla+sqlite:///{workdir}/broker.db"
    # The caller's own settings (a DATABASE_URL, a real secret) must not reach this one.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HYBRIDTRAIN_") and k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env |= {
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": broker_url,
        "HYBRIDTRAIN_SECRET_KEY": SECRET_KEY,
        "HYBRIDTRAIN_PUBLIC_URL": url,
        "HYBRIDTRAIN_DATASET_DIR": str(workdir / "datasets"),
        "HYBRIDTRAIN_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "HYBRIDTRAIN_BUNDLE_DIR": str(workdir / "bundles"),
        # The agents here are threads of one script on a machine that may be busy: a load spike
        # must not take their nodes offline halfway through a run's story.
        "HYBRIDTRAIN_HEARTBEAT_TIMEOUT_S": "600",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    }
    cli = [sys.executable, "-m", "app.cli"]

    def run(*args: str) -> str:
        done = subprocess.run([*cli, *args], env=env, cwd=workdir, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise ScreenshotError(f"`hybridtrain {' '.join(args)}` failed:\n{done.stderr[-2000:]}")
        return done.stdout

    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        # `hybridtrain server` applies the migrations before it serves.
        server = subprocess.Popen(
            [*cli, "server", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log"],
            env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(url, server, log_path)
        admin_token = run("tokens", "create", "--name", "admin", "--scope", "admin").strip()
        yield ControlPlane(url, admin_token, database_url, broker_url, workdir)
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_healthy(url: str, server: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 180  # a busy machine takes its time to import and migrate
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise ScreenshotError(f"the control plane exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    log = log_path.read_text(errors="replace")[-3000:]
    raise ScreenshotError(f"the control plane did not answer /healthz in 180 s:\n{log}")


class Api:
    """The admin's calls to /api/v1; any error status stops the script with the answer."""

    def __init__(self, url: str, token: str) -> None:
        from app.cli.client import HybridtrainClient

        self.http = httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {token}"},
                                 timeout=RETRY_S)
        # The command-line client, for what it uploads (bundles, data sets).
        self.client = HybridtrainClient(url, token)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise ScreenshotError(f"{method} /api/v1{path}: {response.status_code} {response.text[:2000]}")
        return response.json() if response.content else None

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.call("GET", path, **kwargs)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> Any:
        return self.call("POST", path, json=body, **kwargs)


# -- the story's clock ----------------------------------------------------------------------------


class StoryClock:
    """The story's time against the control plane's clock.

    The runs here live in seconds, but a page shows the control plane's own timestamps of them
    (launched, started, events, checkpoints). Before each lifecycle step the script says where
    in the story it is (`at`); `warp` later moves every timestamp stamped after that mark onto the
    story's clock, keeping the little real time that passed since the mark.
    """

    def __init__(self, origin: float) -> None:
        self.origin = origin  # the story's second 0, unix time
        self.marks: list[tuple[float, float]] = []

    def t(self, story_s: float) -> float:
        """Unix time of a story second (what a trainer stamps its records with)."""
        return self.origin + story_s

    def at(self, story_s: float) -> None:
        """What the control plane stamps from now on happened at this story second."""
        self.marks.append((time.time(), self.t(story_s)))

    def story(self, stamped: datetime) -> datetime:
        """A control-plane timestamp moved onto the story's clock (untouched before the first mark)."""
        real = stamped.timestamp()
        mark = None
        for real_at, story_at in self.marks:
            if real_at <= real:
                mark = (real_at, story_at)
        if mark is None:
            return stamped
        return datetime.fromtimestamp(mark[1] + (real - mark[0]), UTC)

    def warp(self, database_url: str) -> int:
        """Move the lifecycle timestamps of every run onto the story's clock; rows changed."""
        from sqlalchemy import create_engine, inspect, select
        from sqlalchemy.orm import Session

        from app.models import Run, RunEvent, RunWorker
        from app.models.base import UTCDateTime
        from app.models.checkpoints import RunCheckpoint
        from app.models.events import EventSource

        first = self.marks[0][0]
        engine = create_engine(database_url, connect_args={"timeout": 30})
        changed = 0
        with Session(engine) as session:
            for model in (Run, RunWorker, RunEvent, RunCheckpoint):
                stamps = [c.key for c in inspect(model).column_attrs if isinstance(c.columns[0].type, UTCDateTime)]
                rows = session.scalars(select(model)).all()
                for row in rows:
                    if isinstance(row, RunEvent) and row.source == EventSource.trainer:
                        continue  # the trainer's records carry story time already
                    for key in stamps:
                        value = getattr(row, key)
                        if value is not None and value.timestamp() >= first:
                            setattr(row, key, self.story(value))
                            changed += 1
            session.commit()
        engine.dispose()
        return changed


# -- node agents ----------------------------------------------------------------------------------


class Broker:
    """Reads a node's orders from its queue on the embedded broker, as its agent's Celery
    worker would (Celery's JSON messages: the task's name in the headers, its arguments in the body)."""

    def __init__(self, url: str) -> None:
        from agents.celery_app import make_celery, prepare_embedded_broker

        prepare_embedded_broker(url)
        self.celery = make_celery(url)
        self.lock = threading.Lock()

    def take(self, node_id: int, *, count: int,
             timeout_s: float = 20.0) -> list[tuple[str, list[Any], dict[str, Any]]]:
        """The next `count` orders on the node's queue (task name, args, kwargs), acknowledged."""
        from queue import Empty

        from app.dispatch import node_queue

        orders: list[tuple[str, list[Any], dict[str, Any]]] = []
        deadline = time.monotonic() + timeout_s
        with self.lock, self.celery.connection_for_read() as connection:
            queue = connection.SimpleQueue(node_queue(node_id))
            try:
                while len(orders) < count:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ScreenshotError(
                            f"node {node_id} got {len(orders)} of {count} orders in {timeout_s:.0f} s")
                    try:
                        message = queue.get(block=True, timeout=min(left, 1.0))
                    except Empty:
                        continue
                    args, kwargs, _embed = message.decode()
                    orders.append((message.headers["task"], args, kwargs))
                    message.ack()
            finally:
                queue.close()
        return orders


@dataclass
class NodeSpec:
    site: str
    name: str
    gpus: list[tuple[str, int]]
    address: str
    instance_type: str | None = None
    spot: bool = False
    amortised_usd_per_h: float = 0.0
    cpu_cores: int = 8
    memory_gb: float = 30.0


@dataclass
class Role:
    run_id: int
    rank: int
    role: str
    attempt: int
    pid: int


class Agent:
    """A node's agent as the control plane sees it: registered with the node's join token,
    heartbeating its roles and GPU readings, reporting their starts and exits."""

    def __init__(self, url: str, spec: NodeSpec, node_id: int, join_token: str) -> None:
        from agents.state import new_agent_token
        from agents.client import ControlPlaneClient
        from agents.hardware import GpuDevice, Hardware

        self.spec = spec
        self.node_id = node_id
        # A busy machine may keep the control plane's SQLite locked for a while: the agents here
        # wait longer than a real one and retry what the control plane could not answer, as
        # the real one does (every call below is idempotent: starts, exits, logs by their seq).
        self.client = ControlPlaneClient(url, timeout_s=120)
        devices = [GpuDevice(index=i, name=f"NVIDIA {model}", model=model, memory_gb=_gpu_memory(model))
                   for model, count in spec.gpus for i in range(count)]
        self.hardware = Hardware(
            hostname=spec.name, cpu_cores=spec.cpu_cores, cpu_physical_cores=spec.cpu_cores // 2,
            memory_gb=spec.memory_gb, gpus=devices, gpu_source="nvml" if devices else "none",
            platform="Linux-6.1.0-27-amd64-x86_64-with-glibc2.36", python="3.11.2", torch="2.5.1",
            cuda="12.4" if devices else None, address=spec.address,
            benchmark=_benchmark(spec),
        )
        token = new_agent_token()
        self.call(self.client.register, join_token=join_token, agent_token=token, hardware=self.hardware.to_json())
        self.client.set_agent_token(token)
        self.roles: dict[tuple[int, int], Role] = {}
        self.lock = threading.Lock()
        self.pids = itertools.count(41_000 + 1_000 * (node_id % 20))

    def beat(self) -> None:
        """One heartbeat: the roles it runs and what its GPUs are doing."""
        with self.lock:
            roles = [{"run_id": r.run_id, "rank": r.rank, "role": r.role, "pid": r.pid, "state": "running",
                      "attempt": r.attempt} for r in self.roles.values()]
        busy = any(r["role"] == "worker" for r in roles)
        gpus = [{"index": g.index, "name": g.name, "utilization": (0.87 + 0.02 * g.index) if busy else 0.0,
                 "memory_used_bytes": int((9.6 if busy else 0.4) * 2**30),
                 "memory_total_bytes": int(g.memory_gb * 2**30)} for g in self.hardware.gpus]
        self.call(self.client.heartbeat, {"roles": roles, "gpus": gpus})

    def started(self, order: dict[str, Any], *, port: int | None = None) -> str:
        """Start the role of a launch order's spec; the run's status after."""
        role = Role(order["run_id"], order["rank"], order["role"], order["attempt"], next(self.pids))
        with self.lock:
            self.roles[(role.run_id, role.rank)] = role
        body = {"rank": role.rank, "role": role.role, "event": "started", "pid": role.pid, "attempt": role.attempt}
        if port is not None:
            body["port"] = port
        return str(self.call(self.client.role_event, role.run_id, body)["run_status"])

    def exited(self, run_id: int, rank: int, *, exit_code: int | None = 0, signal: int | None = None,
               reason: str | None = None, cause: str | None = None, cancelled: bool = False,
               tail: list[str] | None = None) -> str:
        """Its role of `run_id`'s `rank` ended so; the run's status after."""
        # Under the lock: a heartbeat that no longer lists a role whose exit is not reported
        # yet would have the control plane count the rank as lost.
        with self.lock:
            role = self.roles.pop((run_id, rank))
            body: dict[str, Any] = {"rank": rank, "role": role.role, "event": "exited", "pid": role.pid,
                                    "attempt": role.attempt, "exit_code": exit_code, "signal": signal,
                                    "cancelled": cancelled, "tail": tail or []}
            if reason:
                body["reason"] = reason
            if cause:
                body["cause"] = cause
            return str(self.call(self.client.role_event, run_id, body)["run_status"])

    def cancelled(self, run_id: int, *, before_attempt: int | None) -> None:
        """A cancel order: its roles of the run (of attempts before `before_attempt`) stop."""
        from hybridtrain.contract import CAUSE_CANCEL

        for (run, rank), role in sorted(self.roles.items()):
            if run == run_id and (before_attempt is None or role.attempt < before_attempt):
                self.exited(run, rank, exit_code=None, signal=15, cancelled=True, cause=CAUSE_CANCEL)

    def logs(self, run_id: int, rank: int, lines: list[tuple[float, str]]) -> None:
        """Ship a role's output lines (unix time, text)."""
        self.call(self.client.logs, run_id, {"rank": rank, "lines": [{"seq": i, "t": t, "line": text}
                                                                     for i, (t, text) in enumerate(lines)]})

    @staticmethod
    def call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` with the agent's retries of an unavailable control plane (`call_with_retry`)."""
        from agents.client import call_with_retry

        return call_with_retry(fn, *args, deadline_s=RETRY_S, **kwargs)


def _benchmark(spec: NodeSpec) -> dict[str, Any]:
    """The agent's reference benchmark (`hybridtrain agent --benchmark-seconds`) as this node's
    GPU would score it (made up; scaled by FP32 TFLOPs)."""
    from agents.hardware import REFERENCE_BATCH, REFERENCE_MODEL

    gpu = spec.gpus[0][0] if spec.gpus else None
    rate = 2900.0 * TFLOPS[gpu] / TFLOPS["T4"] if gpu else 310.0
    steps = int(rate * 10 / REFERENCE_BATCH)
    return {"model": REFERENCE_MODEL, "batch": REFERENCE_BATCH, "device": "cuda:0" if gpu else "cpu",
            "threads": spec.cpu_cores, "steps": steps, "seconds": 10.0,
            "samples_per_s": round(steps * REFERENCE_BATCH / 10.0, 2)}


def _gpu_memory(model: str) -> float:
    return {"T4": 15.0, "A100 40GB": 39.4, "V100 PCIe": 15.8, "RTX 8000": 47.5}.get(model, 16.0)


# How often the agents beat (the control plane asks for its timeout / 6; they beat more often).
HEARTBEAT_S = 10.0


class Fleet:
    """The agents of every joined node, heartbeating from a thread until closed."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.broker = Broker(cp.broker_url)
        self.agents: dict[str, Agent] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeats", daemon=True)

    def join(self, spec: NodeSpec, node_id: int, join_token: str) -> Agent:
        agent = Agent(self.cp.url, spec, node_id, join_token)
        agent.beat()
        self.agents[spec.name] = agent
        return agent

    def start(self) -> None:
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            for agent in list(self.agents.values()):
                try:
                    agent.beat()
                except Exception as exc:  # noqa: BLE001 - a missed beat is retried at the next
                    say(f"heartbeat of {agent.spec.name} failed: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def launches(self, agent: Agent, count: int = 1) -> list[dict[str, Any]]:
        """The specs of the next `count` launch orders on the agent's queue; a cancel order met
        on the way stops the roles it names (reported as cancelled), as the agent would."""
        from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE

        specs: list[dict[str, Any]] = []
        while len(specs) < count:
            for task, args, kwargs in self.broker.take(agent.node_id, count=1):
                if task == LAUNCH_ROLE:
                    specs.append(args[2])
                elif task == CANCEL_RUN:
                    agent.cancelled(args[0], before_attempt=kwargs.get("before_attempt"))
        return specs

    def cancels(self, agent: Agent) -> None:
        """Take the agent's next order, a cancel, and stop the roles it names."""
        from agents.celery_app import CANCEL_RUN

        [(task, args, kwargs)] = self.broker.take(agent.node_id, count=1)
        if task != CANCEL_RUN:
            raise ScreenshotError(f"{agent.spec.name} expected a cancel order, got {task}")
        agent.cancelled(args[0], before_attempt=kwargs.get("before_attempt"))

    def orders(self, agent: Agent, task: str, count: int) -> list[list[Any]]:
        """The args of the next `count` orders of `task` on the agent's queue (others skipped)."""
        found: list[list[Any]] = []
        while len(found) < count:
            for name, args, _ in self.broker.take(agent.node_id, count=1):
                if name == task:
                    found.append(args)
        return found


# -- a rank's reports -----------------------------------------------------------------------------


class Reports:
    """One rank's records, in the trainer's report format (`trainer.metrics`: each in its
    process's stream, numbered), posted to the run's metrics route with the rank's token."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from trainer.metrics import new_stream_id

        self.url = spec["report_url"]
        self.token = spec["report_token"]
        self.rank = spec["rank"]
        self.role = spec["role"]
        self.checkpoint_url = spec.get("checkpoint_url")
        self.stream = new_stream_id()
        self.seq = itertools.count()
        self.records: list[dict[str, Any]] = []

    def log(self, step: int, t: float, name: str, value: float, peer: int | None = None) -> None:
        record = {"rank": self.rank, "role": self.role, "step": step, "t": round(t, 6), "name": name,
                  "value": float(value)}
        if peer is not None:
            record["peer"] = peer
        self._add(record)

    def event(self, step: int, t: float, kind: str, *, subject: int | None = None, detail: str = "") -> None:
        self._add({"rank": self.rank, "role": self.role, "step": step, "t": round(t, 6), "event": kind,
                   "subject": subject, "detail": detail})

    def _add(self, record: dict[str, Any]) -> None:
        record["stream"] = self.stream
        record["seq"] = next(self.seq)
        self.records.append(record)

    def flush(self, http: Any) -> None:
        """POST what is queued, in the trainer's batches of 500."""
        for i in range(0, len(self.records), 500):
            body = {"records": self.records[i:i + 500]}
            retrying(lambda: http.post(self.url, json=body, headers={"Authorization": f"Bearer {self.token}"}),
                     f"rank {self.rank}'s report")
        self.records.clear()

    def checkpoint(self, step: int, size: int) -> None:
        """Upload a checkpoint of `step` (filler bytes of a plausible size) as the server does."""
        from trainer.checkpoint_store import SHA_HEADER

        data = _filler(size, seed=step)
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/octet-stream",
                   SHA_HEADER: hashlib.sha256(data).hexdigest()}
        retrying(lambda: httpx.put(self.checkpoint_url, params={"step": step}, content=data, headers=headers,
                                   timeout=RETRY_S), f"the checkpoint of step {step}")


def retrying(send: Any, what: str) -> Any:
    """`send()`'s response, retried as the trainer's reporter and uploader retry (no answer, 5xx,
    408, 429; what they send is stored once however often it arrives); any other error stops."""
    deadline, delay = time.monotonic() + RETRY_S, 0.5
    while True:
        try:
            response = send()
        except httpx.TransportError as exc:
            response, failure = None, repr(exc)
        else:
            if response.status_code < 400:
                return response
            failure = f"{response.status_code} {response.text[:500]}"
        transient = response is None or response.status_code >= 500 or response.status_code in (408, 429)
        if not transient or time.monotonic() + delay > deadline:
            raise ScreenshotError(f"{what}: {failure}")
        time.sleep(delay)
        delay = min(2 * delay, 10.0)


def _filler(size: int, *, seed: int) -> bytes:
    block = hashlib.sha256(f"checkpoint-{seed}".encode()).digest() * 2048
    return (block * (size // len(block) + 1))[:size]


# -- the inventory --------------------------------------------------------------------------------

SITES = [
    {"name": "zurich-lab", "kind": "onprem", "provider": "onprem", "continent": "europe"},
    {"name": "gcp-us-west1", "kind": "cloud", "provider": "gcp", "region": "us-west", "zone": "us-west1-b",
     "continent": "north_america"},
    {"name": "aws-us-west-2", "kind": "cloud", "provider": "aws", "region": "us-west", "zone": "us-west-2a",
     "continent": "north_america"},
]
NODES = [
    NodeSpec("zurich-lab", "zrh-server", [], "10.20.0.2", amortised_usd_per_h=0.12, cpu_cores=32, memory_gb=125.7),
    NodeSpec("zurich-lab", "zrh-a100", [("A100 40GB", 1)], "10.20.0.11", amortised_usd_per_h=1.10, cpu_cores=16,
             memory_gb=62.8),
    NodeSpec("gcp-us-west1", "gcp-t4-1", [("T4", 1)], "10.138.0.5", instance_type="n1-standard-8"),
    NodeSpec("gcp-us-west1", "gcp-t4-2", [("T4", 1)], "10.138.0.6", instance_type="n1-standard-8"),
    NodeSpec("gcp-us-west1", "gcp-t4-3", [("T4", 1)], "10.138.0.7", instance_type="n1-standard-8", spot=True),
    NodeSpec("aws-us-west-2", "aws-t4-1", [("T4", 1)], "172.31.8.20", instance_type="g4dn.2xlarge"),
]
# Declared through the Nodes page's form while the screenshots are taken; its agent never runs.
FORM_NODE = NodeSpec("zurich-lab", "zrh-rtx8000", [("RTX 8000", 1)], "10.20.0.14", amortised_usd_per_h=0.38)
# Site to site: Mbit/s and round trip, as an admin declares them (POST /site-links).
SITE_LINKS = [("zurich-lab", "gcp-us-west1", 180.0, 148.0), ("zurich-lab", "aws-us-west-2", 160.0, 152.0),
              ("gcp-us-west1", "aws-us-west-2", 900.0, 21.0)]


@dataclass
class Inventory:
    sites: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, int] = field(default_factory=dict)
    bundle: str = ""
    dataset: str = ""


def seed_inventory(api: Api, fleet: Fleet, workdir: Path) -> Inventory:
    """Sites, nodes (each joined by its agent), site links, a cluster, tokens, a scheduled price,
    a code bundle and a data set, through the API."""
    inv = Inventory()
    for site in SITES:
        inv.sites[site["name"]] = api.post("/sites", site)["id"]
    for spec in NODES:
        created = api.post("/nodes", {
            "site_id": inv.sites[spec.site], "name": spec.name, "address": spec.address,
            "gpus": [{"model": m, "count": n} for m, n in spec.gpus], "instance_type": spec.instance_type,
            "spot": spec.spot, "amortised_usd_per_h": spec.amortised_usd_per_h,
        })
        inv.nodes[spec.name] = created["id"]
        fleet.join(spec, created["id"], created["join_token"])
    fleet.start()
    for src, dst, mbps, rtt in SITE_LINKS:
        for a, b in ((src, dst), (dst, src)):
            api.post("/site-links", {"src_site_id": inv.sites[a], "dst_site_id": inv.sites[b],
                                     "mbps": mbps, "rtt_ms": rtt})
    api.post("/clusters", {"name": "zurich+gcp", "description": "the lab's A100 with the GCP T4s",
                           "node_ids": [inv.nodes[n] for n in ("zrh-a100", "gcp-t4-1", "gcp-t4-2", "gcp-t4-3")]})
    for name, scope, days, actions in (("nightly-ci", "ci", 90, ["runs:create", "runs:cancel", "bundles:write"]),
                                       ("grafana", "read", None, None), ("ops-laptop", "admin", 30, None)):
        api.post("/tokens", {"name": name, "scope": scope, "expires_in_days": days, "actions": actions})
    # A price change an admin scheduled for the first of next month (the Prices page lists it).
    gcp_t4 = next(p for p in api.get("/prices/instances", params={"limit": 200})["data"]
                  if p["provider"] == "gcp" and p["instance_type"] == "n1-standard-8")
    this_month = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    first = (this_month + timedelta(days=32)).replace(day=1)
    api.call("PATCH", f"/prices/instances/{gcp_t4['id']}", json={
        "spot_usd_per_h": 0.165, "effective_from": first.isoformat(), "source": "GCP price list, next month"})
    inv.bundle = _upload_bundle(api)
    inv.dataset = _upload_dataset(api, workdir)
    return inv


def _upload_bundle(api: Api) -> str:
    """examples/charlm packed and uploaded as `runs create --workdir` does."""
    from hybridtrain.packing import pack_workdir

    packed = pack_workdir(ROOT / "examples" / "charlm")
    api.client.upload_bundle(packed.data, packed.sha256)
    return packed.sha256


def _upload_dataset(api: Api, workdir: Path) -> str:
    """1,024 of the built-in procedural shapes, sharded with `hybridtrain.datasets` and put in the
    control plane's store as `hybridtrain datasets upload` does."""
    import torch

    from hybridtrain.data_access import INDEX_FILE, STORE_URL
    from hybridtrain.datasets import write_dataset
    from hybridtrain.tasks.datasets import make_shapes

    name = "shapes-32px"
    folder = workdir / name
    images, labels = make_shapes(1024, seed=7)
    samples = ((torch.from_numpy(image), int(label)) for image, label in zip(images, labels))
    index = write_dataset(samples, folder, shard_bytes=4 << 20)
    for shard in index.shards:
        api.client.upload_dataset_file(name, folder / shard.name)
    # The index last: the control plane checks that every shard it names is there, whole.
    api.client.upload_dataset_file(name, folder / INDEX_FILE)
    api.client.register_dataset({"name": name, "url": STORE_URL})
    return name


def seed_profiles(api: Api, fleet: Fleet, inv: Inventory) -> None:
    """The task profiled on every node: ordered through the API, each agent answering its order."""
    from hybridtrain.contract import PROFILE_TASK

    created = api.post("/tasks/profiles", {"task": TASK, "task_args": TASK_ARGS, "batch_size": 64,
                                           "node_ids": [inv.nodes[s.name] for s in NODES]})
    by_node = {a.node_id: a for a in fleet.agents.values()}
    for profile in created:
        agent = by_node[profile["node_id"]]
        [args] = fleet.orders(agent, PROFILE_TASK, 1)
        agent.call(agent.client.profile_result, args[0], {"status": "done", "result": _profile_of(agent.spec)})


def _profile_of(spec: NodeSpec) -> dict[str, Any]:
    """PROFILE with the speeds of the node's GPU (its CPU for a node without one)."""
    if spec.gpus:
        scale = TFLOPS[spec.gpus[0][0]] / TFLOPS["T4"]
        samples_per_s = T4_SAMPLES_PER_S * scale * RANDOM.uniform(0.97, 1.03)
        compress = 0.0042 / scale
    else:
        samples_per_s, compress = 38.0, 0.021
    return PROFILE | {
        "samples_per_s": samples_per_s, "step_s": 64 / samples_per_s,
        "worker_compress_s": compress, "server_compress_s": compress * 1.3, "aggregate_s": compress * 0.8,
        "aggregate_fixed_s": compress * 0.1, "powersgd_s": compress * 1.1,
        "spread": 0.02, "repeats": 3,
    }


# -- training, as the control plane hears of it ---------------------------------------------------


def loss_at(step: float, *, pace: float = 1.0) -> float:
    """The made-up training loss after `step` steps (`pace` < 1 learns slower per step)."""
    return 0.14 + 2.16 * math.exp(-step * pace / 260)


def accuracy_at(step: float, *, pace: float = 1.0) -> float:
    """The made-up held-out accuracy after `step` steps."""
    return 0.953 - 0.86 * math.exp(-step * pace / 230)


def jitter(spread: float = 0.04) -> float:
    return 1.0 + RANDOM.uniform(-spread, spread)


@dataclass
class Member:
    """A worker rank of a run: its node's agent, launch order and reports."""

    agent: Agent
    spec: dict[str, Any]
    reports: Reports
    speed: float  # samples/s of its GPU on the task
    batch: int = 0

    @property
    def rank(self) -> int:
        return int(self.spec["rank"])


def member(agent: Agent, spec: dict[str, Any], speed_scale: float = 1.0) -> Member:
    gpu = agent.spec.gpus[0][0]
    return Member(agent, spec, Reports(spec), T4_SAMPLES_PER_S * TFLOPS[gpu] / TFLOPS["T4"] * speed_scale)


class Training:
    """The steps of one run as its ranks report them: per-step figures from a step-time model
    (the slowest worker's compute on its batch share, then the exchange)."""

    def __init__(self, clock: StoryClock, *, t: float, global_batch: int, comm_s: float, server: Reports | None,
                 members: list[Member], push_bytes: int, reply_bytes: int, pace: float = 1.0,
                 density: float | None = None, proportional: bool = True, eval_every: int = 100,
                 eval_names: tuple[str, str] = ("accuracy", "val_loss"), target: str | None = None,
                 sync_every: int | None = None, server_site: str | None = None,
                 run_start: float | None = None, max_steps: int = 0) -> None:
        self.clock = clock
        self.max_steps = max_steps
        # The server's progress lines at each evaluation (story second, text), as it prints them.
        self.lines: list[tuple[float, str]] = []
        self.server_site = server_site
        self.run_start = t if run_start is None else run_start
        self.t = t  # story seconds
        self.global_batch = global_batch
        self.comm_s = comm_s
        self.server = server
        self.members = members
        self.push_bytes = push_bytes
        self.reply_bytes = reply_bytes
        self.pace = pace
        self.density = density
        self.proportional = proportional
        self.eval_every = eval_every
        self.eval_names = eval_names
        from hybridtrain.contract import parse_target

        self.target = parse_target(target) if target else None
        self.sync_every = sync_every
        self.reached = False
        self.resplit()

    def resplit(self) -> None:
        """The global batch over the members: by speed (ps-bz-gc) or equally."""
        from hybridtrain.contract import equal_batch_sizes, proportional_batch_sizes

        speeds = [m.speed for m in self.members]
        sizes = (proportional_batch_sizes(self.global_batch, speeds) if self.proportional
                 else equal_batch_sizes(self.global_batch, len(speeds)))
        for m, size in zip(self.members, sizes):
            m.batch = size

    def steps(self, first: int, last: int) -> None:
        """Steps first..last (inclusive; the trainer counts from 1), each rank's records as the
        trainer logs them."""
        for step in range(first, last + 1):
            computes = {m.rank: m.batch / m.speed * jitter(0.06) for m in self.members}
            outer = self.sync_every is None or step % self.sync_every == 0
            comm = self.comm_s * jitter(0.08) if outer else 0.0
            dt = max(computes.values()) + comm
            self.t += dt
            t = self.clock.t(self.t)
            loss = loss_at(step, pace=self.pace)
            for m in self.members:
                log = m.reports.log
                log(step, t, "loss", loss * (1 + 0.05 * math.sin(step / 5 + m.rank) + RANDOM.gauss(0, 0.015)))
                log(step, t, "batch_size", m.batch)
                log(step, t, "samples_per_s", m.batch / dt)
                log(step, t, "compute_s", computes[m.rank])
                if outer:
                    log(step, t, "comm_s", dt - computes[m.rank])
                    log(step, t, "bytes_sent", self.push_bytes * jitter(0.02), peer=0 if self.server else
                        (m.rank + 1) % len(self.members))
                if self.sync_every is not None and outer:
                    # Every worker logs the norm of the averaged change its outer step applied.
                    log(step, t, "outer_norm", 0.9 * math.exp(-step / 900) + 0.05)
                if self.density is not None:
                    # The adaptive rule gives a worker beside the server (a LAN) a higher density.
                    near = self.server_site is not None and m.agent.spec.site == self.server_site
                    wave = 1 + 0.1 * math.sin(step / 90 + m.rank)
                    log(step, t, "density", self.density * (1.8 if near else 0.8) * wave)
            if self.server is not None:
                log = self.server.log
                log(step, t, "loss", loss)
                log(step, t, "batch_size", self.global_batch)
                log(step, t, "samples_per_s", self.global_batch / dt)
                if outer:
                    log(step, t, "comm_s", comm)
                    for m in self.members:
                        log(step, t, "bytes_sent", self.reply_bytes * jitter(0.02), peer=m.rank)
            if step and step % self.eval_every == 0:
                self.evaluate(step)

    def evaluate(self, step: int) -> None:
        """The evaluation after `step`, reported by rank 0 (the server, or the first worker)."""
        eval_s = 0.8 * jitter()
        self.t += eval_s
        t = self.clock.t(self.t)
        reports = self.server or self.members[0].reports
        score_name, loss_name = self.eval_names
        score = accuracy_at(step, pace=self.pace) + RANDOM.gauss(0, 0.004)
        val_loss = loss_at(step, pace=self.pace) * 1.12 + 0.03
        values = {score_name: score, loss_name: val_loss}
        for name, value in values.items():
            reports.log(step, t, name, value)
        reports.log(step, t, "eval_s", eval_s)
        target = self.target
        if target is not None and not self.reached and target.reached(values.get(target.metric, math.nan)):
            self.reached = True
            reports.log(step, t, "time_to_target_s", self.t - self.run_start)
        shown = "".join(f" {name} {value:.4f}" for name, value in values.items())
        loss = loss_at(step, pace=self.pace)
        self.lines.append((self.t, f"[ps] step {step}/{self.max_steps} loss {loss:.4f}{shown} "
                                   f"elapsed {self.t - self.run_start:.1f}s"))

    def flush(self, http: Any) -> None:
        for reports in [*([self.server] if self.server else []), *(m.reports for m in self.members)]:
            reports.flush(http)


def bring_up(fleet: Fleet, clock: StoryClock, leader: Agent, followers: list[Agent], *, at: float,
             port: int = 29500) -> tuple[dict[str, Any], list[tuple[Agent, dict[str, Any]]]]:
    """An attempt's start: rank 0's order first, then (once it names its port) the others'."""
    [leader_spec] = fleet.launches(leader)
    clock.at(at + 6)
    leader.started(leader_spec, port=port)
    started = []
    for i, agent in enumerate(followers):
        [spec] = fleet.launches(agent)
        clock.at(at + 15 + 2 * i)
        agent.started(spec)
        started.append((agent, spec))
    return leader_spec, started


@dataclass
class Runs:
    failed: int = 0
    baseline: int = 0
    ps: int = 0
    recovery: int = 0
    live: int = 0
    queued: int = 0


# Top-k at 1 % of widecnn's 3.35 M parameters (value and index, 8 bytes each) plus its dense
# part; the server's reply at k_s; a dense exchange of the whole model for all-reduce.
PS_PUSH_BYTES = 279_000
PS_REPLY_BYTES = 100_000
# widecnn's learning pace per step here: ps-bz-gc reaches 0.9 after about 350 steps.
PACE = 1.9
DENSE_BYTES = 13_425_448


def seed_failed_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory) -> int:
    """A run whose task rejects its arguments: rank 0 exits with the error before training, so
    the control plane fails it at once instead of spending restarts."""
    clock.at(30)
    run = api.post("/runs", {"name": "widecnn-allreduce-typo",
                             "node_ids": [inv.nodes["gcp-t4-1"], inv.nodes["gcp-t4-2"]],
                             "strategy": "allreduce", "task": TASK, "task_args": {"learning_rate": 0.05},
                             "global_batch_size": 512, "max_steps": 400})
    leader = fleet.agents["gcp-t4-1"]
    [spec] = fleet.launches(leader)
    clock.at(36)
    leader.started(spec, port=29500)
    # The other rank's order waits for rank 0's port; rank 0 fails before that matters.
    error = "TypeError: image_task() got an unexpected keyword argument 'learning_rate'"
    clock.at(52)
    leader.exited(run["id"], 0, exit_code=1, tail=[
        "Traceback (most recent call last):",
        '  File "/home/ml/.hybridtrain/lib/python3.11/site-packages/trainer/taskloop.py", line 61, in load_task',
        "    task = factory(**task_args)", error])
    other = fleet.agents["gcp-t4-2"]
    fleet.launches(other)  # rank 1's order, sent once rank 0 named its port: the run ends first
    fleet.cancels(other)
    return int(run["id"])


def seed_baseline_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory) -> int:
    """widecnn over all-reduce on the lab's A100 and three GCP T4s, reading a data set: the
    baseline the compare page sets the parameter-server run against."""
    start = 4 * 60
    clock.at(start)
    names = ["zrh-a100", "gcp-t4-1", "gcp-t4-2", "gcp-t4-3"]
    run = api.post("/runs", {"name": "widecnn-allreduce", "node_ids": [inv.nodes[n] for n in names],
                             "strategy": "allreduce", "task": TASK, "task_args": TASK_ARGS, "global_batch_size": 1024,
                             "max_steps": 360, "target": "accuracy>=0.9", "stop_at_target": False,
                             "eval_every": 50, "datasets": [inv.dataset]})
    agents = [fleet.agents[n] for n in names]
    leader_spec, others = bring_up(fleet, clock, agents[0], agents[1:], at=start)
    members = [member(agents[0], leader_spec)] + [member(a, s) for a, s in others]
    training = Training(clock, t=start + 30, global_batch=1024, comm_s=1.71, server=None, members=members,
                        push_bytes=DENSE_BYTES, reply_bytes=0, pace=PACE * 1.25, proportional=False, eval_every=50,
                        target="accuracy>=0.9", max_steps=360)
    training.steps(1, 360)
    training.flush(api.http)
    clock.at(training.t + 3)
    for m in members:
        m.agent.exited(run["id"], m.rank)
    return int(run["id"])


def ps_training(clock: StoryClock, server: Reports, members: list[Member], *, t: float, run_start: float,
                max_steps: int) -> Training:
    """widecnn on ps-bz-gc with its server in Zurich: the step-time model of these runs."""
    return Training(clock, t=t, global_batch=1024, comm_s=0.30, server=server, members=members,
                    push_bytes=PS_PUSH_BYTES, reply_bytes=PS_REPLY_BYTES, density=0.01, pace=PACE,
                    eval_every=50, target="accuracy>=0.9", server_site="zurich-lab", run_start=run_start,
                    max_steps=max_steps)


def ps_checkpoint(clock: StoryClock, training: Training, server: Reports, step: int, *,
                  size: int = 26_912_493) -> None:
    """The server's checkpoint of `step`: its event, then its upload to the run's store."""
    from hybridtrain.contract import EVENT_CHECKPOINT

    server.event(step, clock.t(training.t), EVENT_CHECKPOINT,
                 detail=f"run-step-{step:08d}.pt, uploading to the run's store")
    clock.at(training.t + 1)
    server.checkpoint(step, size + step)


def end_ps_run(clock: StoryClock, run_id: int, server_agent: Agent, training: Training, *, start: float,
               shares: list[int], lines: list[tuple[float, str]]) -> int:
    """The end of a widecnn ps-bz-gc run started at `start`: the server's log (listening, its 4
    workers connected with these batch `shares`, `lines` in story seconds, every worker's BYE),
    then the server's exit and its last workers'; the run's id."""
    server_agent.logs(run_id, 0, [(clock.t(t), line) for t, line in (
        (start + 8, "[ps] listening on 0.0.0.0:29500 (TLS), waiting for 4 workers"),
        (start + 31, f"[ps] 4 workers connected; batch shares {shares}"),
        *lines,
        (training.t + 1, "[ps] every worker said BYE; done"),
    )])
    clock.at(training.t + 2)
    server_agent.exited(run_id, 0)
    for m in training.members:
        m.agent.exited(run_id, m.rank)
    return run_id


def seed_widecnn_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory, *, name: str, start: float,
                     steps: int, **options: Any) -> tuple[int, Agent, Reports, list[Member]]:
    """Creates a widecnn ps-bz-gc run (server and A100 in Zurich, three GCP T4s; `options` added to
    its body) at `start` and starts its first attempt: the run's id, the server's agent and reports,
    and the workers."""
    clock.at(start)
    names = ["zrh-a100", "gcp-t4-1", "gcp-t4-2", "gcp-t4-3"]
    run = api.post("/runs", {"name": name, "node_ids": [inv.nodes[n] for n in names],
                             "ps_node_id": inv.nodes["zrh-server"], "strategy": "ps-bz-gc", "task": TASK,
                             "task_args": TASK_ARGS, "global_batch_size": 1024, "max_steps": steps,
                             "target": "accuracy>=0.9", "stop_at_target": False, "eval_every": 50, **options})
    server_agent = fleet.agents["zrh-server"]
    server_spec, others = bring_up(fleet, clock, server_agent, [fleet.agents[n] for n in names], at=start)
    return int(run["id"]), server_agent, Reports(server_spec), [member(a, s) for a, s in others]


def seed_ps_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory) -> int:
    """widecnn on ps-bz-gc, server and A100 in Zurich with three GCP T4s, start to end without a
    fault: the run page, its prediction beside what it measured, and the comparison."""
    steps, every = 400, 200
    start = 19 * 60
    run_id, server_agent, server, members = seed_widecnn_run(api, fleet, clock, inv, name="widecnn-zurich-gcp",
                                                             start=start, steps=steps, checkpoint_every=every)
    training = ps_training(clock, server, members, t=start + 32, run_start=start + 32, max_steps=steps)
    training.steps(1, every)
    ps_checkpoint(clock, training, server, every)
    training.steps(every + 1, steps)
    ps_checkpoint(clock, training, server, steps)
    training.flush(api.http)
    return end_ps_run(clock, run_id, server_agent, training, start=start,
                      shares=[m.batch for m in training.members], lines=training.lines)


def seed_recovery_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory) -> int:
    """widecnn on ps-bz-gc (server and A100 in Zurich, three GCP T4s, one of them spot) that
    loses its spot worker, restarts from its checkpoint after its server is killed, takes in an
    AWS node while training and finishes: the run page's Recovery and Timeline panels."""
    from hybridtrain.contract import CAUSE_AGENT_STOPPING, EVENT_RESUMED, EVENT_WORKER_JOINED, EVENT_WORKER_LEFT

    steps, every = 600, 150
    spot_leaves, server_killed, node_added, joined = 190, 338, 420, 427
    start = 28 * 60
    run_id, server_agent, server, members = seed_widecnn_run(api, fleet, clock, inv, name="widecnn-spot-restart",
                                                             start=start, steps=steps, checkpoint_every=every,
                                                             max_restarts=3)

    def training_of(server: Reports, members: list[Member], t: float) -> Training:
        return ps_training(clock, server, members, t=t, run_start=start + 32, max_steps=steps)

    def checkpoint(training: Training, server: Reports, step: int) -> None:
        ps_checkpoint(clock, training, server, step)

    training = first = training_of(server, members, start + 32)
    shares = [m.batch for m in members]
    training.steps(1, every)
    checkpoint(training, server, every)
    training.steps(every + 1, spot_leaves)
    # A spot notice on gcp-t4-3: its worker leaves at a step boundary, the batch is split again.
    spot = next(m for m in members if m.agent.spec.name == "gcp-t4-3")
    training.members.remove(spot)
    training.resplit()
    server.event(spot_leaves, clock.t(training.t), EVENT_WORKER_LEFT, subject=spot.rank,
                 detail=f"left cleanly after step {spot_leaves}; its error-feedback residual (the part of its "
                        "gradient not sent yet) is gone; the batch is split over 3 workers")
    training.flush(api.http)
    spot.reports.flush(api.http)
    clock.at(training.t + 1)
    spot.agent.exited(run_id, spot.rank, exit_code=0, cause=CAUSE_AGENT_STOPPING,
                      reason=f"left the run after step {spot_leaves} (SIGTERM: a spot notice, 0.41 s after it); "
                             "the run goes on")
    training.steps(spot_leaves + 1, 2 * every)
    checkpoint(training, server, 2 * every)
    training.steps(2 * every + 1, server_killed)
    training.flush(api.http)
    # The server is killed (kill -9): the control plane restarts the run from its checkpoint.
    killed_at = training.t + 2
    clock.at(killed_at)
    server_agent.exited(run_id, 0, exit_code=None, signal=9, tail=[
        f"step {server_killed - 8}/{steps} loss 0.412 samples/s 2287",
        f"step {server_killed - 3}/{steps} loss 0.405 samples/s 2301"])
    [server_spec] = fleet.launches(server_agent)  # attempt 1, resuming
    clock.at(killed_at + 14)
    server_agent.started(server_spec, port=29500)
    resumed = []
    for i, m in enumerate(m for m in members if m is not spot):
        [spec] = fleet.launches(m.agent)  # attempt 0's cancel first, then attempt 1's launch
        clock.at(killed_at + 24 + i)
        m.agent.started(spec)
        resumed.append(member(m.agent, spec))
    server = Reports(server_spec)
    training = training_of(server, resumed, killed_at + 31)
    server.event(2 * every, clock.t(training.t), EVENT_RESUMED,
                 detail=f"from the checkpoint of step {2 * every}, with 3 workers; the workers' error-feedback "
                        "residuals start empty")
    training.steps(2 * every + 1, node_added)
    training.flush(api.http)
    # An AWS node added while it trains: its worker joins at a step boundary.
    clock.at(training.t + 1)
    api.post(f"/runs/{run_id}/nodes", {"node_ids": [inv.nodes["aws-t4-1"]]})
    aws = fleet.agents["aws-t4-1"]
    [spec] = fleet.launches(aws)
    training.steps(node_added + 1, joined - 2)
    clock.at(training.t)
    aws.started(spec)
    training.steps(joined - 1, joined)
    joined_at = training.t
    joiner = member(aws, spec)
    training.members.append(joiner)
    training.resplit()
    server.event(joined, clock.t(training.t), EVENT_WORKER_JOINED, subject=joiner.rank,
                 detail=f"admitted after step {joined} with the state of worker {resumed[0].rank}; from step "
                        f"{joined + 1} its share is {joiner.batch} of 1024")
    training.steps(joined + 1, 3 * every)
    checkpoint(training, server, 3 * every)
    training.steps(3 * every + 1, steps)
    checkpoint(training, server, steps)
    training.flush(api.http)
    return end_ps_run(clock, run_id, server_agent, training, start=start, shares=shares, lines=sorted((
        *first.lines,
        (killed_at + 15, f"[ps] resuming from run-step-{2 * every:08d}.pt (step {2 * every})"),
        (killed_at + 31, f"[ps] resumed from step {2 * every} with 3 workers"),
        (joined_at, f"[ps] worker {joiner.rank} joined after step {joined}; batch shares "
                    f"{[m.batch for m in training.members]}"),
        *training.lines,
    )))


# charlm's 0.29 M parameters (at context 128) as a dense fp32 exchange.
CHARLM_BYTES = 1_170_000
STORY_NOW = 60 * 60  # the story's second that the script's start is


def seed_live_run(api: Api, fleet: Fleet, clock: StoryClock, inv: Inventory) -> int:
    """The charlm example from its code bundle on DiLoCo (server in Zurich, two GCP T4s and an
    AWS T4), still training: it started three minutes before the story's now."""
    start = STORY_NOW - 180
    clock.at(start)
    names = ["zrh-server", "gcp-t4-1", "gcp-t4-2", "aws-t4-1"]
    run = api.post("/runs", {"name": "charlm-diloco", "node_ids": [inv.nodes[n] for n in names[1:]],
                             "ps_node_id": inv.nodes["zrh-server"], "strategy": "diloco", "task": "charlm:task",
                             "task_args": {"context": 128}, "bundle_sha256": inv.bundle,
                             "global_batch_size": 1536, "max_steps": 3000,
                             "local_sgd": {"sync_every": 20}, "target": "val_loss<=0.9", "eval_every": 100})
    server_agent = fleet.agents["zrh-server"]
    server_spec, others = bring_up(fleet, clock, server_agent, [fleet.agents[n] for n in names[1:]], at=start)
    members = [member(a, s, speed_scale=1.6) for a, s in others]
    training = Training(clock, t=start + 30, global_batch=1536, comm_s=0.42, server=Reports(server_spec),
                        members=members, push_bytes=CHARLM_BYTES, reply_bytes=CHARLM_BYTES, pace=1.4,
                        proportional=False, eval_every=100, eval_names=("char_accuracy", "val_loss"),
                        sync_every=20, max_steps=3000, target="val_loss<=0.9")
    server = training.server
    assert server is not None
    step = 1
    while training.t < STORY_NOW - 2:
        training.steps(step, step)
        if step % 100 == 0:
            ps_checkpoint(clock, training, server, step, size=3_514_871)
        step += 1
    training.flush(api.http)
    server_agent.logs(int(run["id"]), 0, [(clock.t(t), line) for t, line in (
        (start + 8, "[ps] listening on 0.0.0.0:29500 (TLS), waiting for 3 workers"),
        (start + 29, f"[ps] 3 workers connected; batch shares {[m.batch for m in members]}; "
                     "an outer step every 20 inner steps"),
        *training.lines,
    )])
    return int(run["id"])


def seed_queued_run(api: Api, clock: StoryClock, inv: Inventory) -> int:
    """A run that waits in the queue for a GPU the live run holds."""
    clock.at(STORY_NOW - 50)
    run = api.post("/runs", {"name": "resnet18-shapes", "node_ids": [inv.nodes["zrh-a100"], inv.nodes["gcp-t4-1"]],
                             "strategy": "allreduce", "task": "hybridtrain.tasks.shapes:resnet18",
                             "global_batch_size": 256, "max_steps": 2000, "target": "accuracy>=0.93"})
    return int(run["id"])


def seed(cp: ControlPlane, fleet: Fleet, clock: StoryClock) -> tuple[Inventory, Runs]:
    """Everything the pages show, through the API and the agents' and trainers' routes."""
    api = Api(cp.url, cp.admin_token)
    inv = seed_inventory(api, fleet, cp.workdir)
    say(f"inventory: {len(inv.sites)} sites, {len(inv.nodes)} nodes joined by their agents, tokens, "
        f"a bundle, data set {inv.dataset}")
    seed_profiles(api, fleet, inv)
    say("task profiles: every node answered its order")
    runs = Runs()
    runs.failed = seed_failed_run(api, fleet, clock, inv)
    runs.baseline = seed_baseline_run(api, fleet, clock, inv)
    say(f"run {runs.baseline}: all-reduce baseline, finished")
    runs.ps = seed_ps_run(api, fleet, clock, inv)
    say(f"run {runs.ps}: ps-bz-gc, finished")
    runs.recovery = seed_recovery_run(api, fleet, clock, inv)
    say(f"run {runs.recovery}: ps-bz-gc with a spot worker leaving, a restart and a node added, finished")
    runs.live = seed_live_run(api, fleet, clock, inv)
    runs.queued = seed_queued_run(api, clock, inv)
    say(f"run {runs.live}: DiLoCo, training; run {runs.queued}: queued behind it")
    for run_id, expected in ((runs.failed, "failed"), (runs.baseline, "succeeded"), (runs.ps, "succeeded"),
                             (runs.recovery, "succeeded"),
                             (runs.live, "running"), (runs.queued, "queued")):
        status = api.get(f"/runs/{run_id}")["status"]
        if status != expected:
            raise ScreenshotError(f"run {run_id} is {status}, not {expected}")
    say(f"story clock: {clock.warp(cp.database_url)} lifecycle timestamps moved onto it")
    return inv, runs


# -- the pictures ---------------------------------------------------------------------------------

# Every picture, in the order they are taken: the name and what it shows.
PICTURES = {
    "login": "the sign-in page",
    "overview": "the overview: sites, spend, runs in flight",
    "nodes": "the Nodes page after adding a node through its form (the agent's two lines)",
    "node": "a node's page",
    "prices": "instance and egress prices, with a scheduled version",
    "tokens": "the Tokens page",
    "runs": "the runs list and the queue",
    "launch": "the launch form with the plan preview",
    "launch-predictions": "the launch form's predictions for every strategy",
    "launch-suggest": "the launch form after Suggest",
    "run": "a finished ps-bz-gc run's page",
    "run-predicted": "its prediction beside what it measured",
    "run-recovery": "the Recovery panel of a run that lost a worker, restarted and took in a node",
    "run-timeline": "that run's Timeline panel",
    "run-live": "a run training, its charts updated live",
    "compare": "two runs compared",
}


class Camera:
    """A signed-in Chromium tab that saves pictures into `out`, failing on any page error."""

    def __init__(self, page: Any, out: Path, only: set[str] | None) -> None:
        self.page = page
        self.out = out
        self.only = only
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(str(exc)))

    def wants(self, name: str) -> bool:
        return self.only is None or name in self.only

    def charts(self, count: int) -> None:
        """Wait for `count` Plotly charts, then for their drawing to settle."""
        self.page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot').length >= {count}",
                                    timeout=30_000)
        self.page.wait_for_timeout(800)

    def shot(self, name: str, selector: str | None = None) -> None:
        """Save the whole page, or the element `selector`, as NAME.png."""
        if self.errors:
            raise ScreenshotError(f"JavaScript errors on the page before {name}.png: {self.errors}")
        path = self.out / f"{name}.png"
        if selector is None:
            self.page.evaluate("window.scrollTo(0, 0)")
            self.page.screenshot(path=str(path), full_page=True, animations="disabled")
        else:
            self.page.locator(selector).screenshot(path=str(path), animations="disabled")
        say(f"{path.name}: {PICTURES[name]}")


def capture(cp: ControlPlane, inv: Inventory, runs: Runs, out: Path, only: set[str] | None, *,
            chromium: Path = CHROMIUM) -> None:
    """Sign in through the login page and take every picture (or those in `only`)."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(base_url=cp.url, viewport=VIEWPORT, device_scale_factor=1,
                                          timezone_id="UTC", locale="en-GB", color_scheme="light")
            camera = Camera(context.new_page(), out, only)
            _take(camera, cp, inv, runs)
        finally:
            browser.close()


def _take(camera: Camera, cp: ControlPlane, inv: Inventory, runs: Runs) -> None:
    page = camera.page
    page.goto("/login?next=/")
    if camera.wants("login"):
        camera.shot("login")
    page.fill("#f-token", cp.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{cp.url}/")
    if camera.wants("overview"):
        camera.shot("overview")
    if camera.wants("nodes"):
        page.goto("/nodes")
        form = page.locator("#add-node form")
        form.locator("#f-site_id").select_option(label=FORM_NODE.site)
        form.locator("#f-name").fill(FORM_NODE.name)
        form.locator("#f-gpu_model_0").select_option(FORM_NODE.gpus[0][0])
        form.locator("#f-gpu_count_0").fill(str(FORM_NODE.gpus[0][1]))
        form.locator("#f-amortised_usd_per_h").fill(str(FORM_NODE.amortised_usd_per_h))
        form.locator("#f-address").fill(FORM_NODE.address)
        form.locator("button[type=submit]").click()
        page.wait_for_selector("#agent-command")
        camera.shot("nodes")
    if camera.wants("node"):
        page.goto(f"/nodes/{inv.nodes['zrh-a100']}")
        page.click("details summary")  # what its agent detected
        camera.shot("node")
    if camera.wants("prices"):
        page.goto("/prices")
        camera.shot("prices")
    if camera.wants("tokens"):
        page.goto("/tokens")
        camera.shot("tokens")
    if camera.wants("runs"):
        page.goto("/runs")
        camera.shot("runs")
    if camera.wants("launch"):
        _fill_launch(page, inv, ["zrh-a100", "gcp-t4-2", "gcp-t4-3"], name="smallcnn-first-try",
                     task="hybridtrain.tasks.digits:smallcnn")
        _planned(page)
        camera.shot("launch")
    if camera.wants("launch-predictions") or camera.wants("launch-suggest"):
        _fill_launch(page, inv, ["zrh-a100", "gcp-t4-2", "gcp-t4-3", "aws-t4-1"], name="widecnn-four-gpus", task=TASK)
        _planned(page)
        page.wait_for_selector("#prediction-table tbody tr")
        if camera.wants("launch-predictions"):
            camera.shot("launch-predictions")
        if camera.wants("launch-suggest"):
            page.select_option("#f-suggest_goal", "fastest")
            page.click("#suggest-button")
            page.wait_for_function("() => { const e = document.getElementById('suggest-explanation');"
                                   " return !e.hidden && e.textContent && e.textContent !== 'searching…'; }")
            _planned(page)
            page.wait_for_selector("#prediction-table tr.chosen")
            camera.shot("launch-suggest")
    if camera.wants("run") or camera.wants("run-predicted"):
        page.goto(f"/runs/{runs.ps}")
        camera.charts(6)
        if camera.wants("run"):
            camera.shot("run")
        if camera.wants("run-predicted"):
            camera.shot("run-predicted", "#predicted")
    if camera.wants("run-recovery") or camera.wants("run-timeline"):
        page.goto(f"/runs/{runs.recovery}")
        camera.charts(6)
        for name, selector in (("run-recovery", "#recovery"), ("run-timeline", "#timeline")):
            if camera.wants(name):
                camera.shot(name, selector)
    if camera.wants("run-live"):
        page.goto(f"/runs/{runs.live}")
        page.wait_for_selector('#live[data-state="open"]')
        camera.charts(6)
        camera.shot("run-live")
    if camera.wants("compare"):
        page.goto(f"/compare?runs={runs.ps},{runs.baseline}")
        camera.charts(4)
        camera.shot("compare")


def _planned(page: Any) -> None:
    """Wait for the launch form's preview of what is filled in now."""
    page.wait_for_function("() => document.getElementById('plan-state').textContent === 'what Launch will start'")
    page.wait_for_selector("#plan-table")


def _fill_launch(page: Any, inv: Inventory, nodes: list[str], *, name: str, task: str) -> None:
    page.goto("/runs/new")
    page.fill("#f-name", name)
    page.fill("#f-task", task)
    page.fill("#f-task_args", json.dumps(TASK_ARGS))
    page.select_option("#f-strategy", "ps-bz-gc")
    page.fill("#f-global_batch_size", "1024")
    page.fill("#f-max_steps", "1000")
    for name in nodes:
        page.check(f'input[name=node_ids][value="{inv.nodes[name]}"]')
    page.select_option("#f-ps_node_id", str(inv.nodes["zrh-server"]))


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"where the PNGs go (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--only", default=None, metavar="NAME,...",
                        help=f"take only these pictures, of: {', '.join(PICTURES)}")
    parser.add_argument("--chromium", type=Path, default=CHROMIUM, help=f"the browser (default {CHROMIUM}, Debian's)")
    args = parser.parse_args(argv)
    only = None if args.only is None else {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = sorted((only or set()) - set(PICTURES))
    if unknown:
        parser.error(f"--only: no picture named {', '.join(unknown)}; the names are {', '.join(PICTURES)}")
    if not args.chromium.is_file():
        print(f"screenshots: no Chromium at {args.chromium}; `make chromium` installs Debian's "
              "(Playwright never downloads a browser of its own here)", file=sys.stderr)
        return 2
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("screenshots: the playwright package is missing; `make install-dev` installs it", file=sys.stderr)
        return 2
    started = time.monotonic()
    # The story's now is the script's start, rounded down to the minute.
    origin = math.floor(time.time() / 60) * 60 - STORY_NOW
    try:
        with tempfile.TemporaryDirectory(prefix="hybridtrain-screenshots-") as tmp, control_plane(Path(tmp)) as cp:
            say(f"control plane at {cp.url} on {cp.database_url}")
            fleet = Fleet(cp)
            try:
                inv, runs = seed(cp, fleet, StoryClock(origin))
                capture(cp, inv, runs, args.out, only, chromium=args.chromium)
            finally:
                fleet.close()
    except ScreenshotError as exc:
        print(f"screenshots: {exc}", file=sys.stderr)
        return 1
    say(f"done in {time.monotonic() - started:.0f} s: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
