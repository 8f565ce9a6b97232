"""Limits a request body meets before any handler works on it (docs/control-plane.md, "Limits").

- **Size, per route, while reading**: a JSON or form body at most `json_max_bytes`; the agents'
  reports and trainers' metrics `report_max_bytes`; bundles (API and launch form) and
  checkpoints their configured limits. A declared Content-Length above the limit is refused
  before a byte is read, a chunked body as soon as it passes the limit: 413 either way.

- **Time**: a JSON or form body, or a report, must arrive whole within `body_timeout_s`, or
  the request gets 408: a client trickling its body holds its admission slot that long at most.

Authentication of the large uploads happens in their dependencies, before they read the body
(app/api/routes/checkpoints.py, bundles.py).
"""

from __future__ import annotations

import re

import anyio
from fastapi import HTTPException

from starlette.middleware.body_limit import RequestBodyLimitResponder
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings

# Room for a multipart body's boundaries and part headers on top of the archive itself.
MULTIPART_OVERHEAD = 64 * 1024
_REPORT_PATH = re.compile(r"^/api/v1/(agent/.*|runs/[^/]+/metrics)$")
_BUNDLE_PATHS = re.compile(r"^(/api/v1/bundles/?|/runs)$")
_CHECKPOINT_PATH = re.compile(r"^/api/v1/runs/[^/]+/checkpoint$")
_DATASET_FILE_PATH = re.compile(r"^/api/v1/datasets/[^/]+/files/[^/]+$")


def is_upload(method: str, path: str) -> bool:
    """Whether `method path` takes a bundle, a checkpoint or a data set's file (held to its
    size, not a time)."""
    return (method == "PUT" and bool(_CHECKPOINT_PATH.match(path) or _DATASET_FILE_PATH.match(path))) or (
        method == "POST" and bool(_BUNDLE_PATHS.match(path)))


def body_limit(settings: Settings, method: str, path: str) -> int:
    """The most bytes the body of `method path` may have."""
    if method == "PUT" and _CHECKPOINT_PATH.match(path):
        return settings.checkpoint_max_bytes
    if method == "POST" and _BUNDLE_PATHS.match(path):
        return settings.bundle_max_bytes + MULTIPART_OVERHEAD
    if method == "PUT" and _DATASET_FILE_PATH.match(path):
        return settings.dataset_file_max_bytes
    if _REPORT_PATH.match(path):
        return settings.report_max_bytes
    return settings.json_max_bytes


class RequestLimitsMiddleware:
    """Applies the route's body size limit while the body is read."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        limit = body_limit(self.settings, method, path)
        if not is_upload(method, path):
            receive = _within(receive, self.settings.body_timeout_s)
        await RequestBodyLimitResponder(self.app, limit)(scope, receive, send)


def _within(receive: Receive, timeout_s: float) -> Receive:
    """`receive` that raises 408 if the body is not whole `timeout_s` after the first call;
    once it is, later calls (waiting for a disconnect) wait as long as they like."""
    deadline: float | None = None
    whole = False

    async def receive_within() -> Message:
        nonlocal deadline, whole
        if whole:
            return await receive()
        if deadline is None:
            deadline = anyio.current_time() + timeout_s
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                whole = True
            return message
        raise HTTPException(408, f"the request body did not arrive within {timeout_s:g} s")

    return receive_within
