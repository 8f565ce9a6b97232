"""Runs with made-up metrics, stored through the real ingestion query: for the dashboard's
tests and for bench/dashboard.py (a finished 10,000-step, 4-worker run, or a live one)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from app.models import Node, NodeGpu, NodeStatus, Run, RunStatus, RunWorker, Site, WorkerStatus
from app.queries.gpu_models import gpu_models_by_name
from app.queries.metrics import store_metrics
from app.schemas.runs import MetricRecord
from app.security import hash_secret, new_secret

GRADIENT_BYTES = 2_000_000  # what one worker pushes per step, roughly a 0.5 M-parameter model


@dataclass(frozen=True)
class SeededRun:
    run_id: int
    worker_ranks: list[int]
    t0: float


def seed_sites_and_nodes(session: Session, *, workers: int) -> tuple[Node, list[Node]]:
    """An on-prem server node and `workers` T4 nodes in a GCP zone, all online."""
    tag = uuid.uuid4().hex[:6]
    onprem = Site(name=f"lab-{tag}", kind="onprem", provider="onprem", continent="europe")
    cloud = Site(name=f"gcp-{tag}", kind="cloud", provider="gcp", region="us-west", zone="us-west-b", continent="north_america")
    t4 = gpu_models_by_name(session, names=["T4"])["T4"]
    server = Node(site=onprem, name=f"server-{tag}", address="10.0.0.1", status=NodeStatus.online,
                  join_token_hash=hash_secret(new_secret("htj_")), amortised_usd_per_h=0.25)
    nodes = [
        Node(site=cloud, name=f"t4-{tag}-{i}", address=f"10.1.0.{i + 1}", instance_type="n1-standard-8",
             status=NodeStatus.online, join_token_hash=hash_secret(new_secret("htj_")),
             gpus=[NodeGpu(gpu_model=t4, count=1)])
        for i in range(workers)
    ]
    session.add_all([onprem, cloud, server, *nodes])
    session.flush()
    return server, nodes


def seed_run(
    session: Session, *, steps: int, workers: int, finished: bool = True, name: str = "seeded",
    metrics_steps: int | None = None,
) -> SeededRun:
    """A ps-bz-gc run of `workers` workers and a server; metrics for `metrics_steps` steps
    (default all), one record of each kind per worker and step, as the trainer sends them."""
    server, nodes = seed_sites_and_nodes(session, workers=workers)
    started = datetime.now(UTC) - timedelta(seconds=steps * 0.05 + 60)
    run = Run(
        name=name, status=RunStatus.succeeded if finished else RunStatus.running,
        strategy="ps-bz-gc", task="hybridtrain.tasks.digits:smallcnn", task_args={"lr": 0.1},
        global_batch_size=64 * workers, max_steps=steps, allocation="flops", target="accuracy>=0.9",
        compression={"density": 0.01},
        metrics_token_hash=hash_secret(new_secret("htr_")), created_by="seed",
        ps_node_id=server.id, master_addr=server.address, master_port=29500,
        launched_at=started, started_at=started,
        finished_at=started + timedelta(seconds=steps * 0.05) if finished else None,
        workers=[RunWorker(rank=0, role="ps", node_id=server.id, node_name=server.name,
                           status=WorkerStatus.succeeded if finished else WorkerStatus.running)]
        + [RunWorker(rank=i + 1, role="worker", node_id=n.id, node_name=n.name, batch_size=64, gpu_model="T4",
                     gpu_index=0, status=WorkerStatus.succeeded if finished else WorkerStatus.running)
           for i, n in enumerate(nodes)],
    )
    session.add(run)
    session.flush()
    t0 = started.timestamp()
    records = []
    for step in range(metrics_steps if metrics_steps is not None else steps):
        records.extend(step_records(step, t0 + 1 + step * 0.05, range(1, workers + 1)))
        if len(records) >= 9000:
            store_metrics(session, run_id=run.id, records=records)
            records = []
    if records:
        store_metrics(session, run_id=run.id, records=records)
    session.flush()
    return SeededRun(run.id, list(range(1, workers + 1)), t0)


def step_records(step: int, t: float, ranks, *, loss_scale: float = 1.0) -> list[MetricRecord]:  # type: ignore[no-untyped-def]
    """One step's reports from each worker rank (and the server's reply bytes)."""
    out = []
    for rank in ranks:
        loss = loss_scale * (0.2 + 2.1 * math.exp(-step / 800)) * (1 + 0.03 * math.sin(step / 7 + rank))
        for metric, value, peer in (
            ("loss", loss, None),
            ("samples_per_s", 900 + 40 * rank + 25 * math.sin(step / 50 + rank), None),
            ("batch_size", 64, None),
            ("density", 0.01 * (1 + 0.2 * math.sin(step / 300)), None),
            ("bytes_sent", GRADIENT_BYTES, 0),
        ):
            out.append(MetricRecord(rank=rank, role="worker", step=step, t=t, name=metric, value=value, peer=peer))
        out.append(MetricRecord(rank=0, role="ps", step=step, t=t, name="bytes_sent", value=GRADIENT_BYTES, peer=rank))
    if step % 250 == 249:
        out.append(MetricRecord(rank=1, role="worker", step=step, t=t, name="accuracy",
                                value=min(0.97, 0.5 + step / 5000), peer=None))
    return out


def now_t() -> float:
    """The trainer's clock: seconds since the epoch."""
    return time.time()
