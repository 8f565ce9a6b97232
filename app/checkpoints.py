"""The checkpoint store: the trainer uploads one file per checkpoint step, a restarted server
reads the latest back. Bytes are kept in the database or, with `checkpoint_dir`, as files
(shared between control-plane hosts, so a server restarted on another node finds them).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.bundles import Upload, write_atomically
from app.errors import HybridtrainError, NotFoundError
from app.models.checkpoints import CheckpointStorage, RunCheckpoint

# Checkpoints kept per run: the newest, and the one before in case the newest is unreadable.
KEPT = 2


class CheckpointTooLargeError(HybridtrainError):
    """The upload is larger than `checkpoint_max_bytes` (answered 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"body: the checkpoint is larger than the limit of {limit} bytes "
            "(HYBRIDTRAIN_CHECKPOINT_MAX_BYTES)"
        )
        self.limit = limit


class DigestMismatchError(HybridtrainError):
    """The bytes do not have the sha256 the uploader declared (answered 400)."""


def checkpoint_path(checkpoint_dir: Path, run_id: int, step: int) -> Path:
    """Where a checkpoint kept as a file lies."""
    return checkpoint_dir / f"run-{run_id}" / f"step-{step:012d}.ckpt"


def store(
    session: Session, *, run_id: int, step: int, upload: Upload, checkpoint_dir: Path | None
) -> tuple[RunCheckpoint, list[Path]]:
    """Keep the upload as the run's checkpoint at `step` (replacing one of the same step) and
    drop all but the newest `KEPT`; returns the row and the files to remove after commit."""
    if upload.declared_sha256 is None or upload.declared_sha256.strip().lower() != upload.sha256:
        raise DigestMismatchError(
            f"X-Content-Sha256: declared {(upload.declared_sha256 or '')[:64]!r}, "
            f"the body is {upload.sha256}"
        )
    row = session.scalar(select(RunCheckpoint).where(RunCheckpoint.run_id == run_id, RunCheckpoint.step == step))
    if row is None:
        row = RunCheckpoint(run_id=run_id, step=step)
        session.add(row)
    row.size_bytes, row.sha256 = upload.size, upload.sha256
    upload.file.seek(0)
    if checkpoint_dir is None:
        row.stored_in, row.content = CheckpointStorage.db, upload.file.read()
    else:
        row.stored_in, row.content = CheckpointStorage.dir, None
        write_atomically(checkpoint_path(checkpoint_dir, run_id, step), upload.file)
    session.flush()
    rows = session.scalars(
        select(RunCheckpoint).where(RunCheckpoint.run_id == run_id).order_by(RunCheckpoint.step.desc())
    ).all()
    removed = []
    for old in rows[KEPT:]:
        if old.stored_in == CheckpointStorage.dir and checkpoint_dir is not None:
            removed.append(checkpoint_path(checkpoint_dir, run_id, old.step))
        session.delete(old)
    session.flush()
    return row, removed


def latest(session: Session, *, run_id: int) -> RunCheckpoint:
    """The run's newest checkpoint; NotFoundError when it has none."""
    row = session.scalar(
        select(RunCheckpoint).where(RunCheckpoint.run_id == run_id)
        .order_by(RunCheckpoint.step.desc()).limit(1)
    )
    if row is None:
        raise NotFoundError("checkpoint of run", run_id)
    return row


def content(session: Session, *, row: RunCheckpoint, checkpoint_dir: Path | None) -> bytes | Path:
    """The checkpoint's bytes (kept in the database) or the path of its file."""
    if row.stored_in == CheckpointStorage.dir:
        path = checkpoint_path(checkpoint_dir, row.run_id, row.step) if checkpoint_dir else None
        if path is None or not path.is_file():
            raise NotFoundError("file of the checkpoint of run", row.run_id)
        return path
    data = session.scalar(select(RunCheckpoint.content).where(RunCheckpoint.id == row.id))
    if data is None:
        raise NotFoundError("checkpoint of run", row.run_id)
    return data


def remove_files(paths: list[Path]) -> None:
    """Remove the files of dropped checkpoints (after the commit that dropped their rows)."""
    for path in paths:
        path.unlink(missing_ok=True)
