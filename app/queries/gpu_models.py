"""Queries of the GPU catalog."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from app.errors import DuplicateError, InUseError, NotFoundError
from app.models import GpuModel, InstancePrice, NodeGpu
from app.queries.common import apply_changes, paginate
from app.schemas.gpu_models import GpuModelCreate, GpuModelUpdate


def get_gpu_model(session: Session, *, gpu_model_id: int, field: str | None = None) -> GpuModel:
    """The GPU model with this id, or NotFoundError."""
    gpu_model = session.get(GpuModel, gpu_model_id)
    if gpu_model is None:
        raise NotFoundError("GPU model", gpu_model_id, field=field)
    return gpu_model


def gpu_models_by_name(session: Session, *, names: Iterable[str]) -> dict[str, GpuModel]:
    """The catalog entries among `names`, keyed by name (missing names are left out)."""
    wanted = set(names)
    if not wanted:
        return {}
    rows = session.scalars(select(GpuModel).where(GpuModel.name.in_(wanted)))
    return {row.name: row for row in rows}


def list_gpu_models(
    session: Session, *, skip: int, limit: int, vendor: str | None = None
) -> tuple[Sequence[GpuModel], int]:
    """A page of the catalog, ordered by id."""
    stmt = select(GpuModel).order_by(GpuModel.id)
    if vendor is not None:
        stmt = stmt.where(GpuModel.vendor == vendor)
    return paginate(session, stmt, skip=skip, limit=limit)


def _check_name_free(session: Session, name: str, *, except_id: int | None = None) -> None:
    clash = session.scalar(select(GpuModel.id).where(GpuModel.name == name))
    if clash is not None and clash != except_id:
        raise DuplicateError("GPU model", "name", name)


def create_gpu_model(session: Session, *, data: GpuModelCreate) -> GpuModel:
    """Add a user-defined GPU model to the catalog."""
    _check_name_free(session, data.name)
    gpu_model = GpuModel(**data.model_dump(), seeded=False)
    session.add(gpu_model)
    session.flush()
    return gpu_model


def update_gpu_model(session: Session, *, gpu_model_id: int, data: GpuModelUpdate) -> GpuModel:
    """Change some fields of a catalog entry."""
    gpu_model = get_gpu_model(session, gpu_model_id=gpu_model_id)
    changes = data.model_dump(exclude_unset=True)
    if changes.get("name") is not None:
        _check_name_free(session, changes["name"], except_id=gpu_model.id)
    apply_changes(gpu_model, changes, nullable={"form_factor"})
    session.flush()
    return gpu_model


def delete_gpu_model(session: Session, *, gpu_model_id: int) -> None:
    """Remove a catalog entry that no node and no price refers to."""
    gpu_model = get_gpu_model(session, gpu_model_id=gpu_model_id)
    if session.scalar(select(exists().where(NodeGpu.gpu_model_id == gpu_model.id))):
        raise InUseError(f"GPU model {gpu_model.id} is declared by nodes; change them first")
    if session.scalar(select(exists().where(InstancePrice.gpu_model_id == gpu_model.id))):
        raise InUseError(f"GPU model {gpu_model.id} has instance prices, which bills refer to")
    session.delete(gpu_model)
    session.flush()
