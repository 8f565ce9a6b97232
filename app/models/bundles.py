"""Bundles of users' code: gzipped tars named by the sha256 of their bytes."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, utcnow

__all__ = ["Bundle", "BundleStorage"]


class BundleStorage:
    """Where a bundle's bytes live: in its row, or as `<bundle_dir>/<sha256>.tar.gz`."""

    db = "db"
    dir = "dir"


class Bundle(Base):
    """An uploaded archive of a user's work dir; runs and profiles refer to it by sha256."""

    __tablename__ = "bundles"
    __table_args__ = (
        CheckConstraint("size_bytes >= 0", name="size_bytes_nonnegative"),
        CheckConstraint("stored_in IN ('db', 'dir')", name="stored_in_known"),
    )

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    filename: Mapped[str | None] = mapped_column(String(255))
    # Regular files in the archive (directories not counted).
    files: Mapped[int]
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Deferred: listings and lookups must never pull megabytes of archive into memory.
    content: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)
    stored_in: Mapped[str] = mapped_column(String(8), default=BundleStorage.db)
