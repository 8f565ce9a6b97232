"""Prometheus metrics of the control plane (`GET /metrics`, docs/deploy.md "Monitoring").

Two sources make one scrape: the app's own registry, with what this process counted since it
started (requests by route template, their latency, metric records ingested), and
`DatabaseCollector`, which reads runs, nodes and live runs' training figures from the
database at scrape time, so every replica of the control plane reports the same state.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator

from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.routes.run_metrics import ingest_metrics
from app.queries import telemetry as queries

logger = logging.getLogger(__name__)

# A request no route matched (a 404 for a made-up path) gets this label, not its path: raw
# paths would let any client create series without bound.
UNMATCHED_ROUTE = "<unmatched>"
# Answers of the ingestion route are small JSON objects; anything larger is not one of them.
_INGEST_BODY_LIMIT = 4096


class Telemetry:
    """The app's own registry: one per app, so several apps in one process (tests) never mix."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "hybridtrain_http_requests", "HTTP requests answered, by method, route template and status.",
            ["method", "route", "status"], registry=self.registry,
        )
        self.latency = Histogram(
            "hybridtrain_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by method and route template.",
            ["method", "route"], registry=self.registry,
        )
        self.records_received = Counter(
            "hybridtrain_metric_records_received",
            "Trainer records received by POST /api/v1/runs/{run_id}/metrics in accepted batches.",
            registry=self.registry,
        )
        self.records_stored = Counter(
            "hybridtrain_metric_records_stored",
            "Trainer records stored (received less re-deliveries of records already stored).",
            registry=self.registry,
        )

    def exposition(self, session: Session) -> bytes:
        """This process's counters and the database's gauges, in Prometheus text format."""
        return generate_latest(_Chain(self.registry, DatabaseCollector(session)))

    def count_ingested(self, body: bytes) -> None:
        """Count the records of an accepted ingestion from its answer, `{"received", "stored"}`."""
        try:
            answer = json.loads(body)
            received, stored = int(answer["received"]), int(answer["stored"])
        except (ValueError, KeyError, TypeError):
            logger.warning("an ingestion answer without record counts: %.200r", body)
            return
        self.records_received.inc(received)
        self.records_stored.inc(stored)


class _Chain:
    """Collectors read one after the other, as one registry would."""

    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


class DatabaseCollector:
    """Gauges read from the database at scrape time through `session` (read-only)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def collect(self) -> Iterable[Metric]:
        """Runs and nodes by state, the launch queue and live runs' figures; when the database
        fails, only `hybridtrain_database_up 0` (the scrape itself still succeeds)."""
        up = GaugeMetricFamily(
            "hybridtrain_database_up", "1 when the database answered this scrape's queries, else 0."
        )
        try:
            families = list(self._families())
        except SQLAlchemyError as exc:
            self.session.rollback()
            logger.warning("/metrics could not read the database: %s", exc)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *families]

    def _families(self) -> Iterator[Metric]:
        runs = queries.runs_by_status(self.session)
        by_state = GaugeMetricFamily(
            "hybridtrain_runs", "Runs in each state (every state, finished ones included).",
            labels=["state"],
        )
        for state, count in runs.items():
            by_state.add_metric([state.value], count)
        yield by_state
        yield GaugeMetricFamily(
            "hybridtrain_launch_queue_length",
            "Runs waiting to train: queued (orders not sent yet) or launching (ranks not all started).",
            value=sum(runs[state] for state in queries.LAUNCH_QUEUE_STATUSES),
        )
        nodes = GaugeMetricFamily("hybridtrain_nodes", "Nodes in each state.", labels=["status"])
        for status, count in queries.nodes_by_status(self.session).items():
            nodes.add_metric([status.value], count)
        yield nodes
        yield from _gpu_families(queries.live_gpu_figures(self.session))
        yield from _rank_families(queries.running_rank_figures(self.session))
        yield from _run_families(queries.live_runs(self.session))


def _gpu_families(figures: list[queries.GpuFigures]) -> Iterator[Metric]:
    labels = ["node", "gpu", "model"]
    utilization = GaugeMetricFamily(
        "hybridtrain_node_gpu_utilization_ratio",
        "Share of the last sample period a GPU was busy (NVML, at the node's last heartbeat).", labels=labels,
    )
    used = GaugeMetricFamily("hybridtrain_node_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=labels)
    total = GaugeMetricFamily("hybridtrain_node_gpu_memory_total_bytes", "GPU memory (NVML).", labels=labels)
    for f in figures:
        values = [f.node, str(f.gpu), f.model]
        utilization.add_metric(values, f.utilization)
        used.add_metric(values, f.memory_used_bytes)
        total.add_metric(values, f.memory_total_bytes)
    yield from (utilization, used, total)


def _rank_families(figures: list[queries.RankFigures]) -> Iterator[Metric]:
    labels = ["run_id", "rank", "role", "node"]
    throughput = GaugeMetricFamily(
        "hybridtrain_run_samples_per_second",
        "Samples per second of a running rank at its latest reported step.", labels=labels,
    )
    step = GaugeMetricFamily(
        "hybridtrain_run_step_seconds",
        "Wall time of a running rank's latest reported step (its batch over its samples/s).",
        labels=labels,
    )
    for f in figures:
        values = [str(f.run_id), str(f.rank), f.role, f.node]
        if f.samples_per_s is not None:
            throughput.add_metric(values, f.samples_per_s)
        if f.step_s is not None:
            step.add_metric(values, f.step_s)
    yield throughput
    yield step


def _run_families(runs: list[queries.LiveRun]) -> Iterator[Metric]:
    info = GaugeMetricFamily(
        "hybridtrain_run_info", "A live run's name and strategy (always 1), to join on run_id.",
        labels=["run_id", "run_name", "strategy"],
    )
    link = CounterMetricFamily(
        "hybridtrain_run_link_bytes",
        "Bytes a live run's ranks on src_node sent to its ranks on dst_node so far.",
        labels=["run_id", "src_node", "dst_node"],
    )
    egress = GaugeMetricFamily(
        "hybridtrain_run_egress_usd", "Egress cost of a live run so far, in US dollars.",
        labels=["run_id"],
    )
    compute = GaugeMetricFamily(
        "hybridtrain_run_compute_usd", "Compute cost of a live run so far, in US dollars.",
        labels=["run_id"],
    )
    for run in runs:
        run_id = str(run.run_id)
        info.add_metric([run_id, run.name, run.strategy], 1)
        for (src, dst), total in sorted(run.link_bytes.items()):
            link.add_metric([run_id, src, dst], total)
        if run.egress_usd is not None and run.compute_usd is not None:
            egress.add_metric([run_id], float(run.egress_usd))
            compute.add_metric([run_id], float(run.compute_usd))
    yield from (info, link, egress, compute)


class RouteTemplates:
    """The full path template (`/api/v1/runs/{run_id}`) of the route a request matched.

    FastAPI puts the matched route in the scope as it was declared, with its path relative to
    its router's prefix; the full templates come from the app's route contexts, indexed once.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._by_route: dict[int, list[tuple[str, re.Pattern[str]]]] | None = None

    def _index(self) -> dict[int, list[tuple[str, re.Pattern[str]]]]:
        index: dict[int, list[tuple[str, re.Pattern[str]]]] = {}
        for context in iter_route_contexts(getattr(self.app, "routes", [])):
            if context.path is not None:
                index.setdefault(id(context.original_route), []).append(
                    (context.path, compile_path(context.path)[0])
                )
        return index

    def template(self, scope: Scope) -> str:
        """The template of `scope`'s matched route; UNMATCHED_ROUTE when none matched."""
        route = scope.get("route")
        if route is None:
            return UNMATCHED_ROUTE
        if self._by_route is None or id(route) not in self._by_route:
            self._by_route = self._index()  # first request, or a route added since
        candidates = self._by_route.get(id(route))
        if not candidates:
            return getattr(route, "path", None) or UNMATCHED_ROUTE
        if len(candidates) > 1:
            # One router included under two prefixes: the path tells which one answered.
            for template, regex in candidates:
                if regex.match(scope.get("path", "")):
                    return template
        return candidates[0][0]


class RequestMetricsMiddleware:
    """Counts every HTTP request and times it, labelled by route template; counts the records
    of accepted metric batches from the ingestion route's answer.

    Ingestion is counted here, around the route, rather than where records are stored:
    `app.queries.metrics` stays free of telemetry, and the answer already says how many
    records a batch carried and how many were new.
    """

    def __init__(self, app: ASGIApp, telemetry: Telemetry, routes: RouteTemplates) -> None:
        self.app = app
        self.telemetry = telemetry
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering
        ingest_body: bytearray | None = None

        async def send_and_watch(message: Message) -> None:
            nonlocal status, ingest_body
            if message["type"] == "http.response.start":
                status = message["status"]
                if status == 200 and _is_ingestion(scope):
                    ingest_body = bytearray()
            elif message["type"] == "http.response.body" and ingest_body is not None:
                ingest_body += message.get("body", b"")
                if len(ingest_body) > _INGEST_BODY_LIMIT:
                    ingest_body = None
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = self.routes.template(scope)
            method = scope["method"]
            self.telemetry.requests.labels(method, route, str(status)).inc()
            self.telemetry.latency.labels(method, route).observe(time.perf_counter() - start)
            if ingest_body is not None:
                self.telemetry.count_ingested(bytes(ingest_body))


def _is_ingestion(scope: Scope) -> bool:
    return scope.get("method") == "POST" and getattr(scope.get("route"), "endpoint", None) is ingest_metrics


def install_telemetry(app: FastAPI) -> Telemetry:
    """Give `app` its registry (`app.state.telemetry`) and the middleware that feeds it."""
    telemetry = Telemetry()
    app.state.telemetry = telemetry
    app.add_middleware(RequestMetricsMiddleware, telemetry=telemetry, routes=RouteTemplates(app))
    return telemetry
