"""Sustained metric ingestion into Postgres through the API: points/s and request latency.

Starts `hybridtrain server` on a fresh Postgres database (and Redis for the launch orders),
declares a node, joins it with an agent token, launches a run to get its metrics token, then
POSTs trainer-shaped batches from several client threads for a fixed time per batch size.
Every point is new (distinct steps), so the figure is rows really stored; at the end the
rows in the table are counted and must equal what the API said it stored.

    .venv/bin/python bench/ingest.py                       # batches of 100, 500, 1000
    .venv/bin/python bench/ingest.py --batch 1000 --seconds 20 --clients 4
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("loss", "samples_per_s", "compute_s", "comm_s", "bytes_sent", "bytes_recv", "density", "batch_size")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Counter:
    """Steps handed out to the clients, so no two batches repeat a (rank, step, name)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> int:
        with self._lock:
            first, self._next = self._next, self._next + n
            return first


def _batch(first_step: int, size: int, now: float) -> dict:
    # `size` records: len(NAMES) metrics for each of size/len(NAMES) steps of rank 0, the rank
    # whose report token the launch order carries (a token reports for its own rank only: 403).
    records = []
    step = first_step
    while len(records) < size:
        for name in NAMES:
            records.append({"rank": 0, "role": "worker", "step": step, "t": now, "name": name,
                            "value": 0.5})
            if len(records) == size:
                break
        step += 1
    return {"records": records}


def _client(url: str, token: str, size: int, counter: Counter, until: float,
            latencies: list[float], stored: list[int]) -> None:
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        while time.perf_counter() < until:
            body = _batch(counter.take(size), size, time.time())
            start = time.perf_counter()
            response = http.post(url, json=body)
            latencies.append(time.perf_counter() - start)
            response.raise_for_status()
            stored.append(response.json()["stored"])


def measure(url: str, token: str, *, size: int, clients: int, seconds: float, counter: Counter) -> dict:
    """Run `clients` threads posting batches of `size` for `seconds`; return the figures."""
    latencies: list[float] = []
    stored: list[int] = []
    start = time.perf_counter()
    until = start + seconds
    threads = [threading.Thread(target=_client, args=(url, token, size, counter, until, latencies, stored))
               for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "batch": size, "clients": clients, "requests": len(latencies), "points": sum(stored),
        "seconds": elapsed, "points_per_s": sum(stored) / elapsed,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, action="append", help="records per POST (repeatable)")
    parser.add_argument("--seconds", type=float, default=15.0, help="per batch size")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--postgres", default=os.environ.get("HYBRIDTRAIN_TEST_POSTGRES",
                                                             "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/13")
    args = parser.parse_args()
    sizes = args.batch or [100, 500, 1000]
    import redis

    # The launch order is read back from this database: start it empty.
    redis.Redis.from_url(args.redis).flushdb()

    name = f"hybridtrain_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.postgres, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = args.postgres.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    admin_token = secrets.token_urlsafe(16)
    env = {**os.environ, "DATABASE_URL": f"{base}/{name}", "CELERY_BROKER_URL": args.redis,
           "HYBRIDTRAIN_ADMIN_TOKEN": admin_token, "HYBRIDTRAIN_PUBLIC_URL": url}
    server = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "server", "--port", str(port), "--no-access-log", "--log-level", "warning"],
        cwd=ROOT, env=env,
    )
    try:
        api = httpx.Client(base_url=url + "/api/v1", headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
        for _ in range(300):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        site = api.post("/sites", json={"name": "bench", "kind": "onprem", "provider": "onprem",
                                        "continent": "europe"}).json()
        node = api.post("/nodes", json={"name": "bench", "site_id": site["id"],
                                        "gpus": [{"model": "T4", "count": 1}]}).json()
        api.post("/agent/register", json={"join_token": node["join_token"], "agent_token": "hta_" + secrets.token_urlsafe(32),
                                          "hardware": {"address": "127.0.0.1", "gpus": []}}).raise_for_status()
        run = api.post("/runs", json={"name": "bench", "node_ids": [node["id"]], "max_steps": 1}).json()
        # The metrics token travels only inside the launch order: read it back from Redis.
        from kombu import Connection

        from agents.celery_app import node_transport_options

        with Connection(args.redis, transport_options=node_transport_options(args.redis, node["id"])) as conn:
            queue = conn.SimpleQueue(f"node.{node['id']}", no_ack=True)
            token = queue.get(timeout=10).decode()[0][2]["report_token"]
            queue.close()
        metrics_url = f"{url}/api/v1/runs/{run['id']}/metrics"

        counter = Counter()
        measure(metrics_url, token, size=100, clients=1, seconds=2, counter=counter)  # warm-up
        print(f"Postgres, {args.clients} client threads, {args.seconds:.0f} s per batch size, one server process")
        print("| batch | requests | points stored | points/s | p50 ms | p99 ms |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        total = 0
        for size in sizes:
            r = measure(metrics_url, token, size=size, clients=args.clients, seconds=args.seconds, counter=counter)
            total += r["points"]
            print(f"| {size} | {r['requests']} | {r['points']} | {r['points_per_s']:,.0f} | "
                  f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |", flush=True)
        with psycopg.connect(args.postgres.rsplit("/", 1)[0] + f"/{name}") as conn:
            rows = conn.execute("SELECT count(*) FROM run_metrics").fetchone()[0]
        warm = rows - total
        print(f"rows in run_metrics: {rows} ({warm} from the warm-up); the API's 'stored' counts agree: "
              f"{rows - warm == total}")
        # A re-delivery of the last batch stores nothing.
        again = httpx.post(metrics_url, json=_batch(0, 100, time.time()), headers={"Authorization": f"Bearer {token}"})
        print(f"re-sent batch: {again.json()}")
    finally:
        server.terminate()
        server.wait(timeout=30)
        with psycopg.connect(args.postgres, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
