"""Queries of clusters."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from app.errors import DuplicateError, NotFoundError
from app.models import Cluster, Node
from app.queries.common import apply_changes, paginate
from app.schemas.clusters import ClusterCreate, ClusterUpdate


def get_cluster(session: Session, *, cluster_id: int) -> Cluster:
    """The cluster with this id (its nodes loaded), or NotFoundError."""
    cluster = session.get(Cluster, cluster_id, options=[selectinload(Cluster.nodes)])
    if cluster is None:
        raise NotFoundError("cluster", cluster_id)
    return cluster


def list_clusters(
    session: Session, *, skip: int, limit: int, node_id: int | None = None
) -> tuple[Sequence[Cluster], int]:
    """A page of clusters (those containing `node_id`, if given), ordered by id."""
    stmt = select(Cluster).options(selectinload(Cluster.nodes)).order_by(Cluster.id)
    if node_id is not None:
        stmt = stmt.where(Cluster.nodes.any(Node.id == node_id))
    return paginate(session, stmt, skip=skip, limit=limit)


def _nodes(session: Session, node_ids: list[int]) -> list[Node]:
    found = {n.id: n for n in session.scalars(select(Node).where(Node.id.in_(node_ids)))}
    for index, node_id in enumerate(node_ids):
        if node_id not in found:
            raise NotFoundError("node", node_id, field=f"node_ids.{index}")
    return [found[node_id] for node_id in node_ids]


def _check_name_free(session: Session, name: str, *, except_id: int | None = None) -> None:
    clash = session.scalar(select(Cluster.id).where(Cluster.name == name))
    if clash is not None and clash != except_id:
        raise DuplicateError("cluster", "name", name)


def create_cluster(session: Session, *, data: ClusterCreate) -> Cluster:
    """Add a cluster of existing nodes."""
    _check_name_free(session, data.name)
    cluster = Cluster(
        name=data.name, description=data.description, nodes=_nodes(session, data.node_ids)
    )
    session.add(cluster)
    session.flush()
    return cluster


def update_cluster(session: Session, *, cluster_id: int, data: ClusterUpdate) -> Cluster:
    """Change a cluster; `node_ids`, when given, replaces its members."""
    cluster = get_cluster(session, cluster_id=cluster_id)
    changes = data.model_dump(exclude_unset=True, exclude={"node_ids"})
    if changes.get("name") is not None:
        _check_name_free(session, changes["name"], except_id=cluster.id)
    if "node_ids" in data.model_fields_set:
        changes["nodes"] = None if data.node_ids is None else _nodes(session, data.node_ids)
    apply_changes(cluster, changes, nullable=())
    session.flush()
    return cluster


def delete_cluster(session: Session, *, cluster_id: int) -> None:
    """Remove a cluster (its nodes stay)."""
    session.delete(get_cluster(session, cluster_id=cluster_id))
    session.flush()
