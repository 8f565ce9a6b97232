"""Checkpoints the trainer uploads: the newest few of each run, so that a restarted server
(on any node) resumes from the latest."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, LargeBinary, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, utcnow

__all__ = ["CheckpointStorage", "RunCheckpoint"]


class CheckpointStorage:
    """Where a checkpoint's bytes live: in its row, or as a file under `checkpoint_dir`."""

    db = "db"
    dir = "dir"


class RunCheckpoint(Base):
    """One uploaded checkpoint of a run at a step; its bytes in `content` or a file."""

    __tablename__ = "run_checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        CheckConstraint("step >= 0", name="step_nonnegative"),
        CheckConstraint("size_bytes >= 0", name="size_bytes_nonnegative"),
        CheckConstraint("stored_in IN ('db', 'dir')", name="stored_in_known"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Deferred: listing a run's checkpoints must not pull their bytes into memory.
    content: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)
    stored_in: Mapped[str] = mapped_column(String(8), default=CheckpointStorage.db)
