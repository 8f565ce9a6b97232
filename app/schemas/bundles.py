"""Schemas of bundles (users' code archives)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import Path

from app.schemas.common import PublicSchema

Sha256Path = Annotated[
    str, Path(pattern=r"^[0-9a-f]{64}$", description="the archive's sha256, lowercase hex")
]


class BundlePublic(PublicSchema):
    sha256: str
    size_bytes: int
    filename: str | None
    files: int
    created_by: str
    created_at: datetime


# The request bodies of POST /bundles, for /openapi.json (the handler reads them itself, so a
# too-large upload is refused while it streams in).
UPLOAD_BODY = {
    "required": True,
    "content": {
        "application/gzip": {"schema": {"type": "string", "format": "binary"}},
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "sha256": {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"},
                },
            }
        },
    },
}
