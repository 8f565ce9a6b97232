"""A run's timeline: membership changes, restarts, checkpoints and waits, whoever saw them."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import TYPE_CHECKING

from sqlalchemy import BigInteger, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, backref, mapped_column, relationship

from app.models.base import Base, str_enum, utcnow

if TYPE_CHECKING:
    from app.models.runs import Run

__all__ = ["EventSource", "RunEvent"]


class EventSource(enum.StrEnum):
    """Who reported the event."""

    trainer = "trainer"  # a record with an "event" key in the metrics stream
    control_plane = "control_plane"  # the run's lifecycle (a restart, a lost node)
    agent = "agent"  # the node's agent (a spot notice)


class RunEvent(Base):
    """One event in a run's life; `subject` is the rank it is about (None: the whole run).

    Trainer events carry the stream and sequence number of the record that brought them, so a
    re-delivered record is stored once (NULLs never collide: the control plane's own events
    have neither).
    """

    __tablename__ = "run_events"
    __table_args__ = (
        Index("ix_run_events_run_id_t", "run_id", "t"),
        Index("uq_run_events_run_id_stream_seq", "run_id", "stream", "seq", unique=True),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    t: Mapped[datetime] = mapped_column(default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))
    subject: Mapped[int | None]
    # SET NULL keeps the history of a run whose node was later deleted.
    node_id: Mapped[int | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"), index=True
    )
    step: Mapped[int | None]
    detail: Mapped[str] = mapped_column(Text, default="")
    source: Mapped[EventSource] = mapped_column(
        str_enum(EventSource, "source"), default=EventSource.control_plane
    )
    stream: Mapped[str | None] = mapped_column(String(32))
    seq: Mapped[int | None] = mapped_column(BigInteger)

    # `Run.events`, oldest first, declared from this side so that the run's module need not
    # know about events (the run's read schema lists them through it). Loaded with its runs in
    # one more query per statement ("selectin"), so a page of runs costs no query per run.
    run: Mapped[Run] = relationship(
        backref=backref(
            "events", order_by=lambda: [RunEvent.t, RunEvent.id], lazy="selectin",
            cascade="all, delete-orphan", passive_deletes=True,
        )
    )
