"""Data sets: sharded samples in an object store, a web server or on the nodes, that runs read."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, CheckConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, str_enum, utcnow
from app.models.enums import Continent, Provider

__all__ = ["Dataset"]


class Dataset(Base):
    """A registered data set: where its folder is (index.json and webdataset shards), what its
    index said at registration, and where its store is, which prices the bytes read from it."""

    __tablename__ = "datasets"
    __table_args__ = (
        CheckConstraint("size_bytes >= 0", name="size_bytes_nonnegative"),
        CheckConstraint("shards >= 1", name="shards_positive"),
        CheckConstraint("samples >= 1", name="samples_positive"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    url: Mapped[str] = mapped_column(String(2000))
    format: Mapped[str] = mapped_column(String(32))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    shards: Mapped[int]
    samples: Mapped[int] = mapped_column(BigInteger)
    # The store's place, as a site's: the bill classes each node's reads from it by these.
    store_provider: Mapped[Provider] = mapped_column(str_enum(Provider, "store_provider"))
    store_continent: Mapped[Continent] = mapped_column(str_enum(Continent, "store_continent"))
    store_region: Mapped[str | None] = mapped_column(String(64))
    store_zone: Mapped[str | None] = mapped_column(String(64))
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
