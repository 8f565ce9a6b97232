"""Admission control: how many requests the control plane works on at once, in which lane, and
the fast 503 for the rest (docs/control-plane.md, "Capacity").

Sync handlers and dependencies run in AnyIO's worker threads, and each request holds a pooled
connection from its first query (the token lookup) to its end. Unbounded, a crowd of requests
takes every connection while the threads they need next are held by others waiting for a
connection: nothing moves until the pool's timeout. Here each lane admits a fixed number of
requests, the pool has a connection for every slot and the thread limiter a thread for every
slot, so an admitted request never waits for either; a request that finds its lane full waits
a bounded time in a bounded queue, then gets 503 with Retry-After.

    lane       routes                                              slots
    heartbeat  POST /api/v1/agent/heartbeat                        heartbeats_admitted, of which
                                                                   heartbeat_slots on the database
    agent      /api/v1/agent/*, POST /api/v1/runs/{id}/metrics     agent_slots
    upload     POST /api/v1/bundles, PUT /api/v1/runs/{id}/checkpoint   upload_slots
    api        everything else (REST, pages, /metrics)            api_slots
    -          /healthz (own engine and thread), /static/*         not admitted

A run page's live stream is admitted in the api lane until its answer starts, then counted
against `max_streams`; its polls share `stream_threads` threads (`stream_limiter`). Heartbeats
are admitted many at once: a plain one waits for its batch without a thread or a connection,
and what works on the database (a batch's write, a beat's full reconciliation) takes one of
`heartbeat_slots` threads (`heartbeat_limiter`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_AGENT_PATH = re.compile(r"^/api/v1/agent/")
_HEARTBEAT_PATH = re.compile(r"^/api/v1/agent/heartbeat/?$")
_RUN_METRICS_PATH = re.compile(r"^/api/v1/runs/[^/]+/metrics$")
_UPLOAD_PATHS = (
    ("POST", re.compile(r"^/api/v1/bundles/?$")),
    ("PUT", re.compile(r"^/api/v1/runs/[^/]+/checkpoint$")),
)
_STREAM_PATH = re.compile(r"^/runs/[^/]+/stream$")
_EXEMPT_PATHS = re.compile(r"^/(healthz|static/.*)$")


def lane_of(method: str, path: str) -> str | None:
    """The lane a request is admitted in; None for those that take no slot."""
    if _EXEMPT_PATHS.match(path):
        return None
    if method == "POST" and _HEARTBEAT_PATH.match(path):
        return "heartbeat"
    if _AGENT_PATH.match(path) or (method == "POST" and _RUN_METRICS_PATH.match(path)):
        return "agent"
    if any(method == m and p.match(path) for m, p in _UPLOAD_PATHS):
        return "upload"
    return "api"


@dataclass
class Lane:
    """A lane's slots and its bounded wait."""

    name: str
    slots: int
    queue: int
    wait_s: float
    semaphore: anyio.Semaphore = field(init=False)
    waiting: int = 0

    def __post_init__(self) -> None:
        self.semaphore = anyio.Semaphore(self.slots)

    async def enter(self) -> bool:
        """Take a slot, waiting within the lane's bounds; False when refused."""
        if self.semaphore.value > 0 and self.waiting == 0:
            await self.semaphore.acquire()
            return True
        if self.waiting >= self.queue:
            return False
        self.waiting += 1
        try:
            with anyio.move_on_after(self.wait_s):
                await self.semaphore.acquire()
                return True
            return False
        finally:
            self.waiting -= 1

    def leave(self) -> None:
        self.semaphore.release()

    def busy(self) -> str:
        return f"{self.slots - self.semaphore.value} of {self.slots} busy, {self.waiting} waiting"


@dataclass
class _Gates:
    """One event loop's lanes (AnyIO primitives belong to the loop that made them)."""

    lanes: dict[str, Lane]
    streams: int = 0
    stream_limiter: anyio.CapacityLimiter | None = None
    heartbeat_limiter: anyio.CapacityLimiter | None = None


_GATES: RunVar[dict[int, _Gates]] = RunVar("hybridtrain_admission")


def _gates(settings: Settings) -> _Gates:
    try:
        per_settings = _GATES.get()
    except LookupError:
        per_settings = {}
        _GATES.set(per_settings)
    gates = per_settings.get(id(settings))
    if gates is None:
        queue, wait = settings.admission_queue, settings.admission_wait_s
        gates = _Gates(lanes={
            "api": Lane("api", settings.api_slots, queue, wait),
            "agent": Lane("agent", settings.agent_slots, queue, wait),
            "heartbeat": Lane("heartbeat", settings.heartbeats_admitted, queue, wait),
            "upload": Lane("upload", settings.upload_slots, queue, wait),
        })
        per_settings[id(settings)] = gates
        # Every admitted request may hold a thread: the limiter has one for each, and spares.
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
    return gates


def stream_limiter(settings: Settings) -> anyio.CapacityLimiter:
    """The threads live streams poll in (each poll holds a connection while it runs)."""
    gates = _gates(settings)
    if gates.stream_limiter is None:
        gates.stream_limiter = anyio.CapacityLimiter(settings.stream_threads)
    return gates.stream_limiter


def heartbeat_limiter(settings: Settings) -> anyio.CapacityLimiter:
    """The threads (each with its connection) heartbeats work on the database in."""
    gates = _gates(settings)
    if gates.heartbeat_limiter is None:
        gates.heartbeat_limiter = anyio.CapacityLimiter(settings.heartbeat_slots)
    return gates.heartbeat_limiter


async def _refuse(send: Send, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({
        "type": "http.response.start",
        "status": 503,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
        ],
    })
    await send({"type": "http.response.body", "body": body})


class AdmissionMiddleware:
    """Admits each HTTP request into its lane or answers 503 with Retry-After."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = lane_of(scope["method"], scope["path"])
        if name is None:
            await self.app(scope, receive, send)
            return
        gates = _gates(self.settings)
        is_stream = name == "api" and bool(_STREAM_PATH.match(scope["path"]))
        if is_stream and gates.streams >= self.settings.max_streams:
            await _refuse(send, f"{gates.streams} live streams are open, the most this server keeps; retry")
            return
        lane = gates.lanes[name]
        if not await lane.enter():
            log.info("refused %s %s: the %s lane is full (%s)", scope["method"], scope["path"], name, lane.busy())
            await _refuse(send, f"the server is at capacity ({name} lane: {lane.busy()}); retry")
            return
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                lane.leave()

        if not is_stream:
            try:
                await self.app(scope, receive, send)
            finally:
                release()
            return
        # A stream keeps its slot until its answer starts; then it is one of the open streams.
        gates.streams += 1
        try:
            await self.app(scope, receive, _releasing_at_start(send, release))
        finally:
            release()
            gates.streams -= 1


def _releasing_at_start(send: Send, release: Callable[[], None]) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            release()
        await send(message)

    return wrapped
