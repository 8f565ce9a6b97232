"""A crowd of readers against the control plane, with agents heartbeating meanwhile (issue 50).

1. Create a scratch Postgres database, migrate it, serve the app (the default capacity
   settings) with uvicorn in a subprocess on loopback.
2. Create a read token and register `--agents` agents through the API.
3. `--readers` concurrent clients (one asyncio loop) read GET /api/v1/runs?limit=100 and
   GET /api/v1/nodes in a loop for `--seconds`; meanwhile a separate process, as agents are,
   heartbeats every agent and probes /healthz every 0.5 s.
4. Print per route the answers by status, the client's latencies (inflated by the client's own
   loop on a small machine), the server's own latencies from its /metrics histogram, the
   server's memory before and after, and whether every node is still online.

    .venv/bin/python bench/crowd.py --readers 200 --seconds 10 [--repo OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "bench-crowd-admin-" + "0" * 16
POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
API = "/api/v1"


def serve(repo: str, database_url: str, port: int) -> None:
    """The server process: the app of `repo` on `database_url`, default capacity settings."""
    sys.path.insert(0, repo)
    import logging

    import uvicorn

    from app.config import Settings
    from app.main import create_app

    logging.disable(logging.CRITICAL)
    settings = Settings(DATABASE_URL=database_url, admin_token=ADMIN_TOKEN, celery_broker_url="redis://127.0.0.1:6379/9")
    uvicorn.run(create_app(settings), host="127.0.0.1", port=port, log_level="critical")


def probe(base: str, seconds: float, agent_tokens: list[str]) -> None:
    """The agents' process: heartbeat each agent and probe /healthz, every 0.5 s; JSON out."""
    until = time.monotonic() + seconds
    found: dict[str, list[Any]] = {"heartbeat": [], "healthz": []}
    with httpx.Client(base_url=base, timeout=30) as client:
        while time.monotonic() < until:
            for token in agent_tokens:
                found["heartbeat"].append(_timed(lambda: client.post(
                    f"{API}/agent/heartbeat", json={"roles": []}, headers={"Authorization": f"Bearer {token}"})))
            found["healthz"].append(_timed(lambda: client.get("/healthz", timeout=10)))
            time.sleep(0.5)
    print(json.dumps(found))


def _timed(call: Any) -> tuple[int | str, float]:
    started = time.monotonic()
    try:
        return call().status_code, time.monotonic() - started
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.monotonic() - started


def _rss_mb(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) // 1024


def _summary(label: str, rows: list[tuple[Any, float]]) -> str:
    latencies = sorted(latency for _, latency in rows)
    statuses: dict[str, int] = {}
    for status, _ in rows:
        statuses[str(status)] = statuses.get(str(status), 0) + 1

    def pct(q: float) -> str:
        return f"{latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000:.0f}" if latencies else "-"

    shown = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    return f"| {label} | {len(rows)} | {shown} | {pct(0.5)} | {pct(0.99)} | {pct(1.0)} |"


def _server_percentiles(metrics: str, method: str, route: str) -> str:
    """p50/p99 upper bounds (ms) of a route from the server's latency histogram."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith("hybridtrain_http_request_duration_seconds_bucket{") and \
                f'method="{method}"' in line and f'route="{route}"' in line:
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return "-"
    total = buckets[-1][1]

    def bound(q: float) -> str:
        le = next(le for le, count in buckets if count >= q * total)
        return "inf" if le == float("inf") else f"{le * 1000:.0f}"

    return f"<= {bound(0.5)} / <= {bound(0.99)}"


async def _crowd(base: str, token: str, readers: int, seconds: float) -> list[tuple[str, Any, float]]:
    rows: list[tuple[str, Any, float]] = []
    limits = httpx.Limits(max_connections=readers + 10)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=30) as client:

        async def reader(i: int) -> None:
            path = f"{API}/runs?limit=100" if i % 2 else f"{API}/nodes"
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                started = time.monotonic()
                try:
                    status: Any = (await client.get(path, headers={"Authorization": f"Bearer {token}"})).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                rows.append((path.split("?")[0], status, time.monotonic() - started))

        await asyncio.gather(*(reader(i) for i in range(readers)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readers", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose app is served (before/after)")
    parser.add_argument("mode", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode and args.mode[0] == "serve":
        serve(args.mode[1], args.mode[2], int(args.mode[3]))
        return
    if args.mode and args.mode[0] == "probe":
        probe(args.mode[1], float(args.mode[2]), args.mode[3:])
        return

    sys.path.insert(0, args.repo)
    from app import db

    name = f"hybridtrain_crowd_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES, autocommit=True) as admin_db:
        admin_db.execute(f'CREATE DATABASE "{name}"')
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    server = None
    try:
        db.upgrade(database_url)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, __file__, "serve", args.repo, database_url, str(port)],
                                  stderr=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
        token = admin.post(f"{API}/tokens", json={"name": "crowd-reader", "scope": "read"}).json()["token"]
        site = admin.post(f"{API}/sites", json={"name": "crowd", "kind": "cloud", "provider": "gcp", "region": "us-west1",
                                                "zone": "us-west1-b", "continent": "north_america"}).json()
        agent_tokens = []
        for i in range(args.agents):
            node = admin.post(f"{API}/nodes", json={"name": f"crowd-{i}", "site_id": site["id"],
                                                   "gpus": [{"model": "T4", "count": 1}]}).json()
            agent_token = "hta_" + secrets.token_urlsafe(32)
            httpx.post(f"{base}{API}/agent/register", timeout=30, json={
                "join_token": node["join_token"], "agent_token": agent_token, "hardware": {"hostname": f"crowd-{i}"}})
            agent_tokens.append(agent_token)
        rss_before = _rss_mb(server.pid)
        prober = subprocess.Popen([sys.executable, __file__, "probe", base, str(args.seconds + 1), *agent_tokens],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started = time.monotonic()
        reads = asyncio.run(_crowd(base, token, args.readers, args.seconds))
        took = time.monotonic() - started
        probed = json.loads(prober.communicate(timeout=120)[0])
        time.sleep(1)
        try:
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
        except httpx.HTTPError:
            metrics = ""  # a wedged server answers nothing, its metrics included
        listed: list[httpx.Response] = []
        nodes = _timed(lambda: listed.append(admin.get(f"{API}/nodes")) or listed[0])
        statuses = [n["status"] for n in listed[0].json()["data"]] if nodes[0] == 200 else []
        print(f"{args.readers} readers for {args.seconds:.0f} s (took {took:.1f} s), {args.agents} agents; "
              f"server RSS {rss_before} -> {_rss_mb(server.pid)} MB; afterwards GET /nodes {nodes[0]} "
              f"in {nodes[1] * 1000:.0f} ms, nodes {statuses}")
        print("| route | requests | answers | client p50 ms | p99 ms | max ms | server p50 / p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for path in (f"{API}/runs", f"{API}/nodes"):
            line = _summary(f"GET {path}", [(s, t) for p, s, t in reads if p == path])
            print(f"{line} {_server_percentiles(metrics, 'GET', path)} |")
        print(f"{_summary('POST heartbeat', probed['heartbeat'])} "
              f"{_server_percentiles(metrics, 'POST', f'{API}/agent/heartbeat')} |")
        print(f"{_summary('GET /healthz', probed['healthz'])} {_server_percentiles(metrics, 'GET', '/healthz')} |")
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        with psycopg.connect(POSTGRES, autocommit=True) as admin_db:
            admin_db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
