"""The dashboard's tokens page: admins see every token's expiry, actions and last use, create
one with an expiry and actions (its secret shown once), and revoke one."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import TokenScope
from app.models.base import utcnow
from app.queries.tokens import create_token, record_use
from tests.app.conftest import ADMIN_TOKEN
from tests.app.web.conftest import PageClient, field_errors

MakeClient = Callable[[str | None], TestClient]


def _signed_in(make_client: MakeClient, secret: str = ADMIN_TOKEN) -> PageClient:
    page = PageClient(make_client(None))
    page.get("/login")
    assert page.post("/login", {"token": secret, "next": "/"}).status_code == 303
    page.get("/")
    return page


def _row(html: str, token_id: int) -> str:
    match = re.search(rf'<tr data-token="{token_id}">(.*?)</tr>', html, re.S)
    assert match, f"no row for token {token_id}"
    return match.group(1)


def test_tokens_page_shows_expiry_actions_and_last_use(session: Session, make_client: MakeClient) -> None:
    created = utcnow() - timedelta(days=3)
    token, secret = create_token(session, name="ci-bot", scope=TokenScope.ci, now=created,
                                 expires_at=created + timedelta(days=1), actions=["runs:create"])
    record_use(session, token, now=created + timedelta(hours=1))
    session.commit()
    html = _signed_in(make_client).get("/tokens").text
    row = _row(html, token.id)
    assert "ci-bot" in row and "expired" in row and "runs:create" in row
    assert f"{token.last_used_at:%Y-%m-%d %H:%M}" in row
    assert secret not in html


def test_creating_a_token_on_the_page_shows_its_secret_once(make_client: MakeClient, client: TestClient) -> None:
    page = _signed_in(make_client)
    page.get("/tokens")
    response = page.post("/tokens", {"name": "from-page", "scope": "ci", "expires_in_days": "7",
                                     "actions": ["runs:create", "runs:plan"]})
    assert response.status_code == 201
    secret = re.search(r"<code data-token-secret>([^<]+)</code>", response.text).group(1)
    listed = next(t for t in client.get("/api/v1/tokens").json()["data"] if t["name"] == "from-page")
    assert listed["actions"] == ["runs:create", "runs:plan"] and listed["expires_at"] is not None
    assert make_client(secret).get("/api/v1/runs").status_code == 200
    assert secret not in page.get("/tokens").text


def test_creating_a_token_with_zero_days_is_refused_beside_the_field(make_client: MakeClient) -> None:
    page = _signed_in(make_client)
    page.get("/tokens")
    response = page.post("/tokens", {"name": "zero", "scope": "ci", "expires_in_days": "0"})
    assert response.status_code == 422
    assert "expires_in_days" in field_errors(response.text)


def test_revoking_a_token_on_the_page_refuses_it_at_once(session: Session, make_client: MakeClient) -> None:
    token, secret = create_token(session, name="to-revoke", scope=TokenScope.read)
    session.commit()
    page = _signed_in(make_client)
    page.get("/tokens")
    assert page.post(f"/tokens/{token.id}/delete").status_code == 303
    assert make_client(secret).get("/api/v1/sites").status_code == 401


def test_tokens_page_is_for_admins_only(session: Session, make_client: MakeClient) -> None:
    _, secret = create_token(session, name="ci-viewer", scope=TokenScope.ci)
    session.commit()
    assert _signed_in(make_client, secret).get("/tokens").status_code == 403
