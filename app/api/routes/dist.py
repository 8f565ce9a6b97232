"""The agent's wheel for the node page's one-line install (no authentication: it is the
product's own code, the same for every deployment; joining still takes a node's join token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Request, status
from fastapi.responses import Response

from app.agent_wheel import AgentWheel, WheelUnavailable

router = APIRouter()

WHEEL_MEDIA_TYPE = "application/zip"


def get_agent_wheel(request: Request) -> AgentWheel:
    """The wheel the running app hands out."""
    return request.app.state.agent_wheel


AgentWheelDep = Annotated[AgentWheel, Depends(get_agent_wheel)]


@router.get(
    "/dist/{filename}",
    response_class=Response,
    responses={
        200: {"content": {WHEEL_MEDIA_TYPE: {}}, "description": "The wheel"},
        404: {"description": "Not this control plane's wheel; the detail names the one it has"},
        503: {"description": "No wheel can be built here; the detail says what to set"},
    },
)
def read_agent_wheel(filename: Annotated[str, Path(max_length=200)], wheel: AgentWheelDep) -> Response:
    """This control plane's own wheel, for `pip install 'hybridtrain[agent] @ <this URL>'`."""
    if filename != wheel.filename:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"this control plane serves /dist/{wheel.filename}")
    try:
        content = wheel.content()
    except WheelUnavailable as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from exc
    return Response(content, media_type=WHEEL_MEDIA_TYPE,
                    headers={"Content-Disposition": f'attachment; filename="{wheel.filename}"'})
