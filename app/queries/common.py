"""Helpers shared by the query modules: pagination and partial updates."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from app.errors import InvalidFieldError

T = TypeVar("T")


def paginate(
    session: Session, stmt: Select[tuple[T]], *, skip: int, limit: int
) -> tuple[Sequence[T], int]:
    """The rows of `stmt` from `skip`, at most `limit` of them, and how many match in all."""
    count = session.scalar(select(func.count()).select_from(stmt.order_by(None).subquery()))
    rows = session.scalars(stmt.offset(skip).limit(limit)).all()
    return rows, int(count or 0)


def apply_changes(obj: object, changes: Mapping[str, Any], *, nullable: Collection[str]) -> None:
    """Set the given attributes; `null` is accepted only for the columns in `nullable`."""
    for field, value in changes.items():
        if value is None and field not in nullable:
            raise InvalidFieldError(field, f"{field} may not be null")
        setattr(obj, field, value)
