"""Data sets: registered by URL, listed, shown and deleted (409 while a run reads one)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from app.api.deps import CiDep, PaginationDep, ReadDep, SessionDep, SettingsDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.queries import datasets as queries
from app.schemas.common import Page
from app.schemas.datasets import DatasetCreate, DatasetPublic
from hybridtrain.data_access import DATASET_NAME

router = APIRouter()

NamePath = Annotated[str, Path(max_length=128, pattern=DATASET_NAME.pattern, description="the data set's name")]


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
def delete_dataset(session: SessionDep, _: CiDep, name: NamePath) -> None:
    """Forget a data set (its store's files stay); 409 while a queued or running run reads it."""
    queries.delete_dataset(session, name=name)
    session.commit()
