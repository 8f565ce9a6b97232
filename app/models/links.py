"""Links between nodes: what agents measured, and what an admin declared between sites."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Double, ForeignKey, Index, String, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, utcnow

__all__ = ["LinkMeasurement", "SiteLink"]


class LinkMeasurement(Base):
    """One probe from a node to another: the bandwidth and RTT its agent measured."""

    __tablename__ = "link_measurements"
    # link_estimates reads the newest probe of each ordered pair.
    __table_args__ = (
        Index("ix_link_measurements_pair", "src_node_id", "dst_node_id", "measured_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    src_node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    dst_node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    mbps: Mapped[float] = mapped_column(Double)
    rtt_ms: Mapped[float] = mapped_column(Double)
    bytes: Mapped[int] = mapped_column(BigInteger)
    seconds: Mapped[float] = mapped_column(Double)
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)


class SiteLink(Base):
    """A link between two sites as an admin declared it; it applies both ways unless the
    reverse direction is declared too."""

    __tablename__ = "site_links"
    __table_args__ = (UniqueConstraint("src_site_id", "dst_site_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    src_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"))
    dst_site_id: Mapped[int] = mapped_column(ForeignKey("sites.id", ondelete="CASCADE"), index=True)
    mbps: Mapped[float] = mapped_column(Double)
    rtt_ms: Mapped[float] = mapped_column(Double)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
