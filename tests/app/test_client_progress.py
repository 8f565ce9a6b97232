"""`runs create --wait` progress against the real control plane (FastAPI on Postgres, launch
orders through Redis): the metrics a run's rank 0 reports become the progress line."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE
from app.cli.client import HybridtrainClient
from app.cli.run_progress import run_progress
from hybridtrain.progress import RunProgress
from bench.paper.api_runs import metrics_reader
from tests.app.conftest import ADMIN_TOKEN

T0 = 1_800_000_000.0


@pytest.fixture
def api(make_client: Callable[[str | None], TestClient]) -> Iterator[HybridtrainClient]:
    """The CLI's client, talking to the test app through the test client's in-process transport."""
    with HybridtrainClient("http://testserver", ADMIN_TOKEN, transport=make_client(None)._transport) as client:
        yield client


@pytest.fixture
def running(api, online_node, dispatched, make_client):
    """A one-rank run that has started, and a client holding its trainer's token."""
    node = online_node()
    run = api.create_run(run_body([node], strategy="allreduce", max_steps=100, target="accuracy>=0.9"))
    token = next(args for task, args in dispatched.take(node.id) if task == LAUNCH_ROLE)[2]["report_token"]
    started = node.event(run["id"], rank=0, role="worker", event="started", pid=10)
    assert started.status_code == 200, started.text
    return run["id"], make_client(token), node


def _report(trainer: TestClient, run_id: int, step: int, **values: float) -> None:
    records = [{"rank": 0, "role": "worker", "step": step, "t": T0 + step, "name": name, "value": value}
               for name, value in values.items()]
    answer = trainer.post(f"{API}/runs/{run_id}/metrics", json={"records": records})
    assert answer.status_code == 200, answer.text


def test_the_progress_line_reads_the_runs_rank_0_metrics(api, running):
    run_id, trainer, _ = running
    _report(trainer, run_id, 10, loss=1.2, samples_per_s=40.0, accuracy=0.5)
    _report(trainer, run_id, 30, loss=0.8, samples_per_s=42.5, accuracy=0.75)
    stream = io.StringIO()
    progress = run_progress(api, stream, tty=False, clock=lambda: T0 + 30)
    progress.poll(api.get_run(run_id))
    line = stream.getvalue().strip()
    assert line.startswith("hybridtrain: step 30/100 (30%) 42.5 samples/s accuracy 0.750 elapsed ")
    assert line.endswith(" left 1m10s")


def test_later_polls_see_only_newer_points(api, running):
    run_id, trainer, _ = running
    _report(trainer, run_id, 10, loss=1.2)
    progress = RunProgress(api.metrics, io.StringIO(), tty=False, every_s=0)
    progress.poll(api.get_run(run_id))
    _report(trainer, run_id, 20, loss=0.9)
    progress.poll(api.get_run(run_id))
    assert (progress.snapshot.step, progress.snapshot.latest["loss"].value) == (20, 0.9)


def test_wait_for_run_shows_progress_until_the_run_succeeds(api, running):
    run_id, trainer, node = running
    _report(trainer, run_id, 100, loss=0.1, accuracy=0.95)
    node.event(run_id, rank=0, role="worker", event="exited", exit_code=0)
    seen: list[str] = []
    done = api.wait_for_run(run_id, poll_s=0.01, on_poll=lambda r: seen.append(r["status"]))
    assert (done["status"], seen) == ("succeeded", ["succeeded"])


def test_the_benchmark_reads_the_same_progress_through_its_own_client(api, running, make_client):
    run_id, trainer, _ = running
    _report(trainer, run_id, 30, loss=0.8, samples_per_s=42.5, accuracy=0.75)
    stream = io.StringIO()
    progress = RunProgress(metrics_reader(make_client(ADMIN_TOKEN)), stream, tty=False,
                           label="  [1/1] allreduce, seed 0", clock=lambda: T0 + 30)
    progress.poll(api.get_run(run_id))
    assert stream.getvalue().startswith("  [1/1] allreduce, seed 0: step 30/100 (30%) 42.5 samples/s accuracy 0.750")
