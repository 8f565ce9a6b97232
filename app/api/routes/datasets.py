"""Data sets: registered by URL, listed, shown and deleted (409 while a run reads one)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path as FilePathCls
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request, Response, status
from fastapi.responses import FileResponse
from sqlalchemy import select

from app.api.deps import CiDep, IdPath, MetricsTokenDep, PaginationDep, ReadDep, SessionDep, SettingsDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.errors import ConflictError, NotFoundError
from app.models import Dataset
from app.queries import datasets as queries
from app.queries.metrics import metrics_token_valid
from app.queries.runs import get_run
from app.schemas.common import Page
from app.schemas.datasets import DatasetCreate, DatasetFilePublic, DatasetPublic
from hybridtrain.data_access import DATASET_NAME, SHARD_NAME, STORE_URL

router = APIRouter()
run_router = APIRouter()

NamePath = Annotated[str, Path(max_length=128, pattern=DATASET_NAME.pattern, description="the data set's name")]
FilePath = Annotated[str, Path(max_length=200, pattern=SHARD_NAME.pattern, description="a file of the data set")]
_CHUNK = 1024 * 1024


@router.post("", response_model=DatasetPublic, status_code=status.HTTP_201_CREATED, responses=NOT_FOUND_OR_CONFLICT)
def create_dataset(session: SessionDep, principal: CiDep, settings: SettingsDep, data: DatasetCreate) -> DatasetPublic:
    """Register a data set by URL: its index.json is read now, so a URL the store refuses is a 422."""
    dataset = queries.register_dataset(session, data=data, settings=settings, created_by=principal.name)
    session.commit()
    return DatasetPublic.model_validate(dataset)


@router.get("", response_model=Page[DatasetPublic])
def read_datasets(session: SessionDep, _: ReadDep, page: PaginationDep) -> Page[DatasetPublic]:
    """List data sets by name."""
    rows, count = queries.list_datasets(session, skip=page.skip, limit=page.limit)
    return Page(data=[DatasetPublic.model_validate(row) for row in rows], count=count)


@router.get("/{name}", response_model=DatasetPublic, responses=NOT_FOUND)
def read_dataset(session: SessionDep, _: ReadDep, name: NamePath) -> DatasetPublic:
    """Show one data set."""
    return DatasetPublic.model_validate(queries.get_dataset(session, name=name))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT)
def delete_dataset(session: SessionDep, _: CiDep, settings: SettingsDep, name: NamePath) -> None:
    """Forget a data set (an outside store's files stay; uploaded ones go); 409 while a queued
    or running run reads it."""
    dataset = queries.delete_dataset(session, name=name)
    session.commit()
    if dataset.url == STORE_URL:
        queries.remove_uploaded(settings, name)


@router.put("/{name}/files/{file}", response_model=DatasetFilePublic, status_code=status.HTTP_201_CREATED,
            responses=NOT_FOUND_OR_CONFLICT)
async def upload_dataset_file(request: Request, session: SessionDep, _: CiDep, settings: SettingsDep,
                              name: NamePath, file: FilePath) -> DatasetFilePublic:
    """Upload one file (index.json or a shard) of a data set into the control plane's store;
    register it after with url `store:`. 409 once a data set of that name is registered."""
    if session.scalar(select(Dataset.id).where(Dataset.name == name)) is not None:
        raise ConflictError(f"data set {name!r} is registered: its files no longer change")
    folder = queries.uploaded_folder(settings, name)
    folder.mkdir(parents=True, exist_ok=True)
    limit = settings.dataset_file_max_bytes
    fd, temp = tempfile.mkstemp(dir=folder, prefix=".upload-", suffix=".part")
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HTTPException(status.HTTP_413_CONTENT_TOO_LARGE,
                                        f"file: larger than {limit} bytes (HYBRIDTRAIN_DATASET_FILE_MAX_BYTES)")
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, folder / file)
    finally:
        FilePathCls(temp).unlink(missing_ok=True)
    return DatasetFilePublic(name=file, bytes=size, sha256=digest.hexdigest())


@run_router.get("/{run_id}/datasets/{name}/files/{file}", response_class=Response, responses=NOT_FOUND_OR_CONFLICT)
def download_run_dataset_file(session: SessionDep, token: MetricsTokenDep, settings: SettingsDep,
                              run_id: IdPath, name: NamePath, file: FilePath) -> Response:
    """A file of a data set uploaded here, for the ranks of a run that reads it (the run's own token)."""
    if not metrics_token_valid(session, run_id=run_id, token=token, secret_key=settings.secret_key):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "not this run's token", headers={"WWW-Authenticate": "Bearer"})
    run = get_run(session, run_id=run_id)
    dataset = queries.get_dataset(session, name=name)
    if name not in (run.datasets or []) or dataset.url != STORE_URL:
        raise NotFoundError(f"data set of run {run_id}", name)
    path = queries.uploaded_folder(settings, name) / file
    if not path.is_file():
        raise NotFoundError(f"file of data set {name!r}", file)
    return FileResponse(path, media_type="application/octet-stream")
