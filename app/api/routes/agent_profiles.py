"""The agent's side of task profiles: fetch the profile's bundle, report the measurement."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response, status
from sqlalchemy.orm import Session

from app.api.deps import AgentNodeDep, IdPath, SessionDep, SettingsDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.api.routes.bundles import ARCHIVE, archive_response
from app.errors import ConflictError, NotFoundError
from app.models import Node, ProfileStatus, TaskProfile
from app.queries import profiles as queries
from app.queries.bundles import get_bundle
from app.schemas.predictions import ProfileReportFull
from app.schemas.profiles import TaskProfilePublic

router = APIRouter()


def _own_profile(session: Session, profile_id: int, node: Node, *, lock: bool = False) -> TaskProfile:
    try:
        return queries.profile_of_agent(session, profile_id=profile_id, node=node, lock=lock)
    except PermissionError as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None


@router.post("/profiles/{profile_id}", response_model=TaskProfilePublic, responses=NOT_FOUND)
def report_profile(
    session: SessionDep, node: AgentNodeDep, profile_id: IdPath, body: ProfileReportFull
) -> TaskProfilePublic:
    """Store the measurement (or the failure) of a profile ordered from this agent's node."""
    profile = _own_profile(session, profile_id, node, lock=True)
    queries.record_report(session, profile=profile, report=body)
    session.commit()
    return TaskProfilePublic.model_validate(profile)


@router.get(
    "/profiles/{profile_id}/bundle", response_class=Response,
    responses={**ARCHIVE, **NOT_FOUND_OR_CONFLICT},
)
def download_profile_bundle(
    session: SessionDep, node: AgentNodeDep, settings: SettingsDep, profile_id: IdPath
) -> Response:
    """The bundle of a pending profile ordered from this agent's node."""
    profile = _own_profile(session, profile_id, node)
    if profile.bundle_sha256 is None:
        missing = NotFoundError("task profile", profile_id)
        missing.message = f"task profile {profile_id} has no bundle"
        raise missing
    if profile.status is not ProfileStatus.pending:
        raise ConflictError(f"task profile {profile_id} has ended")
    return archive_response(session, get_bundle(session, sha256=profile.bundle_sha256), settings)
