"""Price models: hourly instance prices and per-GB egress prices, both versioned in time.

A price row is never rewritten. Each row is one *version* of a price *series* (the series is
identified by its key columns, e.g. provider + region + instance type + GPUs) and is in force
from its `effective_from` until the next version of the same series takes over. An edit adds a
version, so a bill computed for a past run keeps finding the price that was in force then.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, ForeignKey, Index, String, Text, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, utcnow, str_enum
from app.models.enums import Continent, Provider, TrafficClass
from app.models.inventory import GpuModel

__all__ = ["EgressPrice", "InstancePrice"]


class InstancePrice(Base):
    """One version of the hourly price of an instance type in a region, spot and on-demand."""

    __tablename__ = "instance_prices"
    __table_args__ = (
        UniqueConstraint(
            "provider", "region", "instance_type", "gpu_model_id", "gpu_count", "effective_from"
        ),
        CheckConstraint("gpu_count > 0", name="gpu_count_positive"),
        CheckConstraint("on_demand_usd_per_h >= 0", name="on_demand_nonnegative"),
        CheckConstraint("spot_usd_per_h IS NULL OR spot_usd_per_h >= 0", name="spot_nonnegative"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    provider: Mapped[Provider] = mapped_column(str_enum(Provider, "provider"))
    region: Mapped[str] = mapped_column(String(64))
    instance_type: Mapped[str] = mapped_column(String(64))
    gpu_model_id: Mapped[int] = mapped_column(
        ForeignKey("gpu_models.id", ondelete="RESTRICT"), index=True
    )
    gpu_count: Mapped[int]
    # NULL where the provider sells no spot capacity for this instance type.
    spot_usd_per_h: Mapped[float | None]
    on_demand_usd_per_h: Mapped[float]
    effective_from: Mapped[datetime]
    source: Mapped[str] = mapped_column(Text, default="")
    seeded: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    gpu_model: Mapped[GpuModel] = relationship(lazy="joined", innerjoin=True)

    @property
    def gpu_model_name(self) -> str:
        return self.gpu_model.name


class EgressPrice(Base):
    """One version of the per-GB price a provider charges for one class of outbound traffic.

    `continent` narrows a row to traffic that stays within (for `inter_region`) or, for the
    other classes, leaves from a site on that continent; NULL means "any continent". Seed 003's
    Table 1 prices inter-region traffic per continent (US, EU, ASIA, OCE), hence four rows.
    """

    __tablename__ = "egress_prices"
    __table_args__ = (
        UniqueConstraint("provider", "traffic_class", "continent", "effective_from"),
        # A UNIQUE constraint treats NULLs as distinct; this index closes that gap for the
        # "any continent" rows, on Postgres and SQLite alike.
        Index(
            "uq_egress_prices_any_continent",
            "provider",
            "traffic_class",
            "effective_from",
            unique=True,
            postgresql_where=text("continent IS NULL"),
            sqlite_where=text("continent IS NULL"),
        ),
        CheckConstraint("usd_per_gb >= 0", name="usd_per_gb_nonnegative"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    provider: Mapped[Provider] = mapped_column(str_enum(Provider, "provider"))
    traffic_class: Mapped[TrafficClass] = mapped_column(str_enum(TrafficClass, "traffic_class"))
    continent: Mapped[Continent | None] = mapped_column(str_enum(Continent, "continent"))
    usd_per_gb: Mapped[float]
    effective_from: Mapped[datetime]
    source: Mapped[str] = mapped_column(Text, default="")
    seeded: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
