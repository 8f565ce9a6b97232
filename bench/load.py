"""The control plane's load benchmark (issue 50): a fleet of agents, dashboard users and CI
clients at rising load levels, against 1 and then 2 API processes, in one invocation.

1. Create a scratch Postgres database; `hybridtrain server --workers P` serves it (the default
   capacity settings, Redis as the broker), for each P of `--processes`.
2. Declare `max(--levels)` nodes, register an agent for each, create `--runs` runs (their
   pages are what dashboard users poll), and sign a dashboard session in with a read token.
3. At each level of N agents, for `--seconds`: N agents POST the real heartbeat body to
   /api/v1/agent/heartbeat every 5 s (spread evenly over the 5 s), N/20 dashboard users GET a
   run page (/runs/{id}) every 2 s, N/100 CI clients GET /api/v1/runs?limit=50 every 2 s.
   Agents run in client processes of 250 each, users and CI clients in another; each request's
   lateness against its schedule is kept, to tell a lagging client from a slow server. A first, unreported
   level of 6 s at the lowest load warms each server up. Before each level, unreported, the
   nodes of its agents that are not online (a smaller level left them idle) beat until they are,
   and its load then runs one heartbeat interval (5 s) before its report starts: a whole fleet
   coming back online at once is not the steady state measured here.
4. Print per process count and level, per route: requests offered and answered per second,
   the client's p50/p99 (ms), the errors (503s apart), nodes among the active agents that are
   not online afterwards, the server's memory; per level, the CPU the server and Postgres
   spent (cores, and ms per answered request: on a machine shared with other work the one
   figure that says what the requests cost rather than how busy the machine was); then the
   knee of each process count (the first level missing a target: heartbeat p99 < 250 ms,
   page p99 < 1 s, no errors, no node offline) and 2 processes' ratios to 1. The clients'
   own CPU is reported too (they share the host): agents' clients are aiohttp's, the cheaper.
5. Once the last level has stopped, each server again after 3 s: 20 heartbeats and 5 run pages
   one at a time (the slowest of each), and its memory idle, after the last level and now.

    .venv/bin/python bench/load.py --levels 100,300,1000 --seconds 20 --processes 1,2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg

REPO = Path(__file__).resolve().parent.parent
POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
ADMIN_TOKEN = "bench-load-admin-" + "0" * 16
API = "/api/v1"
HEARTBEAT_EVERY_S = 5.0
PAGE_EVERY_S = 2.0
CI_EVERY_S = 2.0
# Targets of issue 50 for 1,000 agents, 50 dashboard users and 10 CI clients.
HEARTBEAT_P99_S = 0.25
PAGE_P99_S = 1.0
WARM_UP_S = 6.0
# How long after the last level the server's answers and memory are read again.
RECOVERY_AFTER_S = 3.0
AGENT_TIMEOUT_S = 10.0
ROUTES = ("POST heartbeat", "GET run page", "GET /api/v1/runs")

# route, status (or the exception's name), seconds to the answer, seconds the client sent late
Row = tuple[str, Any, float, float]
# Agents per client process: one asyncio loop drives at most this many.
AGENTS_PER_CLIENT = 250
# A level whose client sent its requests later than this (p99) measured the client, not the server.
CLIENT_LAG_S = 0.5


# -- the client processes ----------------------------------------------------------------------

def _heartbeat_body() -> dict[str, Any]:
    """What agents/agent.py sends every 5 s on a node with one GPU and no roles."""
    return {
        "roles": [],
        "load": {"cpu_percent": 12.5, "memory_available_gb": 48.31},
        "t": time.time(),
        "broker_user": False,
        "gpus": [{"index": 0, "name": "Tesla T4", "utilization": 0.0,
                  "memory_used_bytes": 0, "memory_total_bytes": 16 * 2**30}],
    }


async def _periodic(client: Any, route: str, send: Any, offset: float, every: float,
                    until: float, rows: list[Row], record_from: float = 0.0) -> None:
    """`send(client)` every `every` s from `offset`, each answer's status (or the error's name) in
    `rows` once the loop's clock has reached `record_from`."""
    loop = asyncio.get_running_loop()
    due = loop.time() + offset
    # A beat the lagging client could only send after the level's end is not sent: the answered
    # rate then shows the shortfall, and the level ends on time.
    while due < until and loop.time() < until:
        await asyncio.sleep(max(0.0, due - loop.time()))
        started = loop.time()
        try:
            status: Any = await send(client)
        except (httpx.HTTPError, aiohttp.ClientError, TimeoutError) as exc:
            status = type(exc).__name__
        if started >= record_from:
            rows.append((route, status, loop.time() - started, started - due))
        # Open loop: a late answer does not postpone the next beat, as on a real agent's clock.
        due += every


async def _agents(base: str, tokens: list[str], seconds: float, lead_s: float) -> list[Row]:
    rows: list[Row] = []
    # A connection of its own per agent, kept alive, with the agent's own timeout
    # (agents/client.py), as a fleet of machines would hold them. One pool for all would open
    # only as many as were ever in flight at once, a handful, and whichever API process accepted
    # those few would carry their share of the fleet: a 70/30 split overloads one process.
    # aiohttp, the lighter client a request: the clients share the host with the server they measure.
    timeout = aiohttp.ClientTimeout(total=AGENT_TIMEOUT_S)
    sessions = [aiohttp.ClientSession(base_url=base, connector=aiohttp.TCPConnector(limit=1), timeout=timeout)
                for _ in tokens]
    try:
        record_from = asyncio.get_running_loop().time() + lead_s
        until = record_from + seconds

        def beat(token: str) -> Any:
            async def send(c: aiohttp.ClientSession) -> int:
                async with c.post(f"{API}/agent/heartbeat", json=_heartbeat_body(),
                                  headers={"Authorization": f"Bearer {token}"}) as answer:
                    await answer.read()
                    return answer.status
            return send

        await asyncio.gather(*(
            _periodic(session, "POST heartbeat", beat(token), HEARTBEAT_EVERY_S * i / len(tokens), HEARTBEAT_EVERY_S,
                      until, rows, record_from)
            for i, (token, session) in enumerate(zip(tokens, sessions, strict=True))))
    finally:
        await asyncio.gather(*(session.close() for session in sessions))
    return rows


async def _readers(base: str, cookies: dict[str, str], token: str, run_ids: list[int], users: int, ci: int,
                   seconds: float, lead_s: float) -> list[Row]:
    rows: list[Row] = []
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=users + ci + 2),
                                 timeout=30) as client:
        record_from = asyncio.get_running_loop().time() + lead_s
        until = record_from + seconds

        def page(run_id: int) -> Any:
            async def send(c: httpx.AsyncClient) -> int:
                return (await c.get(f"/runs/{run_id}", cookies=cookies)).status_code
            return send

        async def listing(c: httpx.AsyncClient) -> int:
            return (await c.get(f"{API}/runs?limit=50", headers={"Authorization": f"Bearer {token}"})).status_code

        await asyncio.gather(
            *(_periodic(client, "GET run page", page(run_ids[i % len(run_ids)]), PAGE_EVERY_S * i / max(users, 1),
                        PAGE_EVERY_S, until, rows, record_from) for i in range(users)),
            *(_periodic(client, "GET /api/v1/runs", listing, CI_EVERY_S * i / max(ci, 1), CI_EVERY_S, until, rows,
                        record_from)
              for i in range(ci)),
        )
    return rows


def _client_process(kind: str, spec: dict[str, Any]) -> None:
    if kind == "agents":
        rows = asyncio.run(_agents(spec["base"], spec["tokens"], spec["seconds"], spec["lead_s"]))
    else:
        rows = asyncio.run(_readers(spec["base"], spec["cookies"], spec["token"], spec["run_ids"], spec["users"],
                                    spec["ci"], spec["seconds"], spec["lead_s"]))
    # Its own CPU too: the clients share the host with the server they measure.
    print(json.dumps({"rows": rows, "cpu_s": time.process_time()}))


# -- the server ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with_children(pid: int) -> list[int]:
    return [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]


def _rss_mb(pid: int) -> float:
    """Resident memory of the server: the process and its children (uvicorn's workers)."""
    total = 0
    for one in _with_children(pid):
        try:
            total += int(Path(f"/proc/{one}/status").read_text().split("VmRSS:")[1].split()[0])
        except (FileNotFoundError, IndexError):
            pass
    return total / 1024


def _cpu_s(pids: list[int]) -> dict[int, float]:
    """CPU seconds (user + system) each live process of `pids` has used so far."""
    used = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        used[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def _backends(database: str) -> list[int]:
    """The Postgres backends serving `database` (the server's pools, the liveness monitor)."""
    with psycopg.connect(POSTGRES, autocommit=True) as admin_db:
        return [r[0] for r in admin_db.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (database,))]


@dataclass
class CpuMeter:
    """CPU the server (its processes) and Postgres (the database's backends) spend during a
    level: the figure a machine shared with other work cannot blur the way it blurs latency."""

    server_pid: int
    database: str
    start: dict[int, float] = field(default_factory=dict)

    def begin(self) -> None:
        self.start = _cpu_s([*_with_children(self.server_pid), *_backends(self.database)])

    def cores(self, seconds: float) -> tuple[float, float]:
        """(server, Postgres) CPU since `begin`, in cores; a backend that connected since counts whole."""
        server = _cpu_s(_with_children(self.server_pid))
        postgres = _cpu_s(_backends(self.database))

        def spent(now: dict[int, float]) -> float:
            return sum(used - self.start.get(pid, 0.0) for pid, used in now.items())

        return spent(server) / seconds, spent(postgres) / seconds


class Server:
    """`hybridtrain server --workers P` on `database_url`, in a process group of its own."""

    def __init__(self, database_url: str, broker_url: str, processes: int) -> None:
        self.database = database_url.rsplit("/", 1)[1]
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HYBRIDTRAIN_")} | {
            "DATABASE_URL": database_url, "CELERY_BROKER_URL": broker_url, "HYBRIDTRAIN_ADMIN_TOKEN": ADMIN_TOKEN,
            # One shared Redis: no ACL user per simulated node.
            "HYBRIDTRAIN_BROKER_NODE_USERS": "false",
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "server", "--port", str(self.port), "--workers", str(processes),
             "--log-level", "warning", "--no-access-log"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        # Migrating a fresh database takes minutes when other work shares the machine.
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server with {processes} process(es) did not start")
            try:
                if httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        time.sleep(2 * processes)  # every worker past its start-up

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


# -- set-up, run, report -------------------------------------------------------------------------

@dataclass
class Fleet:
    agent_tokens: list[str] = field(default_factory=list)
    node_ids: list[int] = field(default_factory=list)
    run_ids: list[int] = field(default_factory=list)
    read_token: str = ""


async def _post(client: httpx.AsyncClient, url: str, **kwargs: Any) -> httpx.Response:
    """POST, sent again after Retry-After while the server sheds it: the set-up must not fail
    because the server was busy (the levels count 503s as errors; the set-up is not measured)."""
    for _ in range(60):
        response = await client.post(url, **kwargs)
        if response.status_code != 503:
            break
        await asyncio.sleep(float(response.headers.get("retry-after", 1)))
    return response


async def _declare(base: str, count: int, runs: int) -> Fleet:
    fleet = Fleet()
    admin_headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=admin_headers, timeout=60) as admin:
        fleet.read_token = (await admin.post(f"{API}/tokens", json={"name": "load-reader", "scope": "read"})).json()["token"]
        site = (await admin.post(f"{API}/sites", json={
            "name": "load", "kind": "cloud", "provider": "gcp", "region": "us-west1", "zone": "us-west1-b",
            "continent": "north_america"})).json()
        gate = asyncio.Semaphore(6)

        async def one(i: int) -> tuple[int, str]:
            async with gate:
                node = (await _post(admin, f"{API}/nodes", json={
                    "name": f"load-{i:05d}", "site_id": site["id"], "gpus": [{"model": "T4", "count": 1}]})).json()
                token = "hta_" + secrets.token_urlsafe(32)
                joined = await _post(admin, f"{API}/agent/register", headers={"Authorization": ""}, json={
                    "join_token": node["join_token"], "agent_token": token,
                    "hardware": {"hostname": f"load-{i}", "address": "127.0.0.1", "cpu_cores": 16, "gpus": [],
                                 "benchmark": {"samples_per_s": 500.0}}})
                joined.raise_for_status()
                return int(node["id"]), token

        # The runs' nodes first, with their runs at once: a node declared early may be offline
        # (30 s without a heartbeat) by the time the last is, and a run needs online nodes.
        for node_id, token in await asyncio.gather(*(one(i) for i in range(min(runs, count)))):
            fleet.node_ids.append(node_id)
            fleet.agent_tokens.append(token)
        for i in range(min(runs, count)):
            node_id = fleet.node_ids[i]
            run = await _post(admin, f"{API}/runs", json={
                "name": f"load-run-{i}", "node_ids": [node_id], "strategy": "ps", "ps_node_id": node_id,
                "global_batch_size": 64, "max_steps": 20})
            run.raise_for_status()
            fleet.run_ids.append(int(run.json()["id"]))
        for node_id, token in await asyncio.gather(*(one(i) for i in range(min(runs, count), count))):
            fleet.node_ids.append(node_id)
            fleet.agent_tokens.append(token)
    return fleet


async def _bring_online(base: str, fleet: Fleet, agents: int) -> float:
    """Beat once for each of the first `agents` nodes that is not online, a few at a time, until
    all are; the seconds it took. Unreported: nodes left idle by a smaller level went offline,
    and a whole fleet returning at once is not the steady state a level measures."""
    started = time.monotonic()
    wanted = dict(zip(fleet.node_ids[:agents], fleet.agent_tokens[:agents], strict=True))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        gate = asyncio.Semaphore(8)

        async def beat(token: str) -> None:
            async with gate:
                await _post(client, f"{API}/agent/heartbeat", json=_heartbeat_body(),
                            headers={"Authorization": f"Bearer {token}"})

        for _ in range(20):
            nodes = (await client.get(f"{API}/nodes?limit=1000", headers=admin)).json()["data"]
            behind = [wanted[n["id"]] for n in nodes if n["id"] in wanted and n["status"] != "online"]
            if not behind:
                return time.monotonic() - started
            await asyncio.gather(*(beat(token) for token in behind))
    raise SystemExit(f"{agents} nodes did not all come online")


def _sign_in(base: str, token: str) -> dict[str, str]:
    """The cookies of a dashboard session signed in with `token`, through the login form."""
    with httpx.Client(base_url=base, timeout=30) as browser:
        form = browser.get("/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form)
        assert csrf, "the login page carries no CSRF token"
        signed = browser.post("/login", data={"token": token, "next": "/", "csrf_token": csrf.group(1)})
        assert signed.status_code == 303, signed.status_code
        return dict(browser.cookies)


def _spawn(kind: str, spec: dict[str, Any]) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, __file__, "--client", kind], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdin is not None
    process.stdin.write(json.dumps(spec))
    process.stdin.close()
    return process


@dataclass
class Level:
    processes: int
    agents: int
    users: int
    ci: int
    seconds: float
    rows: list[Row]
    not_online: int
    rss_mb: float
    server_cores: float
    postgres_cores: float
    client_cores: float

    def of(self, route: str) -> list[Row]:
        return [r for r in self.rows if r[0] == route]

    def offered_per_s(self, route: str) -> float:
        every, clients = {"POST heartbeat": (HEARTBEAT_EVERY_S, self.agents), "GET run page": (PAGE_EVERY_S, self.users),
                          "GET /api/v1/runs": (CI_EVERY_S, self.ci)}[route]
        return clients / every

    def answered_per_s(self, route: str) -> float:
        return sum(1 for r in self.of(route) if isinstance(r[1], int) and r[1] < 400) / self.seconds

    def errors(self, route: str) -> dict[str, int]:
        """Requests not answered 2xx/3xx, by status or exception name."""
        found: dict[str, int] = {}
        for r in self.of(route):
            if not (isinstance(r[1], int) and r[1] < 400):
                found[str(r[1])] = found.get(str(r[1]), 0) + 1
        return found

    def p(self, route: str, q: float, column: int = 2) -> float | None:
        values = sorted(r[column] for r in self.of(route))
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    def cpu_ms_per_answer(self) -> float | None:
        """Server and Postgres CPU per request answered 2xx/3xx, all routes together."""
        answered = sum(self.answered_per_s(route) for route in ROUTES)
        return (self.server_cores + self.postgres_cores) * 1000 / answered if answered else None

    def lag_p99(self) -> float:
        """The client's lateness, p99 over every request of the level."""
        lags = sorted(r[3] for r in self.rows)
        return lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0

    def misses(self) -> list[str]:
        """The targets this level misses."""
        missed = []
        heartbeat_p99, page_p99 = self.p("POST heartbeat", 0.99), self.p("GET run page", 0.99)
        if heartbeat_p99 is not None and heartbeat_p99 >= HEARTBEAT_P99_S:
            missed.append(f"heartbeat p99 {heartbeat_p99 * 1000:.0f} ms")
        if page_p99 is not None and page_p99 >= PAGE_P99_S:
            missed.append(f"page p99 {page_p99 * 1000:.0f} ms")
        failed = sum(sum(self.errors(route).values()) for route in ROUTES)
        if failed:
            missed.append(f"{failed} errors")
        if self.not_online:
            missed.append(f"{self.not_online} nodes offline")
        if missed and self.lag_p99() > CLIENT_LAG_S:
            missed.append(f"client lag p99 {self.lag_p99() * 1000:.0f} ms: the clients, too, were short of CPU")
        return missed


def _run_level(server: Server, fleet: Fleet, cookies: dict[str, str], processes: int, agents: int,
               seconds: float, lead_s: float = HEARTBEAT_EVERY_S) -> Level:
    """`agents` agents and their users and CI clients for `lead_s`, unreported, then `seconds`, reported."""
    users, ci = max(1, agents // 20), max(1, agents // 100)
    asyncio.run(_bring_online(server.base, fleet, agents))
    tokens = fleet.agent_tokens[:agents]
    clients = [_spawn("agents", {"base": server.base, "tokens": tokens[i:i + AGENTS_PER_CLIENT], "seconds": seconds,
                                 "lead_s": lead_s}) for i in range(0, len(tokens), AGENTS_PER_CLIENT)]
    clients.append(_spawn("readers", {"base": server.base, "cookies": cookies, "token": fleet.read_token,
                                      "run_ids": fleet.run_ids, "users": users, "ci": ci, "seconds": seconds,
                                      "lead_s": lead_s}))
    # The CPU is metered over the reported part only (the clients start within a few ms of each other).
    time.sleep(lead_s)
    meter = CpuMeter(server.process.pid, server.database)
    meter.begin()
    started = time.monotonic()
    rows: list[Row] = []
    client_cpu_s = 0.0
    for process in clients:
        assert process.stdout is not None
        out = json.loads(process.stdout.read())
        process.wait(timeout=60)
        rows += [(r[0], r[1], r[2], r[3]) for r in out["rows"]]
        client_cpu_s += out["cpu_s"]
    elapsed = time.monotonic() - started
    server_cores, postgres_cores = meter.cores(elapsed)
    rss = _rss_mb(server.process.pid)
    nodes = httpx.get(f"{server.base}{API}/nodes?limit=1000", timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["data"]
    active = set(fleet.node_ids[:agents])
    not_online = sum(1 for n in nodes if n["id"] in active and n["status"] != "online")
    return Level(processes, agents, users, ci, seconds, rows, not_online, rss, server_cores, postgres_cores,
                 client_cpu_s / (elapsed + lead_s))


@dataclass
class Recovery:
    """The server once the last level's load has stopped: its answers and its memory."""

    processes: int
    after_s: float
    beat_ms: list[float]
    page_ms: list[float]
    statuses: set[int]
    idle_mb: float
    peak_mb: float
    after_mb: float


def _recovery(server: Server, fleet: Fleet, cookies: dict[str, str], processes: int, idle_mb: float) -> Recovery:
    """RECOVERY_AFTER_S after the load stops: 20 heartbeats and 5 run pages one at a time, and the memory."""
    peak_mb = _rss_mb(server.process.pid)
    time.sleep(RECOVERY_AFTER_S)
    beats, pages, statuses = [], [], set()
    with httpx.Client(base_url=server.base, timeout=30) as client:
        for token in fleet.agent_tokens[:20]:
            started = time.monotonic()
            statuses.add(client.post(f"{API}/agent/heartbeat", json=_heartbeat_body(),
                                     headers={"Authorization": f"Bearer {token}"}).status_code)
            beats.append((time.monotonic() - started) * 1000)
        for run_id in fleet.run_ids[:5]:
            started = time.monotonic()
            statuses.add(client.get(f"/runs/{run_id}", cookies=cookies).status_code)
            pages.append((time.monotonic() - started) * 1000)
    return Recovery(processes, RECOVERY_AFTER_S, beats, pages, statuses, idle_mb, peak_mb, _rss_mb(server.process.pid))


def _report_recovery(recoveries: list[Recovery]) -> None:
    print()
    print("| processes | after the load stopped | heartbeat max ms | run page max ms | statuses "
          "| server RSS MB: idle / after the last level / after |")
    print("|---|---|---|---|---|---|")
    for r in recoveries:
        print(f"| {r.processes} | {r.after_s:.0f} s | {max(r.beat_ms):.0f} | {max(r.page_ms):.0f} "
              f"| {', '.join(map(str, sorted(r.statuses)))} | {r.idle_mb:.0f} / {r.peak_mb:.0f} / {r.after_mb:.0f} |")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _report(levels: list[Level], processes: list[int]) -> None:
    print("| processes | agents / users / CI | route | offered /s | answered /s | p50 ms | p99 ms | errors "
          "| client lag p99 ms | nodes not online | server RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for level in levels:
        for route in ROUTES:
            errors = ", ".join(f"{n} x {kind}" for kind, n in sorted(level.errors(route).items())) or "0"
            print(f"| {level.processes} | {level.agents} / {level.users} / {level.ci} | {route} "
                  f"| {level.offered_per_s(route):.1f} | {level.answered_per_s(route):.1f} "
                  f"| {_ms(level.p(route, 0.5))} | {_ms(level.p(route, 0.99))} | {errors} "
                  f"| {_ms(level.p(route, 0.99, column=3))} | {level.not_online} | {level.rss_mb:.0f} |")
    print()
    print("| processes | agents | server CPU, cores | Postgres CPU, cores | load clients' CPU, cores "
          "| server + Postgres CPU ms per answered request |")
    print("|---|---|---|---|---|---|")
    for level in levels:
        per = level.cpu_ms_per_answer()
        print(f"| {level.processes} | {level.agents} | {level.server_cores:.2f} | {level.postgres_cores:.2f} "
              f"| {level.client_cores:.2f} | {'-' if per is None else f'{per:.1f}'} |")
    print()
    for count in processes:
        mine = [lv for lv in levels if lv.processes == count]
        knee = next((lv for lv in mine if lv.misses()), None)
        if knee is None:
            print(f"knee, {count} process(es): not reached up to {mine[-1].agents} agents")
        else:
            below = [lv.agents for lv in mine if lv.agents < knee.agents]
            print(f"knee, {count} process(es): between {below[-1] if below else 0} and {knee.agents} agents "
                  f"({'; '.join(knee.misses())})")
    if len(processes) >= 2:
        first, other = processes[0], processes[1]
        print()
        print(f"| agents | route | answered /s, {other} vs {first} | p99, {other} vs {first} |")
        print("|---|---|---|---|")
        for level in [lv for lv in levels if lv.processes == first]:
            twin = next(lv for lv in levels if lv.processes == other and lv.agents == level.agents)
            for route in ROUTES:
                rate = twin.answered_per_s(route) / level.answered_per_s(route) if level.answered_per_s(route) else None
                a, b = level.p(route, 0.99), twin.p(route, 0.99)
                p99 = b / a if a and b else None
                print(f"| {level.agents} | {route} | {'-' if rate is None else f'{rate:.2f}'} "
                      f"| {'-' if p99 is None else f'{p99:.2f}'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="100,300,1000", help="agents at each level, rising (default 100,300,1000)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each level (default 20)")
    parser.add_argument("--processes", default="1,2", help="API processes to compare (default 1,2)")
    parser.add_argument("--runs", type=int, default=10, help="runs whose pages the users poll (default 10)")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/15", help="Redis for orders (flushed by no one)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        _client_process(args.client, json.loads(sys.stdin.read()))
        return
    levels = sorted(int(n) for n in args.levels.split(","))
    processes = [int(p) for p in args.processes.split(",")]
    if min(levels) < 1 or min(processes) < 1:
        raise SystemExit("--levels and --processes take positive numbers")

    name = f"hybridtrain_load_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(POSTGRES, autocommit=True) as admin_db:
        admin_db.execute(f'CREATE DATABASE "{name}"')
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    results: list[Level] = []
    recoveries: list[Recovery] = []
    server: Server | None = None
    try:
        fleet: Fleet | None = None
        cookies: dict[str, str] = {}
        for count in processes:
            server = Server(database_url, args.broker, count)
            if fleet is None:
                started = time.monotonic()
                fleet = asyncio.run(_declare(server.base, max(levels), args.runs))
                cookies = _sign_in(server.base, fleet.read_token)
                print(f"declared {max(levels)} nodes and {args.runs} runs in {time.monotonic() - started:.0f} s",
                      file=sys.stderr)
            # Warm-up, not reported: each process's first requests compile templates and fill caches.
            _run_level(server, fleet, cookies, count, levels[0], WARM_UP_S, lead_s=0.0)
            idle_mb = _rss_mb(server.process.pid)
            for agents in levels:
                level = _run_level(server, fleet, cookies, count, agents, args.seconds)
                print(f"{count} process(es), {agents} agents: {', '.join(level.misses()) or 'all targets met'}",
                      file=sys.stderr)
                results.append(level)
            recoveries.append(_recovery(server, fleet, cookies, count, idle_mb))
            server.stop()
            server = None
        _report(results, processes)
        _report_recovery(recoveries)
    finally:
        if server is not None:
            server.stop()
        _drop(name)


def _drop(name: str) -> None:
    """Drop the scratch database; a server just stopped may still be closing its connections."""
    for attempt in range(10):
        try:
            with psycopg.connect(POSTGRES, autocommit=True) as admin_db:
                admin_db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            return
        except psycopg.errors.ObjectInUse:
            if attempt == 9:
                raise
            time.sleep(2)


if __name__ == "__main__":
    main()
