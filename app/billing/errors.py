"""Errors raised by cost accounting, each a subclass of the control plane's domain errors.

The API maps these families to status codes at its boundary; the billing functions themselves
know nothing about HTTP::

    HybridtrainError                 (app.errors)
    ├── InvalidFieldError   422
    │   └── InvalidUsageError        a usage figure is impossible (negative bytes, unknown node)
    └── ConflictError       409
        └── PriceNotFoundError       no price in force for what a run used
"""

from __future__ import annotations

from app.errors import ConflictError, InvalidFieldError


class InvalidUsageError(InvalidFieldError):
    """A usage input is impossible: it names the field and the offending value."""


class PriceNotFoundError(ConflictError):
    """No price was in force at the run's pricing time for something the run used."""

    def __init__(self, what: str, at: object) -> None:
        super().__init__(f"no price in force at {at} for {what}")
        self.what = what
        self.at = at
