"""Limits a request body meets before any handler works on it (docs/control-plane.md, "Limits").

- **Size, per route, while reading**: a JSON or form body at most `json_max_bytes`; the agents'
  reports and trainers' metrics `report_max_bytes`; bundles (API and launch form) and
  checkpoints their configured limits. A declared Content-Length above the limit is refused
  before a byte is read, a chunked body as soon as it passes the limit: 413 either way.

Authentication of the large uploads happens in their dependencies, before they read the body
(app/api/routes/checkpoints.py, bundles.py).
"""

from __future__ import annotations

import re

from starlette.middleware.body_limit import RequestBodyLimitResponder
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import Settings

# Room for a multipart body's boundaries and part headers on top of the archive itself.
MULTIPART_OVERHEAD = 64 * 1024
_REPORT_PATH = re.compile(r"^/api/v1/(agent/.*|runs/[^/]+/metrics)$")
_BUNDLE_PATHS = re.compile(r"^(/api/v1/bundles/?|/runs)$")
_CHECKPOINT_PATH = re.compile(r"^/api/v1/runs/[^/]+/checkpoint$")


def body_limit(settings: Settings, method: str, path: str) -> int:
    """The most bytes the body of `method path` may have."""
    if method == "PUT" and _CHECKPOINT_PATH.match(path):
        return settings.checkpoint_max_bytes
    if method == "POST" and _BUNDLE_PATHS.match(path):
        return settings.bundle_max_bytes + MULTIPART_OVERHEAD
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
        limit = body_limit(self.settings, scope["method"], scope["path"])
        await RequestBodyLimitResponder(self.app, limit)(scope, receive, send)
