"""Task profiles: a task's speed measured on nodes by their agents, for planning runs."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import CiDep, DispatcherDep, IdPath, IdQuery, PaginationDep, ReadDep, SessionDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.queries import profiles as queries
from app.schemas.common import Page
from app.schemas.profiles import ProfileCreate, TaskProfilePublic

log = logging.getLogger(__name__)

router = APIRouter()

TaskKeyQuery = Annotated[
    str | None, Query(pattern=r"^[0-9a-f]{64}$", description="sha256 of the task, its args and bundle")
]


@router.post(
    "",
    response_model=list[TaskProfilePublic],
    status_code=status.HTTP_202_ACCEPTED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_profiles(
    session: SessionDep, principal: CiDep, dispatcher: DispatcherDep, body: ProfileCreate
) -> list[TaskProfilePublic]:
    """Ask each node's agent to measure the task; the profiles start pending."""
    profiles = queries.create_profiles(session, data=body, created_by=principal.name)
    session.commit()
    # Orders go out only after the profiles are committed, so the agent's report finds them.
    try:
        dispatcher.send(queries.profile_orders(profiles))
    except Exception as exc:  # noqa: BLE001 - any broker failure fails the profiles, with its cause
        log.error("could not send profile orders: %s", exc)
        queries.fail_profiles(
            session, profiles=profiles, error=f"could not send the profile order to the broker: {exc}"
        )
        session.commit()
    return [TaskProfilePublic.model_validate(p) for p in profiles]


@router.get("", response_model=Page[TaskProfilePublic])
def read_profiles(
    session: SessionDep, _: ReadDep, page: PaginationDep, task_key: TaskKeyQuery = None,
    node_id: IdQuery = None,
) -> Page[TaskProfilePublic]:
    """List profiles, newest first, filtered by task key and node."""
    rows, count = queries.list_profiles(
        session, skip=page.skip, limit=page.limit, task_key=task_key, node_id=node_id
    )
    return Page(data=[TaskProfilePublic.model_validate(row) for row in rows], count=count)


@router.get("/{profile_id}", response_model=TaskProfilePublic, responses=NOT_FOUND)
def read_profile(session: SessionDep, _: ReadDep, profile_id: IdPath) -> TaskProfilePublic:
    """Show one profile."""
    return TaskProfilePublic.model_validate(queries.get_profile(session, profile_id=profile_id))
