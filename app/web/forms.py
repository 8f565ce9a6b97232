"""From an HTML form to a validated schema, and from any error to a message beside its field.

Browsers post every field as text; the schemas of `app/schemas/` decide what is valid, so the
pages and the REST API accept and refuse exactly the same input. Blank optional fields are left
out rather than sent as "" (which a bounded string would refuse).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData

from app.errors import DuplicateError, HybridtrainError, InvalidFieldError, NotFoundError

M = TypeVar("M", bound=BaseModel)
FORM_ERROR = "__form__"  # the key of an error that belongs to no single field


def values(form: FormData, names: Iterable[str]) -> dict[str, str]:
    """The named text fields of `form`, stripped ('' where absent): what to echo back on error."""
    out: dict[str, str] = {}
    for name in names:
        value = form.get(name)
        out[name] = value.strip() if isinstance(value, str) else ""
    return out


def non_blank(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` without blank strings, so optional fields fall back to their defaults."""
    return {k: v for k, v in data.items() if not (isinstance(v, str) and v == "")}


def _message(error: Mapping[str, Any]) -> str:
    msg = str(error.get("msg", "invalid value"))
    # Pydantic prefixes custom validators' messages; the field is already named by position.
    return msg.removeprefix("Value error, ")


def errors_of(exc: ValidationError, rename: Callable[[str], str] = lambda f: f) -> dict[str, str]:
    """One message per field (the first), keyed by the form's field name."""
    errors: dict[str, str] = {}
    for error in exc.errors():
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        field = rename(loc) if loc else FORM_ERROR
        errors.setdefault(field, _message(error))
    return errors


def parse(model: type[M], data: Mapping[str, Any], rename: Callable[[str], str] = lambda f: f) -> tuple[M | None, dict[str, str]]:
    """`model` validated from `data`, or None and the errors by field."""
    try:
        return model.model_validate(data), {}
    except ValidationError as exc:
        return None, errors_of(exc, rename)


def domain_errors(exc: HybridtrainError, rename: Callable[[str], str] = lambda f: f) -> dict[str, str]:
    """A query's error as a message beside the field it names (or above the form)."""
    field: str | None = None
    if isinstance(exc, InvalidFieldError):
        field = exc.field
    elif isinstance(exc, DuplicateError):
        field = exc.field
    elif isinstance(exc, NotFoundError):
        field = exc.field
    return {rename(field) if field else FORM_ERROR: exc.message}


def typed(
    data: Mapping[str, str],
    *,
    ints: Iterable[str] = (),
    floats: Iterable[str] = (),
    flags: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, str]]:
    """Form text turned into the JSON types the (strict) schemas expect, and what would not turn.

    A checkbox is present ("on") when ticked and absent otherwise; blank numbers stay blank, to
    be dropped by `non_blank` or refused by the schema as missing.
    """
    out: dict[str, Any] = dict(data)
    errors: dict[str, str] = {}
    for name in ints:
        text = data.get(name, "")
        if text != "":
            try:
                out[name] = int(text.replace("_", "").replace(",", ""))
            except ValueError:
                errors[name] = f"must be a whole number, not {text[:40]!r}"
    for name in floats:
        text = data.get(name, "")
        if text != "":
            try:
                out[name] = float(text.replace("_", "").replace(",", ""))
            except ValueError:
                errors[name] = f"must be a number, not {text[:40]!r}"
    for name in flags:
        out[name] = data.get(name, "") not in ("", "off", "false", "0")
    return out, errors
