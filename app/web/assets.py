"""Static files of the dashboard: our CSS and JS under /static, and the plotly package's own
plotly.min.js, served from the installed package so no page ever reaches a CDN.

URLs carry a content hash (`?v=...`), so browsers may cache every asset for a year.
"""

from __future__ import annotations

import gzip
import hashlib
from functools import lru_cache
from pathlib import Path

import plotly
from fastapi import APIRouter, FastAPI, Request
from fastapi.staticfiles import StaticFiles
from starlette.responses import Response

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"
STATIC_PREFIX = "/static"
PLOTLY_URL = f"{STATIC_PREFIX}/vendor/plotly.min.js"
_YEAR = "public, max-age=31536000, immutable"


def plotly_js_path() -> Path:
    """The plotly.min.js bundled in the installed plotly package."""
    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"plotly.min.js is not in the installed plotly package ({path})")
    return path


@lru_cache(maxsize=1)
def _plotly_bundle() -> tuple[bytes, bytes, str]:
    # 4.8 MB raw, ~1.4 MB gzipped: compress once per process, not per request.
    raw = plotly_js_path().read_bytes()
    return raw, gzip.compress(raw, compresslevel=6, mtime=0), hashlib.sha256(raw).hexdigest()[:16]


@lru_cache(maxsize=256)
def _file_version(relative: str) -> str:
    path = STATIC_DIR / relative
    return hashlib.sha256(path.read_bytes()).hexdigest()[:10] if path.is_file() else "missing"


def static_url(relative: str) -> str:
    """The cache-busting URL of a file in static/ (or of plotly.min.js for 'plotly.min.js')."""
    if relative == "plotly.min.js":
        return f"{PLOTLY_URL}?v={plotly.__version__}"
    return f"{STATIC_PREFIX}/{relative}?v={_file_version(relative)}"


router = APIRouter()


@router.get(PLOTLY_URL, include_in_schema=False)
def read_plotly_js(request: Request) -> Response:
    """plotly.min.js from the plotly package, gzipped when the browser accepts it."""
    raw, packed, etag = _plotly_bundle()
    headers = {"Cache-Control": _YEAR, "ETag": f'"{etag}"', "Vary": "Accept-Encoding"}
    if request.headers.get("if-none-match") == f'"{etag}"':
        return Response(status_code=304, headers=headers)
    if "gzip" in request.headers.get("accept-encoding", ""):
        headers["Content-Encoding"] = "gzip"
        return Response(packed, media_type="text/javascript", headers=headers)
    return Response(raw, media_type="text/javascript", headers=headers)


class _CachedStaticFiles(StaticFiles):
    """StaticFiles whose answers may be cached for long: every URL we emit is content-versioned."""

    async def get_response(self, path: str, scope):  # type: ignore[no-untyped-def]
        response = await super().get_response(path, scope)
        if response.status_code == 200 and "v=" in scope.get("query_string", b"").decode():
            response.headers["Cache-Control"] = _YEAR
        return response


def mount_static(app: FastAPI) -> None:
    """Serve plotly.min.js and static/ (the plotly route first: it lies under the mount)."""
    app.include_router(router)
    app.mount(STATIC_PREFIX, _CachedStaticFiles(directory=STATIC_DIR), name="static")
