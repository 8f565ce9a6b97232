"""Dashboard sessions last only as long as their token: an expired token cannot sign in, a
session ends when its token expires, and a limited token's forms obey its actions."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Site, TokenScope
from app.models.base import utcnow
from app.queries.tokens import create_token
from tests.app.web.conftest import PageClient, field_errors

MakeClient = Callable[[str | None], TestClient]


def _signed_in(make_client: MakeClient, secret: str) -> PageClient:
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": secret, "next": "/"})
    assert response.status_code == 303, response.text
    page.get("/")
    return page


def test_signing_in_with_an_expired_token_says_it_expired(session: Session, make_client: MakeClient) -> None:
    created = utcnow() - timedelta(days=2)
    token, secret = create_token(
        session, name="old", scope=TokenScope.read, expires_at=created + timedelta(days=1), now=created
    )
    session.commit()
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": secret, "next": "/"})
    assert response.status_code == 401
    assert field_errors(response.text) == {
        "token": f"That token expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC."
    }


def test_a_session_ends_when_its_token_expires(session: Session, make_client: MakeClient) -> None:
    token, secret = create_token(
        session, name="day", scope=TokenScope.read, expires_at=utcnow() + timedelta(days=1)
    )
    session.commit()
    page = _signed_in(make_client, secret)
    assert page.get("/").status_code == 200
    # The clock passes the token's expiry.
    token.expires_at = utcnow() - timedelta(seconds=1)
    session.commit()
    response = page.http.get("/", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/login")


def test_a_limited_tokens_form_post_outside_its_actions_gets_a_page_saying_what_it_needs(
    session: Session, make_client: MakeClient
) -> None:
    _, secret = create_token(session, name="pricer", scope=TokenScope.admin, actions=["prices:write"])
    session.commit()
    page = _signed_in(make_client, secret)
    page.get("/nodes")
    response = page.post("/nodes/sites", {"name": "not-allowed", "kind": "cloud", "provider": "gcp",
                                          "continent": "europe"})
    assert response.status_code == 403 and response.headers["content-type"].startswith("text/html")
    assert "Not allowed" in response.text
    assert "token &#39;pricer&#39; is limited to prices:write; this needs &#39;sites:write&#39;" in response.text
    assert session.scalar(select(Site).where(Site.name == "not-allowed")) is None
