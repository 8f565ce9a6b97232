"""Bundles: archives of users' code that runs and profiles refer to by sha256.

`router` is mounted under /bundles; `run_router` under /runs, for the trainer's agent to fetch
a run's bundle with the run's own token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request, Response, status
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.formparsers import MultiPartException, MultiPartParser

from app import bundles as storage
from app.api.deps import (
    CiDep,
    IdPath,
    MetricsTokenDep,
    PaginationDep,
    ReadDep,
    SessionDep,
    SettingsDep,
)
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.config import Settings
from app.errors import InvalidFieldError
from app.models import Bundle
from app.queries import bundles as queries
from app.queries.metrics import metrics_token_valid
from app.request_limits import MULTIPART_OVERHEAD
from app.schemas.bundles import UPLOAD_BODY, BundlePublic, Sha256Path
from app.schemas.common import ErrorMessage, Page
from hybridtrain.contract import BUNDLE_MEDIA_TYPE

router = APIRouter()
run_router = APIRouter()

RAW_TYPES = frozenset({BUNDLE_MEDIA_TYPE, "application/x-gzip", "application/octet-stream"})

TOO_LARGE: dict[int | str, dict[str, Any]] = {
    413: {"model": ErrorMessage, "description": "The archive is larger than bundle_max_bytes"},
    415: {"model": ErrorMessage, "description": "Neither application/gzip nor multipart/form-data"},
}
ARCHIVE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {BUNDLE_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "description": "The gzipped tar; header X-Bundle-Sha256 names it",
    },
}


def _too_large(exc: storage.BundleTooLargeError) -> HTTPException:
    return HTTPException(status.HTTP_413_CONTENT_TOO_LARGE, exc.message)


def _check_length(request: Request, limit: int) -> None:
    # Refused before a byte of the body is read, when the client says how long it is.
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(storage.BundleTooLargeError(limit))


async def _read_multipart(request: Request, limit: int) -> storage.Upload:
    _check_length(request, limit + MULTIPART_OVERHEAD)
    received = 0

    async def limited() -> AsyncIterator[bytes]:
        nonlocal received
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit + MULTIPART_OVERHEAD:
                raise storage.BundleTooLargeError(limit)
            yield chunk

    try:
        form = await MultiPartParser(request.headers, limited(), max_files=1, max_fields=4).parse()
    except MultiPartException as exc:
        raise InvalidFieldError("file", f"unreadable multipart body: {exc.message}") from None
    try:
        part = form.get("file")
        if part is None or isinstance(part, str):
            raise InvalidFieldError("file", "the multipart body needs a file field named 'file'")
        declared = form.get("sha256")
        if declared is not None and not isinstance(declared, str):
            raise InvalidFieldError("sha256", "sha256 must be a text field")
        return storage.spool_file(
            part.file, limit=limit, filename=storage.clean_filename(part.filename),
            declared_sha256=declared,
        )
    finally:
        await form.close()


async def read_upload(
    request: Request,
    settings: SettingsDep,
    x_bundle_sha256: Annotated[
        str | None, Header(max_length=128, description="the archive's sha256, verified")
    ] = None,
    x_bundle_filename: Annotated[str | None, Header(max_length=1024)] = None,
) -> AsyncIterator[storage.Upload]:
    """The uploaded archive, read within the size limit, whichever of the two bodies it came in."""
    limit = settings.bundle_max_bytes
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    try:
        if media_type == "multipart/form-data":
            upload = await _read_multipart(request, limit)
        elif media_type in RAW_TYPES:
            _check_length(request, limit)
            upload = await storage.spool_stream(
                request.stream(), limit=limit,
                filename=storage.clean_filename(x_bundle_filename),
                declared_sha256=x_bundle_sha256,
            )
        else:
            raise HTTPException(
                status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
                f"send the archive as {BUNDLE_MEDIA_TYPE} or multipart/form-data, "
                f"not {media_type or 'nothing'!r}",
            )
    except storage.BundleTooLargeError as exc:
        raise _too_large(exc) from None
    try:
        yield upload
    finally:
        upload.close()


UploadDep = Annotated[storage.Upload, Depends(read_upload)]


def _store(
    session: Session, upload: storage.Upload, created_by: str, settings: Settings
) -> tuple[Bundle, bool]:
    existing = session.get(Bundle, upload.sha256)
    if existing is not None:
        return existing, False
    files = storage.count_files(upload.file)
    bundle = storage.store_bundle(
        session, upload=upload, files=files, created_by=created_by, bundle_dir=settings.bundle_dir
    )
    try:
        session.commit()
    except IntegrityError:
        # The same archive, uploaded concurrently, won the race: it is the same bundle.
        session.rollback()
        return queries.get_bundle(session, sha256=upload.sha256), False
    return bundle, True


@router.post(
    "",
    response_model=BundlePublic,
    status_code=status.HTTP_201_CREATED,
    responses={
        **TOO_LARGE,
        200: {"model": BundlePublic, "description": "The archive was already stored"},
    },
    openapi_extra={"requestBody": UPLOAD_BODY},
)
def upload_bundle(
    session: SessionDep, principal: CiDep, settings: SettingsDep, upload: UploadDep,
    response: Response,
) -> BundlePublic:
    """Store a gzipped tar of a work dir (raw application/gzip body, or multipart field `file`)."""
    storage.check_declared_sha256(upload)
    bundle, created = _store(session, upload, principal.name, settings)
    if not created:
        response.status_code = status.HTTP_200_OK
    return BundlePublic.model_validate(bundle)


@router.get("", response_model=Page[BundlePublic])
def read_bundles(session: SessionDep, _: ReadDep, page: PaginationDep) -> Page[BundlePublic]:
    """List bundles, newest first."""
    rows, count = queries.list_bundles(session, skip=page.skip, limit=page.limit)
    return Page(data=[BundlePublic.model_validate(row) for row in rows], count=count)


@router.get("/{sha256}", response_model=BundlePublic, responses=NOT_FOUND)
def read_bundle(session: SessionDep, _: ReadDep, sha256: Sha256Path) -> BundlePublic:
    """Show one bundle."""
    return BundlePublic.model_validate(queries.get_bundle(session, sha256=sha256))


def archive_response(session: Session, bundle: Bundle, settings: Settings) -> Response:
    """The bundle's archive as a download, named by its sha256."""
    content = storage.read_content(session, bundle=bundle, bundle_dir=settings.bundle_dir)
    headers = {
        "X-Bundle-Sha256": bundle.sha256,
        "Content-Disposition": f'attachment; filename="{bundle.sha256}.tar.gz"',
    }
    if isinstance(content, FilePath):
        headers["Content-Length"] = str(content.stat().st_size)
        return StreamingResponse(
            storage.iter_file(content), media_type=BUNDLE_MEDIA_TYPE, headers=headers
        )
    return Response(content, media_type=BUNDLE_MEDIA_TYPE, headers=headers)


@router.get(
    "/{sha256}/archive", response_class=Response, responses={**ARCHIVE, **NOT_FOUND}
)
def download_bundle(
    session: SessionDep, _: ReadDep, settings: SettingsDep, sha256: Sha256Path
) -> Response:
    """Download a bundle's archive."""
    return archive_response(session, queries.get_bundle(session, sha256=sha256), settings)


@router.delete("/{sha256}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT)
def delete_bundle(session: SessionDep, _: CiDep, settings: SettingsDep, sha256: Sha256Path) -> None:
    """Remove a bundle; 409 while a run that has not finished uses it."""
    queries.delete_bundle(session, sha256=sha256)
    session.commit()
    storage.remove_file(settings.bundle_dir, sha256)


@run_router.get(
    "/{run_id}/bundle", response_class=Response, responses={**ARCHIVE, **NOT_FOUND_OR_CONFLICT}
)
def download_run_bundle(
    session: SessionDep, token: MetricsTokenDep, settings: SettingsDep, run_id: IdPath
) -> Response:
    """A run's bundle, for the agents launching its roles (the run's own token; active runs only)."""
    if not metrics_token_valid(session, run_id=run_id, token=token, secret_key=settings.secret_key):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "not this run's token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return archive_response(session, queries.bundle_of_run(session, run_id=run_id), settings)
