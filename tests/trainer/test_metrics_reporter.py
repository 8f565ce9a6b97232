"""Every record the trainer logs is numbered in its process's stream and reaches the control
plane or the report spool: the reporter retries while the control plane is down, spills to the
spool when its queue is full, and spools what is left at close."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainer.metrics import HttpReporter, MetricsLogger


class ControlPlane:
    """A real HTTP endpoint on a fixed port that can go down (connection refused) and come back."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.status = 200
        self.hold = threading.Event()
        self.hold.set()
        self._server: ThreadingHTTPServer | None = None
        self.port = 0
        self.up()

    def up(self) -> None:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                plane.hold.wait(10)
                if plane.status == 200:
                    plane.received.extend(body["records"])
                self.send_response(plane.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def down(self) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api/v1/runs/1/metrics"


@pytest.fixture
def plane() -> Iterator[ControlPlane]:
    cp = ControlPlane()
    yield cp
    cp.hold.set()
    if cp._server is not None:
        cp.down()


def _keys(records: list[dict]) -> list[tuple[str, int]]:
    return sorted((r["stream"], r["seq"]) for r in records)


def _spooled(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _reporter(plane: ControlPlane, spool: Path | None, **kw: float) -> HttpReporter:
    return HttpReporter(plane.url, "t0k", spool=str(spool) if spool else None, interval_s=0.02,
                        backoff_s=0.02, max_backoff_s=0.1, timeout_s=2.0, **kw)  # type: ignore[arg-type]


def test_every_record_carries_its_process_stream_and_the_next_sequence_number(tmp_path):
    out = tmp_path / "metrics.jsonl"
    metrics = MetricsLogger(1, "worker", str(out))
    metrics.log(0, "loss", 2.0)
    metrics.event(0, "worker_joined", subject=3, detail="node b")
    metrics.log_bytes(0, {0: 10}, {0: 20})
    metrics.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seq"] for r in records] == [0, 1, 2, 3]
    assert {r["stream"] for r in records} == {metrics.stream}
    assert MetricsLogger(1, "worker").stream != metrics.stream


def test_reporter_rides_out_a_control_plane_that_is_down_and_delivers_every_record_once(plane, tmp_path):
    spool = tmp_path / "spool.jsonl"
    metrics = MetricsLogger(1, "worker", reporter=_reporter(plane, spool))
    for step in range(20):
        metrics.log(step, "loss", 1.0 / (step + 1))
    time.sleep(0.3)
    plane.down()
    for step in range(20, 60):
        metrics.log(step, "loss", 1.0 / (step + 1))
        metrics.log_bytes(step, {0: step}, {0: step})
    time.sleep(1.0)  # retried again and again against a refused connection
    plane.up()
    metrics.close()
    assert _keys(plane.received) == [(metrics.stream, seq) for seq in range(20 + 40 * 3)]
    assert not spool.exists()
    assert metrics.reporter is not None and metrics.reporter.dropped == 0


def test_close_with_the_control_plane_down_spools_exactly_the_undelivered_records(plane, tmp_path):
    spool = tmp_path / "spool.jsonl"
    reporter = _reporter(plane, spool)
    metrics = MetricsLogger(2, "worker", reporter=reporter)
    for step in range(10):
        metrics.log(step, "loss", 1.0)
    time.sleep(0.3)
    plane.down()
    for step in range(10, 30):
        metrics.log(step, "loss", 1.0)
    metrics.event(30, "worker_left", subject=2, detail="spot notice")
    reporter.close(deadline_s=0.5)
    delivered, spooled = _keys(plane.received), _keys(_spooled(spool))
    assert delivered == [(metrics.stream, seq) for seq in range(10)]
    assert spooled == [(metrics.stream, seq) for seq in range(10, 31)]
    assert _spooled(spool)[-1]["event"] == "worker_left"
    assert reporter.spooled == 21 and reporter.dropped == 0


def test_a_full_queue_spills_to_the_spool_instead_of_dropping(plane, tmp_path):
    spool = tmp_path / "spool.jsonl"
    plane.hold.clear()  # the control plane takes its time answering
    reporter = _reporter(plane, spool, max_queue=10, batch_size=5)
    metrics = MetricsLogger(1, "worker", reporter=reporter)
    t0 = time.perf_counter()
    for step in range(500):
        metrics.log(step, "loss", 1.0)
    assert time.perf_counter() - t0 < 0.5  # training never waits on the reporter
    plane.hold.set()
    reporter.close(deadline_s=5)
    assert reporter.spooled > 0 and reporter.dropped == 0
    assert sorted(_keys(plane.received) + _keys(_spooled(spool))) == [(metrics.stream, s) for s in range(500)]


def test_without_a_spool_undelivered_records_are_dropped_with_a_count(plane):
    plane.down()
    reporter = _reporter(plane, None)
    metrics = MetricsLogger(1, "worker", reporter=reporter)
    for step in range(5):
        metrics.log(step, "loss", 1.0)
    reporter.close(deadline_s=0.3)
    assert reporter.dropped == 5 and reporter.sent == 0


def test_a_batch_the_control_plane_refuses_is_dropped_not_retried(plane, tmp_path):
    plane.status = 422
    reporter = _reporter(plane, tmp_path / "spool.jsonl")
    MetricsLogger(1, "worker", reporter=reporter).log(0, "loss", 1.0)
    reporter.close(deadline_s=2)
    assert reporter.dropped == 1 and reporter.spooled == 0 and reporter.sent == 0
