"""Clusters: named sets of nodes."""

from __future__ import annotations

from fastapi import APIRouter, status

from app.api.deps import AdminDep, IdPath, IdQuery, PaginationDep, ReadDep, SessionDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.queries import clusters as queries
from app.schemas.clusters import ClusterCreate, ClusterPublic, ClusterUpdate
from app.schemas.common import Page

router = APIRouter()


@router.get("", response_model=Page[ClusterPublic])
def read_clusters(
    session: SessionDep, _: ReadDep, page: PaginationDep, node_id: IdQuery = None
) -> Page[ClusterPublic]:
    """List clusters, or those that contain `node_id`."""
    rows, count = queries.list_clusters(
        session, skip=page.skip, limit=page.limit, node_id=node_id
    )
    return Page(data=[ClusterPublic.model_validate(row) for row in rows], count=count)


@router.post(
    "",
    response_model=ClusterPublic,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_cluster(session: SessionDep, _: AdminDep, body: ClusterCreate) -> ClusterPublic:
    """Group existing nodes into a named cluster."""
    cluster = queries.create_cluster(session, data=body)
    session.commit()
    return ClusterPublic.model_validate(cluster)


@router.get("/{cluster_id}", response_model=ClusterPublic, responses=NOT_FOUND)
def read_cluster(session: SessionDep, _: ReadDep, cluster_id: IdPath) -> ClusterPublic:
    """Show one cluster."""
    return ClusterPublic.model_validate(queries.get_cluster(session, cluster_id=cluster_id))


@router.patch("/{cluster_id}", response_model=ClusterPublic, responses=NOT_FOUND_OR_CONFLICT)
def update_cluster(
    session: SessionDep, _: AdminDep, cluster_id: IdPath, body: ClusterUpdate
) -> ClusterPublic:
    """Rename a cluster or replace its nodes."""
    cluster = queries.update_cluster(session, cluster_id=cluster_id, data=body)
    session.commit()
    return ClusterPublic.model_validate(cluster)


@router.delete("/{cluster_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_cluster(session: SessionDep, _: AdminDep, cluster_id: IdPath) -> None:
    """Remove a cluster (its nodes stay)."""
    queries.delete_cluster(session, cluster_id=cluster_id)
    session.commit()
