"""Schemathesis against /openapi.json with an admin token: no 5xx, every answer as documented."""

from __future__ import annotations

from collections.abc import Callable

import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from app.config import Settings
from app.main import create_app

# The document is generated from the routes alone, so an app on a never-opened SQLite database
# serves it; the requests go to the test's `app` (on Postgres), passed to every call.
# (schemathesis.pytest.from_fixture would be the natural loader, but schemathesis 4.32.5 reads
# pytest's private `_nodeid`, gone in pytest 9.2.)
schema = schemathesis.openapi.from_asgi(
    "/openapi.json", create_app(Settings(DATABASE_URL="sqlite://"))
)


@schema.parametrize()
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_answers_every_generated_request_as_documented(
    case: schemathesis.Case,
    app: FastAPI,
    make_client: Callable[[str | None], TestClient],
    admin_token: str,
) -> None:
    # `make_client` routes the app's sessions into this test's rolled-back transaction.
    # Given as configuration (not per call) so schemathesis knows the header is auth, and a
    # negative case that drops it is not "answered" with the header put back.
    case.operation.schema.config.update(headers={"Authorization": f"Bearer {admin_token}"})
    case.call_and_validate(
        app=app,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
            negative_data_rejection,
        ],
    )
