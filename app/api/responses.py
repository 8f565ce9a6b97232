"""Error answers that routes declare in /openapi.json (the bodies are `{"detail": ...}`)."""

from __future__ import annotations

from typing import Any

from app.schemas.common import ErrorMessage

COMMON: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorMessage, "description": "The body is not well-formed JSON"},
    401: {"model": ErrorMessage, "description": "No bearer token, or an unknown one"},
    403: {"model": ErrorMessage, "description": "The token's scope is too small"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorMessage, "description": "An id, in the path or the body, names nothing"},
}
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorMessage, "description": "A duplicate, or the row is still in use"},
}
NOT_FOUND_OR_CONFLICT = NOT_FOUND | CONFLICT
