"""Benchmark of the web dashboard in headless Chromium: how long a metric takes to reach an
open chart, and how long a finished 10,000-step, 4-worker run takes to open.

1. Create a scratch Postgres database, migrate it, and serve the real app with uvicorn in a
   thread on a free port.
2. Seed, through the real ingestion query, a finished ps-bz-gc run of 10,000 steps x 4
   workers (240,040 metric rows) and a running 2-worker run; ANALYZE.
3. Open the finished run `--opens` times in Chromium: from navigation to five drawn charts,
   cold (first visit, plotly.min.js not cached) and warm.
4. Open the running run's page; then `--posts` times: POST one step's records to
   /api/v1/runs/{id}/metrics (the trainer's wire, its metrics token) and time until the loss
   chart has more points (the browser polls every 10 ms). Latency = POST sent -> point drawn.
5. Print a table, write JSON (--out), and with --write-docs replace the "Dashboard latency"
   section of docs/BENCHMARKS.md.

    .venv/bin/python bench/dashboard.py [--posts 100] [--opens 5] [--out results.json] [--write-docs]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import uvicorn
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app import db  # noqa: E402
from app.config import Settings  # noqa: E402
from app.main import create_app  # noqa: E402
from tests.app.web.run_seed import now_t, seed_run, step_records  # noqa: E402

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
TOKEN = "bench-admin-token-" + uuid.uuid4().hex
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SECTION = "## Dashboard latency (bench/dashboard.py)"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_bench(posts: int, opens: int, broker: str) -> dict:
    name = f"hybridtrain_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(ADMIN_DSN).set(drivername="postgresql+psycopg", database=name).render_as_string(hide_password=False)
    server = None
    try:
        db.upgrade(url)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        app = create_app(Settings(DATABASE_URL=url, admin_token=TOKEN, public_url=base, celery_broker_url=broker, secret_key="bench-" + "s" * 40))
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        seeded_at = time.perf_counter()
        with app.state.sessionmaker() as session:
            big = seed_run(session, steps=10_000, workers=4, name="bench-finished")
            live = seed_run(session, steps=10_000, workers=2, finished=False, name="bench-live", metrics_steps=20)
            session.commit()
        seed_s = time.perf_counter() - seeded_at
        with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False), autocommit=True) as conn:
            rows = conn.execute("SELECT count(*) FROM run_metrics WHERE run_id = %s", (big.run_id,)).fetchone()[0]
            # As autovacuum would have by the time anyone opens an old run (bench/api.py does too).
            conn.execute("ANALYZE")
        load_before = os.getloadavg()[0]
        result = _measure(base, big.run_id, live, posts, opens)
        return result | {"seed_s": seed_s, "big_run_rows": rows, "load": [load_before, os.getloadavg()[0]]}
    finally:
        if server is not None:
            server.should_exit = True
            time.sleep(0.5)
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _measure(base: str, big_run: int, live, posts: int, opens: int) -> dict:  # type: ignore[no-untyped-def]
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        context = browser.new_context(base_url=base, viewport={"width": 1440, "height": 900})
        page = context.new_page()
        page.goto("/login")
        page.fill("#f-token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url("**/")
        open_s, server_ms = [], []
        for _ in range(opens):
            started = time.perf_counter()
            page.goto(f"/runs/{big_run}")
            page.wait_for_function("() => window.hybridtrain && document.querySelectorAll('.js-plotly-plot').length === 5")
            open_s.append(time.perf_counter() - started)
            server_ms.append(page.evaluate("() => performance.getEntriesByType('navigation')[0].responseEnd"))

        page.goto(f"/runs/{live.run_id}")
        page.wait_for_selector('#live[data-state="open"]')
        latencies = []
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {live.metrics_token}"}) as api:
            for step in range(20, 20 + posts):
                before = page.evaluate("() => window.hybridtrain.points('loss')")
                body = {"records": [r.model_dump(exclude_none=True) for r in step_records(step, now_t(), live.worker_ranks)]}
                sent = time.perf_counter()
                response = api.post(f"/api/v1/runs/{live.run_id}/metrics", json=body)
                response.raise_for_status()
                page.wait_for_function(f"() => window.hybridtrain.points('loss') > {before}", polling=10, timeout=10_000)
                latencies.append(time.perf_counter() - sent)
                time.sleep(0.05)  # spread the posts over the stream's poll phase
        browser.close()
    return {
        "open_cold_s": open_s[0],
        "open_warm_median_s": statistics.median(open_s[1:]) if len(open_s) > 1 else open_s[0],
        "open_warm_max_s": max(open_s[1:]) if len(open_s) > 1 else open_s[0],
        "open_cold_response_end_ms": server_ms[0],
        "open_last_response_end_ms": server_ms[-1],
        "latency_p50_s": _percentile(latencies, 0.50),
        "latency_p95_s": _percentile(latencies, 0.95),
        "latency_max_s": max(latencies),
        "posts": posts,
        "opens": opens,
    }


def _markdown(result: dict) -> str:
    return "\n".join([
        SECTION,
        "",
        "How soon the dashboard shows what a run reports: a metric from its POST to the open run page's",
        "chart, and a finished long run's page from opening to its charts drawn.",
        "",
        f"Measured {result['date']} on {result['machine']}, Postgres, uvicorn and Chromium on the same host "
        f"(1-minute load average {result['load'][0]:.1f} before, {result['load'][1]:.1f} after). "
        "Reproduce: `.venv/bin/python bench/dashboard.py --write-docs`.",
        "",
        "| what | figure |",
        "| --- | --- |",
        f"| metric POSTed to `/api/v1/runs/{{id}}/metrics` until drawn in the open loss chart, p50 | {result['latency_p50_s'] * 1000:.0f} ms |",
        f"| same, **p95** ({result['posts']} posts; target < 1 s) | **{result['latency_p95_s'] * 1000:.0f} ms** |",
        f"| same, max | {result['latency_max_s'] * 1000:.0f} ms |",
        f"| finished run, 10,000 steps x 4 workers ({result['big_run_rows']:,} metric rows), open until 5 charts drawn, first visit | {result['open_cold_s']:.2f} s |",
        f"| same, **later visits** (plotly.min.js cached), median of {result['opens'] - 1} (target < 2 s) | **{result['open_warm_median_s']:.2f} s** |",
        f"| same, later visits, worst | {result['open_warm_max_s']:.2f} s |",
        f"| server's HTML (downsampled figures inline) complete, first visit | {result['open_cold_response_end_ms']:.0f} ms |",
        f"| same, last visit | {result['open_last_response_end_ms']:.0f} ms |",
        "",
        "The stream polls every 250 ms (`POLL_S` in app/web/routes/runs.py), so a point waits 125 ms",
        "on average for the next poll; the rest is the POST, the query and Plotly's redraw. A run's",
        "series are cut to at most 600 step buckets in one grouped query, so the page carries about",
        "250 kB of figures whatever the run's length.",
        "",
    ])


def write_docs(result: dict) -> None:
    """Replace (or append) this benchmark's section of docs/BENCHMARKS.md, leaving the rest."""
    path = REPO / "docs" / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    section = _markdown(result).rstrip("\n") + "\n\n"
    if SECTION in text:
        start = text.index(SECTION)
        rest = text[start + len(SECTION):]
        end = rest.find("\n## ")
        text = text[:start] + section + (rest[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--posts", type=int, default=100)
    parser.add_argument("--opens", type=int, default=5)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/9")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    result = run_bench(args.posts, max(2, args.opens), args.broker)
    result["date"] = datetime.now(UTC).strftime("%Y-%m-%d")
    result["machine"] = f"{platform.machine()} {platform.processor() or ''} ({__import__('os').cpu_count()} CPUs)".replace("  ", " ")
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.write_docs:
        write_docs(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
