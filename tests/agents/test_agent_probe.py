"""Link probes on real sockets: the probe server and client, the probe task's report, a real
agent advertising its probe server and running a probe order from the broker, and (as root)
a bandwidth limit measured through a shaped link in a network namespace."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_testing import ROOT, FakeControlPlane, publish, wait_until
from shaped_link import serving_inside, shaped_link

from agents.agent import Agent
from agents.celery_app import prepare_embedded_broker
from agents.client import ControlPlaneClient
from agents.config import AgentSettings
from agents.hardware import Hardware
from agents.probe import MAX_SLOT_WAIT_S, Measurement, ProbeError, ProbeServer, measure, wait_for_slot
from agents.probe_rate import steady_window_mbps
from agents.tasks import probe_links
from hybridtrain.contract import PROBE_LINKS_TASK


@pytest.fixture
def server():
    with ProbeServer("127.0.0.1") as running:
        yield running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- server and client --------------------------------------------------------------------------


def test_bulk_probe_on_loopback_measures_bandwidth_and_rtt(server):
    m = measure("127.0.0.1", server.port, seconds=0.3)

    assert m.mbps > 0
    assert 0 < m.rtt_ms < 50
    assert m.bytes > 0
    assert 0 < m.seconds <= 0.3 + 0.5


def test_probe_of_a_refused_port_fails_quickly():
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(ProbeError, match=rf"127.0.0.1:{port} refused"):
        measure("127.0.0.1", port, seconds=0.3)
    assert time.monotonic() - start < 2


def test_probe_of_a_silent_server_fails_within_its_timeout():
    # A listening socket that never answers: the kernel accepts, nobody speaks.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        start = time.monotonic()
        with pytest.raises(ProbeError, match="no answer within 0.5 s"):
            measure("127.0.0.1", silent.getsockname()[1], seconds=0.3, timeout_s=0.5)
        assert time.monotonic() - start < 2


def test_probe_of_another_kind_of_server_says_so():
    with socket.create_server(("127.0.0.1", 0)) as other:
        def answer() -> None:
            conn, _ = other.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(ProbeError, match="not a probe server"):
            measure("127.0.0.1", other.getsockname()[1], seconds=0.1, timeout_s=2)


def test_probe_server_turns_away_connections_beyond_its_limit():
    with ProbeServer("127.0.0.1", max_connections=1) as limited:
        with socket.create_connection(("127.0.0.1", limited.port)) as holder:
            holder.sendall(b'{"op": "ping"}\n')
            assert holder.recv(100) == b'{"op": "pong"}\n'
            with pytest.raises(ProbeError, match="busy"):
                measure("127.0.0.1", limited.port, seconds=0.1, timeout_s=2)


def test_two_probes_of_one_server_take_turns(server):
    results: list[Measurement] = []
    start = time.monotonic()
    threads = [threading.Thread(target=lambda: results.append(measure("127.0.0.1", server.port, seconds=0.3)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)

    assert len(results) == 2 and all(r.mbps > 0 for r in results)
    assert time.monotonic() - start >= 0.6  # one after the other, not sharing the link


def test_probe_server_caps_a_bulk_send_at_its_byte_limit():
    with ProbeServer("127.0.0.1", max_bytes=1 << 20) as capped:
        m = measure("127.0.0.1", capped.port, seconds=0.5, timeout_s=3)
    assert (1 << 20) <= m.bytes < (1 << 20) + (2 << 20)


PROBE_EACH_OTHER = """
import json, sys, time
from agents.probe import ProbeServer, measure
server = ProbeServer("127.0.0.1", int(sys.argv[1])).start()
print("ready", flush=True)
sys.stdin.readline()
start = time.monotonic()
m = measure("127.0.0.1", int(sys.argv[2]), seconds=0.5)
print(json.dumps({"start": start, "end": time.monotonic(), "mbps": m.mbps}), flush=True)
time.sleep(3)  # still serving the other node's probe, if it comes late
"""


def test_two_nodes_probing_each_other_measure_one_direction_at_a_time():
    # Two agents (processes, each with its probe server) probe each other at the same moment:
    # each probe holds its own node's turn, so the bulk sends do not overlap.
    a_port, b_port = _free_port(), _free_port()
    nodes = [subprocess.Popen([sys.executable, "-c", PROBE_EACH_OTHER, str(mine), str(theirs)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for mine, theirs in ((a_port, b_port), (b_port, a_port))]
    try:
        for n in nodes:
            assert n.stdout.readline().strip() == "ready"
        for n in nodes:
            n.stdin.write("go\n")
            n.stdin.flush()
        first, second = sorted((json.loads(n.stdout.readline()) for n in nodes), key=lambda r: r["end"])
        assert first["mbps"] > 0 and second["mbps"] > 0
        # Both asked at once; the second's bulk ran after the first's: it took two probes' time.
        assert second["end"] - min(first["start"], second["start"]) >= 2 * 0.5
    finally:
        for n in nodes:
            n.kill()
            n.wait()


def test_wait_for_slot_sleeps_until_the_scheduled_start_within_its_cap():
    slept: list[float] = []
    assert wait_for_slot(1000.5, now=1000.0, sleep=slept.append) == 0.5
    assert wait_for_slot(999.0, now=1000.0, sleep=slept.append) == 0.0  # its slot has begun
    assert wait_for_slot(None, now=1000.0, sleep=slept.append) == 0.0  # an order without a schedule
    assert wait_for_slot(1e12, now=1000.0, sleep=slept.append) == MAX_SLOT_WAIT_S
    assert slept == [0.5, MAX_SLOT_WAIT_S]


def test_steady_rate_leaves_out_a_token_buckets_burst():
    # 1.5 MB at once, then 50 Mbit/s (6.25 MB/s) read every 10 ms for 2 s.
    samples = [(0.0, 64_000), (0.001, 1_500_000)]
    samples += [(0.001 + k * 0.01, 1_500_000 + int(62_500 * k)) for k in range(1, 201)]
    whole = (samples[-1][1] - samples[0][1]) * 8 / (samples[-1][0] - samples[0][0]) / 1e6
    assert whole > 55  # the burst inflates the plain rate
    assert steady_window_mbps(samples) == pytest.approx(50.0, rel=1e-3)


def test_steady_rate_is_not_moved_by_a_receiver_stall():
    # Reads every 10 ms at 50 Mbit/s, but none for 150 ms mid-way (the bytes wait in the socket).
    samples = [(k * 0.01, int(62_500 * k)) for k in range(201) if not 100 < k < 115]
    assert steady_window_mbps(samples) == pytest.approx(50.0, rel=0.02)


# -- the probe task -----------------------------------------------------------------------------


class RecordingTransport(httpx.BaseTransport):
    """The control plane at the HTTP seam: records each POST and answers 200."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str | None, dict[str, Any]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.posts.append((request.url.path, request.headers.get("Authorization"), json.loads(request.content)))
        return httpx.Response(200, json={"stored": 1, "errors": 1})


def test_probe_task_reports_measured_links_and_failures_with_the_agent_token(server):
    transport = RecordingTransport()
    client = ControlPlaneClient("http://cp.test", agent_token="hta_x", transport=transport)
    refused = _free_port()
    spec = {"targets": [{"node_id": 2, "host": "127.0.0.1", "port": server.port},
                        {"node_id": 3, "host": "127.0.0.1", "port": refused}], "seconds": 0.2}

    body = probe_links(spec, client=client, node_id=1, report_retry_s=0)

    [(path, auth, sent)] = transport.posts
    assert path == "/api/v1/agent/links" and auth == "Bearer hta_x"
    assert sent == body
    assert sent["src_node_id"] == 1
    [result] = sent["results"]
    assert result["dst_node_id"] == 2 and result["mbps"] > 0 and result["bytes"] > 0
    assert set(result) == {"dst_node_id", "mbps", "rtt_ms", "bytes", "seconds"}
    [error] = sent["errors"]
    assert error["dst_node_id"] == 3 and "refused" in error["error"]


def test_probe_task_caps_the_seconds_an_order_asks_for():
    transport = RecordingTransport()
    client = ControlPlaneClient("http://cp.test", agent_token="hta_x", transport=transport)
    asked: list[float] = []

    def fake_measure(host: str, port: int, *, seconds: float) -> Measurement:
        asked.append(seconds)
        return Measurement(mbps=1.0, rtt_ms=1.0, bytes=1, seconds=seconds)

    probe_links({"targets": [{"node_id": 2, "host": "h", "port": 1}], "seconds": 3600},
                client=client, measure=fake_measure, report_retry_s=0)

    assert asked == [30.0]


# -- the agent ----------------------------------------------------------------------------------


def _agent(probe_port: int) -> Agent:
    settings = AgentSettings(server_url="http://cp.test", probe_port=probe_port, benchmark_seconds=0)
    agent = Agent(settings, client=ControlPlaneClient("http://cp.test", transport=RecordingTransport()))
    agent.hardware = Hardware(hostname="h", cpu_cores=1, cpu_physical_cores=1, memory_gb=1.0,
                              address="127.0.0.1")
    return agent


def test_agent_reports_its_probe_servers_port_in_its_hardware():
    agent = _agent(0)
    server = agent.start_probe_server()
    try:
        assert agent.hardware_json()["probe_port"] == server.port
        assert measure("127.0.0.1", server.port, seconds=0.05).bytes > 0
    finally:
        server.close()


def test_agent_reports_how_it_reads_data_sets_in_its_hardware():
    agent = _agent(-1)
    assert agent.hardware_json()["data_cache"] == {"bytes": 20 * 1024**3, "site_cache": False}
    agent.settings = agent.settings.model_copy(update={"data_cache_bytes": 10**9,
                                                       "data_site_cache_url": "http://10.0.0.5:8700"})
    assert agent.hardware_json()["data_cache"] == {"bytes": 10**9, "site_cache": True}


def test_agent_with_probe_port_minus_one_runs_no_probe_server():
    agent = _agent(-1)
    assert agent.start_probe_server() is None
    assert "probe_port" not in agent.hardware_json()


class LinkRecordingPlane(FakeControlPlane):
    """The recording control plane, also taking link reports."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, Any]] = []

    def handle(self, path: str, auth: str | None, body: dict[str, Any]) -> tuple[int, Any]:
        if path == "/api/v1/agent/links" and self._authorized(auth):
            with self.lock:
                self.links.append(body)
            return 200, {"stored": len(body["results"]), "errors": len(body["errors"])}
        return super().handle(path, auth, body)


def test_agent_advertises_its_probe_server_and_runs_a_probe_order_from_the_broker(
    tmp_path: Path, start_agent, server
):
    broker = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    prepare_embedded_broker(broker)
    plane = LinkRecordingPlane()
    try:
        agent = start_agent(plane, broker, extra=["--advertise-address", "127.0.0.1"])
        wait_until(lambda: plane.heartbeats and "ready" in agent.output(), 60, "the agent to be ready")
        advertised = plane.registrations[0]["hardware"]["probe_port"]
        assert measure("127.0.0.1", advertised, seconds=0.05).bytes > 0

        spec = {"targets": [{"node_id": 9, "host": "127.0.0.1", "port": server.port}], "seconds": 0.1}
        publish(broker, plane, PROBE_LINKS_TASK, [spec])

        [report] = wait_until(lambda: list(plane.links), 30, "the agent's link report")
        assert report["src_node_id"] == plane.node_id
        assert [r["dst_node_id"] for r in report["results"]] == [9] and report["errors"] == []
        assert agent.stop(signal.SIGTERM) == 0
    finally:
        plane.close()


# -- a shaped link ------------------------------------------------------------------------------

SERVE_IN_NAMESPACE = (
    "import sys, time; from agents.probe import ProbeServer; "
    "s = ProbeServer(sys.argv[1], int(sys.argv[2])).start(); print('ready', flush=True); time.sleep(60)"
)


def test_probe_reads_a_50_mbit_tbf_link_within_10_percent_past_its_burst():
    # The probe's data flows from here into the namespace, the shaped direction. A 1.5 MB
    # bucket lets the first 1.5 MB through at the veth's speed: a rate over the whole transfer
    # would read 12 % high, its steady windows must not.
    with shaped_link("p1probe", "50mbit", "1500kb") as link, serving_inside(link, SERVE_IN_NAMESPACE, ROOT):
        m = measure(link.address, link.port, seconds=1.0)

    # Goodput under a 50 Mbit/s shaper: the headers take ~3 %.
    assert m.mbps == pytest.approx(50.0 * 0.97, rel=0.10)
    assert m.bytes * 8 / m.seconds / 1e6 > m.mbps  # the burst did arrive fast
