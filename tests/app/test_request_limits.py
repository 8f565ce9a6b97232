"""Limits before work (issue 50): NaN and Infinity refused 422 naming the field on every route
that takes JSON, validation errors that show only an excerpt of the input, body size limits
enforced while reading, and large uploads authenticated before their body is read."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import EXCERPT_CHARS
from runs_testing import online_node_fixture  # noqa: F401 (fixture)

from app.main import create_app
from tests.app.conftest import API, make_settings
from tests.app.serving import MiB, body_chunks, drive_asgi



def _json_routes(app: FastAPI) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path, request body schema) of every route whose body is JSON, from the app's
    OpenAPI document (which lists every route), path parameters filled in."""
    found = []
    for path, operations in app.openapi()["paths"].items():
        for method, operation in operations.items():
            content = operation.get("requestBody", {}).get("content", {})
            if "application/json" not in content:
                continue
            filled = re.sub(r"\{sha256\}", "a" * 64, path)
            found.append((method.upper(), re.sub(r"\{[^}]+\}", "1", filled), content["application/json"]["schema"]))
    return found


def _resolve(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _number_leaves(schema: dict[str, Any], components: dict[str, Any], depth: int = 0) -> Iterator[tuple[Any, ...]]:
    """Paths (property names, 0 for a list item) to every number a body of `schema` may hold."""
    schema = _resolve(schema, components)
    if depth > 5:
        return
    if schema.get("type") in ("number", "integer"):
        yield ()
        return
    for option in schema.get("anyOf", []) + schema.get("oneOf", []):
        yield from _number_leaves(option, components, depth + 1)
    if schema.get("type") == "array" and "items" in schema:
        for leaf in _number_leaves(schema["items"], components, depth + 1):
            yield (0, *leaf)
    for name, prop in schema.get("properties", {}).items():
        for leaf in _number_leaves(prop, components, depth + 1):
            yield (name, *leaf)


def _document(path: tuple[Any, ...], literal: str) -> str:
    """A JSON text with `literal` at `path` (as raw text: json.dumps would write NaN itself)."""
    text = literal
    for key in reversed(path):
        text = f"[{text}]" if key == 0 else f"{{{json.dumps(key)}: {text}}}"
    return text


# The one number that takes NaN on purpose: a diverged loss is stored as null
# (docs/architecture.md, "Trainer -> control plane: metrics").
NAN_ALLOWED = {("records", 0, "value")}


def test_the_app_has_json_routes_to_walk(app: FastAPI) -> None:
    routes = {(method, path) for method, path, _ in _json_routes(app)}
    assert {("POST", f"{API}/agent/register"), ("POST", f"{API}/agent/heartbeat"), ("POST", f"{API}/runs/1/metrics")} <= routes
    assert len(routes) > 20


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_in_any_json_body_get_422_naming_the_field(
    client: TestClient, app: FastAPI, online_node: Any, literal: str
) -> None:
    components = app.openapi()["components"]["schemas"]
    agent = online_node().agent
    tried = 0
    for method, path, schema in _json_routes(app):
        caller = agent if path.startswith(f"{API}/agent/") else client
        properties = _resolve(schema, components).get("properties", {})
        leaves = {leaf for leaf in _number_leaves(schema, components) if leaf not in NAN_ALLOWED}
        # Every top-level field, whatever its type, and every number however deep.
        for leaf in sorted({(name,) for name in properties} | leaves, key=str):
            body = _document(leaf, literal)
            response = caller.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == 422, (method, path, body, response.status_code, response.text[:300])
            locs = [tuple(error["loc"]) for error in response.json()["detail"]]
            named = [loc for loc in locs if loc[:2] == ("body", leaf[0]) and leaf[-1] in loc]
            assert named, (method, path, body, locs)
            tried += 1
    assert tried > 100


def test_a_validation_error_shows_only_an_excerpt_of_the_input(client: TestClient) -> None:
    long_name = "n" * 100_000
    response = client.post(f"{API}/sites", json={"name": long_name, "kind": "cloud"})
    assert response.status_code == 422
    assert len(response.content) < 4000, len(response.content)
    named = [e for e in response.json()["detail"] if e["loc"] == ["body", "name"]]
    assert named and named[0]["input"].startswith("nnnn") and len(named[0]["input"]) <= EXCERPT_CHARS + 3

    points = [{"name": "loss", "rank": 0, "step": i, "t": 1.0, "value": "bad"} for i in range(9000)]
    response = client.post(f"{API}/runs/1/metrics", json={"records": points})
    assert response.status_code == 422
    # The first errors and a count of the rest; the batch itself is never echoed back.
    assert len(response.content) < 10_000, len(response.content)
    assert response.json()["detail"][-1]["type"] == "too_many_errors"


def test_an_oversize_json_body_is_refused_before_anyone_is_authenticated(app: FastAPI, settings: Settings) -> None:
    started = time.monotonic()
    # Declared: refused before a byte is read.
    status, _, pulled = drive_asgi(app, "POST", f"{API}/sites",
                              {"content-type": "application/json", "content-length": str(200 * MiB)},
                              body_chunks(200 * MiB))
    assert (status, pulled) == (413, 0)
    # Chunked: refused as soon as it passes the limit.
    status, _, pulled = drive_asgi(app, "POST", f"{API}/sites", {"content-type": "application/json"}, body_chunks(200 * MiB))
    assert status == 413
    assert pulled <= settings.json_max_bytes + MiB
    assert time.monotonic() - started < 5


def test_a_bundle_upload_with_a_bad_token_is_refused_before_its_body_is_read(app: FastAPI) -> None:
    headers = {"content-type": "application/gzip", "authorization": "Bearer not-a-token"}
    status, body, pulled = drive_asgi(app, "POST", f"{API}/bundles", headers, body_chunks(60 * MiB))
    assert status == 401, body
    assert pulled == 0


def test_an_agent_report_may_be_larger_than_a_json_body_up_to_its_own_limit(settings: Settings) -> None:
    from app.request_limits import body_limit

    assert body_limit(settings, "POST", f"{API}/sites") == settings.json_max_bytes
    assert body_limit(settings, "POST", f"{API}/agent/heartbeat") == settings.report_max_bytes
    assert body_limit(settings, "POST", f"{API}/runs/7/metrics") == settings.report_max_bytes
    assert body_limit(settings, "PUT", f"{API}/runs/7/checkpoint") == settings.checkpoint_max_bytes
    assert json.dumps(settings.json_max_bytes)


def test_a_body_trickled_slower_than_the_timeout_gets_408(migrated_postgres_url: str) -> None:
    slow = create_app(make_settings(migrated_postgres_url, body_timeout_s=0.5))

    def trickle() -> Iterator[bytes | float]:
        yield b'{"name": '
        yield 1.0  # the client pauses past the deadline
        yield b'"x"}'

    started = time.monotonic()
    status, body, _ = drive_asgi(slow, "POST", f"{API}/sites", {"content-type": "application/json"}, trickle())
    assert status == 408, body
    assert time.monotonic() - started < 3
