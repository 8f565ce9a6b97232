"""Queries of bundles (users' code archives)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import ConflictError, InUseError, NotFoundError
from app.models import Bundle, Run
from app.models.runs import ACTIVE_RUN_STATUSES
from app.queries.common import paginate


def get_bundle(session: Session, *, sha256: str, field: str | None = None) -> Bundle:
    """The bundle with this sha256, or NotFoundError (naming `field` when it came in a body)."""
    bundle = session.get(Bundle, sha256)
    if bundle is None:
        raise NotFoundError("bundle", sha256, field=field)
    return bundle


def list_bundles(session: Session, *, skip: int, limit: int) -> tuple[Sequence[Bundle], int]:
    """A page of bundles, newest first."""
    stmt = select(Bundle).order_by(Bundle.created_at.desc(), Bundle.sha256)
    return paginate(session, stmt, skip=skip, limit=limit)


def bundle_in_use_by(session: Session, *, sha256: str) -> int | None:
    """The id of an unfinished run that uses the bundle (None when none does)."""
    return session.scalar(
        select(Run.id).where(Run.bundle_sha256 == sha256, Run.status.in_(ACTIVE_RUN_STATUSES)).limit(1)
    )


def delete_bundle(session: Session, *, sha256: str) -> Bundle:
    """Remove a bundle that no unfinished run uses; the caller removes its file after commit."""
    bundle = get_bundle(session, sha256=sha256)
    run_id = bundle_in_use_by(session, sha256=sha256)
    if run_id is not None:
        raise InUseError(f"bundle {sha256} is used by run {run_id}, which has not finished")
    session.delete(bundle)
    session.flush()
    return bundle


def bundle_of_run(session: Session, *, run_id: int) -> Bundle:
    """The bundle of an active run (NotFoundError without one, ConflictError once it ended)."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError("run", run_id)
    sha256 = run.bundle_sha256
    if sha256 is None:
        missing = NotFoundError("run", run_id)
        missing.message = f"run {run_id} has no bundle"
        raise missing
    if run.status not in ACTIVE_RUN_STATUSES:
        raise ConflictError(f"run {run_id}: the run has ended")
    return get_bundle(session, sha256=sha256)
