"""Benchmark of the control plane's REST API on Postgres: GET a 100-node page, POST a node.

1. Create a scratch Postgres database, migrate it, insert `--nodes` nodes over 10 sites and
   two API tokens (read and admin) directly through SQLAlchemy.
2. Serve the real app with `hybridtrain server` in a subprocess (access log off).
3. With httpx, after a warm-up: GET /api/v1/nodes?skip=<random multiple of 100>&limit=100 and
   POST /api/v1/nodes, `--requests` each, from `--concurrency` client threads.
4. Print a table of requests/s and latency percentiles, write them as JSON (--out), and put
   them side by side with an earlier JSON (--compare).

    .venv/bin/python bench/api.py --out results-api.json [--compare old.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
from sqlalchemy import create_engine, insert, select
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app import db  # noqa: E402
from app.models import GpuModel, Node, NodeGpu, Site, TokenScope  # noqa: E402
from app.queries.tokens import create_token  # noqa: E402
from app.security import hash_secret  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    index = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


def populate(url: str, *, nodes: int, sites: int = 10) -> dict[str, object]:
    """Migrate, then insert sites, nodes (1-2 GPU models each) and two tokens."""
    db.upgrade(url)
    engine = create_engine(url)
    with db.session_scope(db.make_sessionmaker(engine)) as session:
        gpu_ids = list(session.scalars(select(GpuModel.id).order_by(GpuModel.id)))
        site_ids = list(
            session.scalars(
                insert(Site).returning(Site.id),
                [
                    {
                        "name": f"bench-site-{i}",
                        "kind": "cloud",
                        "provider": ["gcp", "aws", "azure"][i % 3],
                        "region": "us-west1",
                        "zone": "us-west1-b",
                        "continent": "north_america",
                    }
                    for i in range(sites)
                ],
            )
        )
        rng = random.Random(7)
        node_rows = [
            {
                "site_id": site_ids[i % sites],
                "name": f"node-{i:05d}",
                "address": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                "instance_type": "n1-standard-8",
                "spot": i % 2 == 0,
                "labels": {"rack": str(i % 40)},
                "status": "online",
                "join_token_hash": hash_secret(uuid.uuid4().hex),
            }
            for i in range(nodes)
        ]
        node_ids = list(session.scalars(insert(Node).returning(Node.id), node_rows))
        gpu_rows = []
        for node_id in node_ids:
            for gpu_id in rng.sample(gpu_ids, rng.choice([1, 2])):
                gpu_rows.append({"node_id": node_id, "gpu_model_id": gpu_id, "count": rng.choice([1, 2, 4, 8])})
        session.execute(insert(NodeGpu), gpu_rows)
        _, read_token = create_token(session, name="bench-read", scope=TokenScope.read)
        _, admin_token = create_token(session, name="bench-admin", scope=TokenScope.admin)
    # Fresh planner statistics, as autovacuum would gather on a live database; without them
    # Postgres guesses 1,500 rows and sorts the whole table instead of walking the primary key.
    with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False),
                         autocommit=True) as connection:
        connection.execute("ANALYZE")
    engine.dispose()
    return {"site_id": site_ids[0], "read_token": read_token, "admin_token": admin_token}


def measure(
    name: str, call: Callable[[httpx.Client, int], httpx.Response], *, requests: int, concurrency: int,
    base_url: str, headers: dict[str, str], expect: int,
) -> dict[str, float]:
    """Run `call` `requests` times over `concurrency` threads; latencies in ms."""
    latencies: list[float] = []
    lock = threading.Lock()
    counter = iter(range(requests))
    failures: list[str] = []

    def worker() -> None:
        with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
            while True:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                started = time.perf_counter()
                response = call(client, index)
                elapsed = (time.perf_counter() - started) * 1000
                if response.status_code != expect:
                    failures.append(f"{response.status_code} {response.text[:200]}")
                with lock:
                    latencies.append(elapsed)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - started
    if failures:
        raise SystemExit(f"{name}: {len(failures)} unexpected answers, e.g. {failures[0]}")
    latencies.sort()
    return {
        "requests": len(latencies),
        "concurrency": concurrency,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": _percentile(latencies, 50),
        "p90_ms": _percentile(latencies, 90),
        "p99_ms": _percentile(latencies, 99),
        "mean_ms": statistics.fmean(latencies),
        "max_ms": latencies[-1],
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    admin_dsn = args.postgres
    name = f"hybridtrain_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(admin_dsn).set(drivername="postgresql+psycopg", database=name)
    url_text = url.render_as_string(hide_password=False)
    server = None
    load_before = os.getloadavg()
    try:
        t0 = time.perf_counter()
        fixture = populate(url_text, nodes=args.nodes)
        populate_s = time.perf_counter() - t0
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k != "HYBRIDTRAIN_DATABASE_URL"}
        env |= {"DATABASE_URL": url_text, "PYTHONPATH": str(REPO)}
        server = subprocess.Popen(
            [str(Path(sys.executable).with_name("hybridtrain")), "server", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", "--no-access-log"],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        base_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {server.stderr.read().decode()}")  # type: ignore[union-attr]
            time.sleep(0.2)

        pages = args.nodes // 100
        rng = random.Random(11)
        skips = [rng.randrange(pages) * 100 for _ in range(args.requests + args.warmup)]

        def get_page(client: httpx.Client, i: int) -> httpx.Response:
            return client.get("/api/v1/nodes", params={"skip": skips[i], "limit": 100})

        run_id = uuid.uuid4().hex[:6]

        def post_node(client: httpx.Client, i: int) -> httpx.Response:
            body = {
                "site_id": fixture["site_id"],
                "name": f"bench-{run_id}-{i}-{threading.get_ident()}",
                "gpus": [{"model": "T4", "count": 1}],
                "spot": True,
                "labels": {"bench": "1"},
            }
            return client.post("/api/v1/nodes", json=body)

        read_headers = {"Authorization": f"Bearer {fixture['read_token']}"}
        admin_headers = {"Authorization": f"Bearer {fixture['admin_token']}"}
        common = {"concurrency": args.concurrency, "base_url": base_url}
        measure("warm-up", get_page, requests=args.warmup, headers=read_headers, expect=200, **common)
        page = measure("GET page", lambda c, i: get_page(c, i + args.warmup), requests=args.requests,
                       headers=read_headers, expect=200, **common)
        post = measure("POST node", post_node, requests=args.requests, headers=admin_headers,
                       expect=201, **common)
        with httpx.Client(base_url=base_url, headers=read_headers) as client:
            body = client.get("/api/v1/nodes", params={"limit": 100}).json()
        assert len(body["data"]) == 100 and body["count"] == args.nodes + args.requests
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=15)
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return {
        "benchmark": "bench/api.py",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        # Other processes on a shared machine move the tail: the 1-minute load average before
        # and after the run says how busy it was.
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(),
                    "loadavg_1m_before": round(load_before[0], 2),
                    "loadavg_1m_after": round(os.getloadavg()[0], 2)},
        "config": {"nodes": args.nodes, "requests": args.requests, "warmup": args.warmup,
                   "concurrency": args.concurrency, "page_size": 100},
        "populate_s": round(populate_s, 2),
        "results": {"GET /api/v1/nodes (100 of N)": page, "POST /api/v1/nodes": post},
    }


COLUMNS = ("requests_per_s", "p50_ms", "p90_ms", "p99_ms", "max_ms")


def table(report: dict[str, object], baseline: dict[str, object] | None = None) -> str:
    """The results as a Markdown table; with a baseline, `new (old)` in each cell."""
    lines = ["| operation | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    old_results = (baseline or {}).get("results", {})
    for operation, values in report["results"].items():  # type: ignore[union-attr]
        cells = []
        for column in COLUMNS:
            cell = f"{values[column]:.1f}"
            if operation in old_results:  # type: ignore[operator]
                old = old_results[operation][column]  # type: ignore[index]
                cell += f" ({old:.1f}, {(values[column] - old) / old * 100:+.0f}%)"
            cells.append(cell)
        lines.append(f"| {operation} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres", default=os.environ.get(
        "HYBRIDTRAIN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="an admin DSN; a scratch database is created and dropped on its server")
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=1000, help="per operation")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=1, help="client threads")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--compare", type=Path, help="an earlier --out file to compare against")
    args = parser.parse_args(argv)
    if args.nodes < 100:
        parser.error("--nodes must be at least 100 (one page)")
    report = run(args)
    baseline = json.loads(args.compare.read_text()) if args.compare else None
    machine = report["machine"]
    print(f"nodes={args.nodes} requests={args.requests} concurrency={args.concurrency} "
          f"cpus={os.cpu_count()} load={machine['loadavg_1m_before']}->{machine['loadavg_1m_after']}"  # type: ignore[index]
          + (f"; in brackets: {args.compare}" if baseline else ""))
    print(table(report, baseline))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
