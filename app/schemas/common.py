"""Field types and the page envelope shared by every resource's schemas.

The bounds here are the database's: a string longer than its column, an integer beyond int4,
a NUL character (Postgres text cannot hold one) or a date that cannot be moved to UTC would
otherwise reach the driver and come back as a 500. Rejecting them in the schema gives a 422
that names the field, and publishes the bound in /openapi.json.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Generic, TypeVar

from pydantic import AfterValidator, AwareDatetime, BeforeValidator, BaseModel, ConfigDict, Field

MAX_ID = 2**31 - 1  # Postgres `integer`
# No control characters: they have no business in names and Postgres refuses NUL outright.
_PRINTABLE = r"^[^\x00-\x1f\x7f]*$"

# Request bodies are checked strictly: "5" is not a number and 1 is not `true` (the schema says
# so, and coercing them would accept requests that /openapi.json calls invalid).
Id = Annotated[int, Field(ge=1, le=MAX_ID, strict=True)]
Flag = Annotated[bool, Field(strict=True)]
Name = Annotated[str, Field(min_length=1, max_length=128, pattern=_PRINTABLE)]
ShortText = Annotated[str, Field(min_length=1, max_length=64, pattern=_PRINTABLE)]
# For the String(32) columns (a GPU model's vendor and form factor).
TinyText = Annotated[str, Field(min_length=1, max_length=32, pattern=_PRINTABLE)]
LongText = Annotated[str, Field(max_length=4000, pattern=r"^[^\x00]*$")]
Count = Annotated[int, Field(ge=1, le=100_000, strict=True)]
UsdPerHour = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False, strict=True)]
UsdPerGb = Annotated[float, Field(ge=0, le=1_000, allow_inf_nan=False, strict=True)]
Positive = Annotated[float, Field(gt=0, le=1_000_000, allow_inf_nan=False, strict=True)]

EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(2200, 1, 1, tzinfo=UTC)


_ISO_8601 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}")


def _iso_string_only(value: object) -> object:
    # Pydantic would also read 0 or "0.5" as seconds since 1970; the schema promises RFC 3339.
    if isinstance(value, str) and not _ISO_8601.match(value):
        raise ValueError("must be an RFC 3339 date-time such as 2026-01-31T12:00:00Z")
    if not isinstance(value, (str, datetime)):
        raise ValueError("must be an RFC 3339 date-time string")
    return value


def _to_utc_in_range(value: datetime) -> datetime:
    # Checked before conversion: astimezone() overflows near year 1 and 9999.
    if not EARLIEST.year <= value.year < LATEST.year:
        raise ValueError(f"must lie between {EARLIEST.year} and {LATEST.year - 1}")
    return value.astimezone(UTC)


Timestamp = Annotated[
    AwareDatetime, BeforeValidator(_iso_string_only), AfterValidator(_to_utc_in_range)
]
"""A timezone-aware instant between 1970 and 2199, normalised to UTC (naive times are refused)."""

Skip = Annotated[int, Field(ge=0, le=1_000_000_000, description="rows to skip")]
Limit = Annotated[int, Field(ge=1, le=1000, description="rows to return (at most 1000)")]


class Schema(BaseModel):
    """Base of request schemas: unknown fields are errors, not silently dropped, and NaN or
    Infinity (which Python's JSON parser takes) is no number (a field that means to take one,
    as a diverged loss, turns it into None before the float is checked)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def plain_json(value: Any, *, max_bytes: int, what: str = "the value") -> Any:
    """`value` if it is plain JSON (no NaN or Infinity) of at most `max_bytes`; ValueError
    otherwise, for a validator to report on its field."""
    try:
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":")).encode())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be plain JSON: {exc}") from None
    if size > max_bytes:
        raise ValueError(f"{what} is {size} bytes of JSON; at most {max_bytes}")
    return value


def JsonObject(max_bytes: int) -> Any:  # noqa: N802 - used as a type: `args: JsonObject(4096)`
    """A JSON object field of plain JSON, at most `max_bytes` long once encoded."""
    return Annotated[dict[str, Any], AfterValidator(lambda value: plain_json(value, max_bytes=max_bytes))]


class PublicSchema(BaseModel):
    """Base of response schemas, built from ORM objects."""

    model_config = ConfigDict(from_attributes=True)


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    """One page of a list: the rows and how many match the filters in all."""

    data: list[T]
    count: int


class ErrorMessage(BaseModel):
    """The body of a 401, 403, 404, 409 or 503 answer."""

    detail: str
