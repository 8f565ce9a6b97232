"""GPU models: the catalog of GPUs and their peak throughput."""

from __future__ import annotations

from fastapi import APIRouter, status

from app.api.deps import AdminDep, IdPath, PaginationDep, ReadDep, SessionDep, TextQuery
from app.api.responses import CONFLICT, NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.queries import gpu_models as queries
from app.schemas.common import Page
from app.schemas.gpu_models import GpuModelCreate, GpuModelPublic, GpuModelUpdate

router = APIRouter()


@router.get("", response_model=Page[GpuModelPublic])
def read_gpu_models(
    session: SessionDep, _: ReadDep, page: PaginationDep, vendor: TextQuery = None
) -> Page[GpuModelPublic]:
    """List the catalog, seeded entries first."""
    rows, count = queries.list_gpu_models(
        session, skip=page.skip, limit=page.limit, vendor=vendor
    )
    return Page(data=[GpuModelPublic.model_validate(row) for row in rows], count=count)


@router.post(
    "", response_model=GpuModelPublic, status_code=status.HTTP_201_CREATED, responses=CONFLICT
)
def create_gpu_model(session: SessionDep, _: AdminDep, body: GpuModelCreate) -> GpuModelPublic:
    """Add a GPU model of your own."""
    gpu_model = queries.create_gpu_model(session, data=body)
    session.commit()
    return GpuModelPublic.model_validate(gpu_model)


@router.get("/{gpu_model_id}", response_model=GpuModelPublic, responses=NOT_FOUND)
def read_gpu_model(session: SessionDep, _: ReadDep, gpu_model_id: IdPath) -> GpuModelPublic:
    """Show one GPU model."""
    return GpuModelPublic.model_validate(queries.get_gpu_model(session, gpu_model_id=gpu_model_id))


@router.patch("/{gpu_model_id}", response_model=GpuModelPublic, responses=NOT_FOUND_OR_CONFLICT)
def update_gpu_model(
    session: SessionDep, _: AdminDep, gpu_model_id: IdPath, body: GpuModelUpdate
) -> GpuModelPublic:
    """Change some fields of a GPU model."""
    gpu_model = queries.update_gpu_model(session, gpu_model_id=gpu_model_id, data=body)
    session.commit()
    return GpuModelPublic.model_validate(gpu_model)


@router.delete(
    "/{gpu_model_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT
)
def delete_gpu_model(session: SessionDep, _: AdminDep, gpu_model_id: IdPath) -> None:
    """Remove a GPU model; 409 while nodes or prices refer to it."""
    queries.delete_gpu_model(session, gpu_model_id=gpu_model_id)
    session.commit()
