"""A run's checkpoint store: the trainer uploads each checkpoint with the run's token and a
restarted server downloads the latest (docs/architecture.md, "Checkpoints")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from app import checkpoints as store
from app.api.deps import IdPath, MetricsTokenDep, SessionDep, SettingsDep, get_principal
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.bundles import BundleTooLargeError, Upload, iter_file, spool_stream
from app.lifecycle import run_state_lock
from app.models import TokenScope
from app.queries.metrics import metrics_token_valid
from app.queries.runs import get_run
from app.schemas.checkpoints import CheckpointPublic
from app.schemas.common import ErrorMessage
from hybridtrain.contract import SHA256

router = APIRouter()

OCTETS = "application/octet-stream"
UPLOAD_ANSWERS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorMessage, "description": "The body's sha256 is not X-Content-Sha256"},
    413: {"model": ErrorMessage, "description": "The checkpoint is larger than checkpoint_max_bytes"},
}
DOWNLOAD: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}},
        "description": "The newest checkpoint; headers X-Checkpoint-Step and X-Content-Sha256",
    },
}
ContentSha256 = Annotated[
    str, Header(alias="X-Content-Sha256", pattern=SHA256.pattern, description="sha256 of the body, hex")
]


def _unauthorized() -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, "not this run's token",
                         headers={"WWW-Authenticate": "Bearer"})


def checked_run_token(session: SessionDep, settings: SettingsDep, token: MetricsTokenDep, run_id: IdPath) -> str:
    """The run's own token, checked before a byte of the upload is read; 401 otherwise."""
    if not metrics_token_valid(session, run_id=run_id, token=token, secret_key=settings.secret_key):
        raise _unauthorized()
    return token


RunTokenDep = Annotated[str, Depends(checked_run_token)]


async def read_checkpoint(
    _: RunTokenDep, request: Request, settings: SettingsDep, digest: ContentSha256,
) -> AsyncIterator[Upload]:
    """The uploaded checkpoint, read within the size limit once the run's token is checked."""
    limit = settings.checkpoint_max_bytes
    length = request.headers.get("content-length")
    too_large = HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, store.CheckpointTooLargeError(limit).message)
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    try:
        upload = await spool_stream(request.stream(), limit=limit, declared_sha256=digest)
    except BundleTooLargeError:
        raise too_large from None
    try:
        yield upload
    finally:
        upload.close()


@router.put(
    "/{run_id}/checkpoint",
    response_model=CheckpointPublic,
    status_code=status.HTTP_201_CREATED,
    responses={**UPLOAD_ANSWERS, **NOT_FOUND_OR_CONFLICT},
    openapi_extra={"requestBody": {"required": True, "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}}},
)
def upload_checkpoint(
    session: SessionDep,
    settings: SettingsDep,
    _: RunTokenDep,
    run_id: IdPath,
    step: Annotated[int, Query(ge=0, le=2**31 - 1, description="the training step it holds")],
    upload: Annotated[Upload, Depends(read_checkpoint)],
) -> CheckpointPublic:
    """Store a checkpoint of an active run (the run's token); the newest two are kept."""
    with run_state_lock(settings.is_sqlite):
        run = get_run(session, run_id=run_id, lock=True)
        if run.status.over:
            # A cancelling run is over too: nothing will resume from its checkpoint.
            raise HTTPException(status.HTTP_409_CONFLICT, f"run {run_id} is {run.status}: no more checkpoints")
        try:
            row, removed = store.store(session, run_id=run_id, step=step, upload=upload,
                                       checkpoint_dir=settings.checkpoint_dir)
        except store.DigestMismatchError as exc:
            raise HTTPException(status.HTTP_400_BAD_REQUEST, exc.message) from None
        session.commit()
    store.remove_files(removed)
    return CheckpointPublic.model_validate(row)


@router.get("/{run_id}/checkpoint", response_class=Response, responses={**DOWNLOAD, **NOT_FOUND})
def download_checkpoint(
    session: SessionDep, settings: SettingsDep, token: MetricsTokenDep, run_id: IdPath,
) -> Response:
    """The run's newest checkpoint, for its restarted server (the run's token) or a user (read)."""
    if not metrics_token_valid(session, run_id=run_id, token=token, secret_key=settings.secret_key):
        principal = get_principal(session, settings, HTTPAuthorizationCredentials(scheme="Bearer", credentials=token))
        if not principal.scope.allows(TokenScope.read):
            raise _unauthorized()
    row = store.latest(session, run_id=run_id)
    data = store.content(session, row=row, checkpoint_dir=settings.checkpoint_dir)
    headers = {"X-Checkpoint-Step": str(row.step), "X-Content-Sha256": row.sha256}
    if isinstance(data, FilePath):
        headers["Content-Length"] = str(data.stat().st_size)
        return StreamingResponse(iter_file(data), media_type=OCTETS, headers=headers)
    return Response(data, media_type=OCTETS, headers=headers)
