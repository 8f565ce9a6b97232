"""Transports count exact bytes; the metrics reporter never blocks and drops only with a count."""

from __future__ import annotations

import threading
import time

import httpx
import torch

from trainer.metrics import HttpReporter, MetricsLogger
from trainer.transport import InMemoryHub, ThrottledTransport


def test_in_memory_transport_counts_the_bytes_on_both_ends():
    hub = InMemoryHub(timeout_s=5)
    a, b = hub.transport(0), hub.transport(1)
    a.send_many([1], torch.zeros(1000, dtype=torch.uint8))
    assert b.recv(0).numel() == 1000
    assert a.take_counts() == ({1: 1008}, {})
    assert b.take_counts() == ({}, {0: 1008})
    assert a.take_counts() == ({}, {})


def test_throttled_transport_takes_bytes_over_bandwidth():
    hub = InMemoryHub(timeout_s=5)
    slow = ThrottledTransport(hub.transport(1), mbps=8.0)  # 1 MB/s
    t0 = time.perf_counter()
    slow.send(0, torch.zeros(100_000, dtype=torch.uint8))
    assert 0.09 < time.perf_counter() - t0 < 1.0
    assert slow.take_counts()[0] == {0: 100_008}


def test_a_throttle_for_one_peer_leaves_the_others_unshaped():
    # A relay's link to the server is slow; its forwards to its own site are not.
    hub = InMemoryHub(timeout_s=5)
    relay = ThrottledTransport(hub.transport(2), mbps=8.0, peer=0)  # 1 MB/s to the server
    frame = torch.zeros(100_000, dtype=torch.uint8)
    t0 = time.perf_counter()
    relay.send(3, frame)
    local_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    relay.send(0, frame)
    shaped_s = time.perf_counter() - t1
    assert local_s < 0.05 and shaped_s > 0.09


def _client(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def test_reporter_posts_batches_in_the_wire_format_with_the_token():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers["authorization"], request.read()))
        return httpx.Response(201)

    client = httpx.Client(transport=httpx.MockTransport(handler), headers={"Authorization": "Bearer t0k"})
    reporter = HttpReporter("http://cp/api/v1/runs/7/metrics", "t0k", client=client, interval_s=0.05)
    metrics = MetricsLogger(2, "worker", reporter=reporter)
    metrics.log(3, "loss", 1.5)
    metrics.log_bytes(3, {0: 100}, {0: 50})
    metrics.close()
    import json

    records = [r for _, body in seen for r in json.loads(body)["records"]]
    assert all(auth == "Bearer t0k" for auth, _ in seen)
    assert {(r["name"], r.get("peer")) for r in records} == {("loss", None), ("bytes_sent", 0), ("bytes_recv", 0)}
    assert all(r["rank"] == 2 and r["role"] == "worker" and r["step"] == 3 for r in records)
    assert reporter.sent == 3 and reporter.dropped == 0


def test_reporter_retries_transient_failures_then_delivers():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(503 if len(calls) < 3 else 200)

    reporter = HttpReporter("http://cp/m", None, client=_client(handler), interval_s=0.05, backoff_s=0.01)
    reporter.put({"name": "loss"})
    reporter.close()
    assert len(calls) == 3 and reporter.sent == 1 and reporter.dropped == 0


def test_reporter_never_blocks_training_when_its_queue_is_full():
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        release.wait(5)
        return httpx.Response(200)

    reporter = HttpReporter("http://cp/m", None, client=_client(handler), max_queue=10, interval_s=0.01)
    t0 = time.perf_counter()
    for i in range(1000):
        reporter.put({"step": i})
    assert time.perf_counter() - t0 < 0.5
    assert reporter.dropped >= 1000 - 10 - reporter.batch_size
    release.set()
    reporter.close(deadline_s=2)
