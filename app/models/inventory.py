"""Inventory models: GPU models, sites, the nodes in them and clusters of nodes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    CheckConstraint,
    Column,
    JSON,
    ForeignKey,
    Index,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, TimestampMixin, str_enum
from app.models.enums import Continent, NodeStatus, Provider, SiteKind

__all__ = ["Cluster", "GpuModel", "Node", "NodeGpu", "Site", "cluster_nodes"]


class GpuModel(TimestampMixin, Base):
    """A kind of GPU with its peak throughput, from the vendor's datasheet or the user."""

    __tablename__ = "gpu_models"
    __table_args__ = (
        CheckConstraint("memory_gb > 0", name="memory_gb_positive"),
        CheckConstraint("fp32_tflops > 0", name="fp32_tflops_positive"),
        CheckConstraint("fp16_tflops > 0", name="fp16_tflops_positive"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    vendor: Mapped[str] = mapped_column(String(32), default="NVIDIA")
    form_factor: Mapped[str | None] = mapped_column(String(32))
    memory_gb: Mapped[float]
    fp32_tflops: Mapped[float]
    # Dense tensor-core FP16 with FP32 accumulate (the mixed-precision training rate).
    fp16_tflops: Mapped[float]
    source: Mapped[str] = mapped_column(Text, default="")
    seeded: Mapped[bool] = mapped_column(default=False)


class Site(TimestampMixin, Base):
    """A place where nodes live: an on-prem room or a cloud provider's region and zone."""

    __tablename__ = "sites"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    kind: Mapped[SiteKind] = mapped_column(str_enum(SiteKind, "kind"))
    provider: Mapped[Provider] = mapped_column(str_enum(Provider, "provider"), index=True)
    region: Mapped[str | None] = mapped_column(String(64))
    zone: Mapped[str | None] = mapped_column(String(64))
    continent: Mapped[Continent] = mapped_column(str_enum(Continent, "continent"))

    nodes: Mapped[list[Node]] = relationship(back_populates="site", passive_deletes="all")


class NodeGpu(Base):
    """How many GPUs of one model a node declares."""

    __tablename__ = "node_gpus"
    __table_args__ = (CheckConstraint("count > 0", name="count_positive"),)

    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_model_id: Mapped[int] = mapped_column(
        ForeignKey("gpu_models.id", ondelete="RESTRICT"), primary_key=True, index=True
    )
    count: Mapped[int]

    gpu_model: Mapped[GpuModel] = relationship(lazy="joined", innerjoin=True)

    @property
    def model(self) -> str:
        """The GPU model's name, as the API shows it."""
        return self.gpu_model.name


cluster_nodes = Table(
    "cluster_nodes",
    Base.metadata,
    Column("cluster_id", ForeignKey("clusters.id", ondelete="CASCADE"), primary_key=True),
    Column("node_id", ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True, index=True),
)


class Node(TimestampMixin, Base):
    """A machine at a site, declared by a user and later joined by its agent."""

    __tablename__ = "nodes"
    __table_args__ = (
        UniqueConstraint("site_id", "name"),
        CheckConstraint("amortised_usd_per_h >= 0", name="amortised_usd_per_h_nonnegative"),
        Index("ix_nodes_status_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="RESTRICT"))
    name: Mapped[str] = mapped_column(String(128))
    address: Mapped[str | None] = mapped_column(String(255))
    instance_type: Mapped[str | None] = mapped_column(String(64))
    spot: Mapped[bool] = mapped_column(default=False)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[NodeStatus] = mapped_column(
        str_enum(NodeStatus, "status"), default=NodeStatus.pending
    )
    last_heartbeat: Mapped[datetime | None]
    # The hourly cost of an owned machine (purchase and power spread over its life).
    amortised_usd_per_h: Mapped[float] = mapped_column(default=0.0, server_default="0")
    # Filled in by the node's agent: what it found on the machine and how fast it trains.
    detected_hardware: Mapped[dict[str, Any] | None]
    measured_samples_per_s: Mapped[float | None]
    # Each GPU's utilisation and memory from NVML, as of the last heartbeat that had them.
    gpu_usage: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    # sha256 of the one-time secret the agent presents to join; the secret is never stored.
    join_token_hash: Mapped[str] = mapped_column(String(64), unique=True)

    site: Mapped[Site] = relationship(back_populates="nodes")
    gpus: Mapped[list[NodeGpu]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True, order_by=NodeGpu.gpu_model_id
    )


class Cluster(TimestampMixin, Base):
    """A named set of nodes that runs are scheduled on."""

    __tablename__ = "clusters"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    description: Mapped[str] = mapped_column(Text, default="")

    nodes: Mapped[list[Node]] = relationship(secondary=cluster_nodes, order_by=Node.id)

    @property
    def node_ids(self) -> list[int]:
        return [node.id for node in self.nodes]
