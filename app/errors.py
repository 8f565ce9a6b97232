"""Domain errors of the control plane, translated into HTTP answers at the API boundary.

Query functions raise these; `app.main` maps each family to one status code, so no handler
needs to know about HTTP and no lower-level error (a driver's IntegrityError) leaks out::

    HybridtrainError
    ├── NotFoundError          404  an id (in the path or inside a body) names nothing
    ├── ConflictError          409  the request contradicts what is stored
    │   ├── DuplicateError          a unique name is already taken
    │   └── InUseError              the row is still referenced (a site with nodes, ...)
    └── InvalidFieldError      422  a field is well-typed but its value is not acceptable
"""

from __future__ import annotations


class HybridtrainError(Exception):
    """Base of every error the control plane raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(HybridtrainError):
    """An id names no row: `NotFoundError("site", 7)` -> "site 7 not found"."""

    def __init__(self, entity: str, key: object, *, field: str | None = None) -> None:
        shown = f"'{key}'" if isinstance(key, str) else str(key)
        super().__init__(f"{entity} {shown} not found")
        self.entity = entity
        self.key = key
        self.field = field


class ConflictError(HybridtrainError):
    """The request is well-formed but contradicts the stored state."""


class DuplicateError(ConflictError):
    """A value that must be unique is already taken."""

    def __init__(self, entity: str, field: str, value: object, *, within: str = "") -> None:
        where = f" {within}" if within else ""
        super().__init__(f"a {entity} with {field}={value!r} already exists{where}")
        self.entity = entity
        self.field = field
        self.value = value


class InUseError(ConflictError):
    """The row cannot be deleted or changed because others still reference it."""


class InvalidFieldError(HybridtrainError):
    """A field's value breaks a rule that the schema alone cannot express."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
