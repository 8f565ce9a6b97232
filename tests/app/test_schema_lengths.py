"""Every string a request schema accepts fits the column it is stored in (issue 50: a GPU
model's vendor of 33-64 characters passed validation and the database refused it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

from pydantic import BaseModel
from sqlalchemy import String

import app.schemas
from app.schemas.common import Schema
from app.models.base import Base


def _models() -> dict[str, Any]:
    return {mapper.class_.__name__: mapper.class_ for mapper in Base.registry.mappers}


def _schemas() -> list[type[BaseModel]]:
    """Every request schema (`Schema`; answers are `PublicSchema`s, built from the rows)."""
    found: dict[str, type[BaseModel]] = {}
    for module_info in pkgutil.iter_modules(app.schemas.__path__):
        module = importlib.import_module(f"app.schemas.{module_info.name}")
        for name, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Schema) and obj.__module__ == module.__name__:
                found[f"{obj.__module__}.{name}"] = obj
    return list(found.values())


def _max_length(prop: dict[str, Any]) -> int | None:
    """The string limit of a JSON-schema property (through an Optional's anyOf); None if it
    is no string, 0 if it is an unbounded one."""
    options = prop.get("anyOf", [prop])
    strings = [o for o in options if o.get("type") == "string" and "enum" not in o and "format" not in o]
    if not strings:
        return None
    return max(o.get("maxLength", 0) or 10**9 for o in strings)


def _disagreements() -> list[str]:
    models = _models()
    found = []
    for schema in _schemas():
        # The ORM class the schema is about: the longest model name its own name starts with.
        owners = [name for name in models if schema.__name__.startswith(name)]
        if not owners:
            continue
        model = models[max(owners, key=len)]
        columns = model.__table__.columns
        properties = schema.model_json_schema(mode="validation").get("properties", {})
        for field_name, field in schema.model_fields.items():
            key = field.alias or field_name
            if field_name not in columns or key not in properties:
                continue
            column_type = columns[field_name].type
            if not isinstance(column_type, String) or column_type.length is None:
                continue
            limit = _max_length(properties[key])
            if limit is not None and limit > column_type.length:
                shown = "unbounded" if limit >= 10**9 else limit
                found.append(f"{schema.__module__}.{schema.__name__}.{field_name}: schema {shown} > "
                             f"column {model.__tablename__}.{field_name} {column_type.length}")
    return found


def test_the_walk_sees_the_schemas_and_their_columns() -> None:
    names = {s.__name__ for s in _schemas()}
    assert {"GpuModelCreate", "NodeCreate", "SiteCreate", "RunCreate"} <= names


def test_no_schema_accepts_a_string_longer_than_its_column() -> None:
    assert _disagreements() == []
