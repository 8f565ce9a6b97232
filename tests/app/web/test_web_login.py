"""Signing in to the dashboard: sessions, CSRF, scopes and revocation."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from app.models import TokenScope
from tests.app.conftest import ADMIN_TOKEN
from tests.app.web.conftest import PageClient, csrf_of, field_errors


def test_anonymous_visitor_is_sent_to_login_with_next(make_client: Callable[[str | None], TestClient]) -> None:
    response = make_client(None).get("/nodes?page=2", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/login?next=/nodes%3Fpage%3D2"


def test_api_bearer_token_does_not_open_pages(make_client: Callable[[str | None], TestClient]) -> None:
    # Pages authenticate by the session cookie only; a bearer header is for /api/v1.
    response = make_client(ADMIN_TOKEN).get("/", follow_redirects=False)
    assert response.status_code == 303


def test_sign_in_with_admin_token_opens_the_overview(sign_in: Callable[[str], PageClient]) -> None:
    page = sign_in(ADMIN_TOKEN)
    response = page.get("/")
    assert response.status_code == 200
    assert "HYBRIDTRAIN_ADMIN_TOKEN" in response.text
    assert "Overview" in response.text


def test_sign_in_with_api_token_shows_its_scope(
    sign_in: Callable[[str], PageClient], token_with_scope: Callable[[TokenScope], str]
) -> None:
    page = sign_in(token_with_scope(TokenScope.read))
    assert 'badge scope-read' in page.get("/").text


def test_wrong_token_is_refused_beside_the_field(make_client: Callable[[str | None], TestClient]) -> None:
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": "htk_not-a-token"})
    assert response.status_code == 401
    assert field_errors(response.text) == {"token": "That token is not valid (or was revoked)."}
    assert page.http.get("/", follow_redirects=False).status_code == 303


def test_login_without_csrf_token_is_refused(make_client: Callable[[str | None], TestClient]) -> None:
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": ADMIN_TOKEN}, csrf=False)
    assert response.status_code == 403
    assert "Form expired" in response.text


def test_login_redirects_only_to_local_paths(make_client: Callable[[str | None], TestClient]) -> None:
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": ADMIN_TOKEN, "next": "//evil.example/x"})
    assert response.headers["location"] == "/"


def test_form_post_with_another_sessions_csrf_token_is_refused(
    sign_in: Callable[[str], PageClient],
) -> None:
    first, second = sign_in(ADMIN_TOKEN), sign_in(ADMIN_TOKEN)
    assert first.csrf != second.csrf
    response = first.post("/nodes/sites", {"csrf_token": second.csrf, "name": "x"})
    assert response.status_code == 403


def test_tampered_cookie_is_not_a_session(admin_page: PageClient) -> None:
    cookie = admin_page.http.cookies.get("hybridtrain_session")
    admin_page.http.cookies.set("hybridtrain_session", cookie[:-2] + ("A" if cookie[-2] != "A" else "B") + cookie[-1])
    assert admin_page.http.get("/", follow_redirects=False).status_code == 303


def test_cookie_holds_no_token_and_is_httponly(make_client: Callable[[str | None], TestClient]) -> None:
    page = PageClient(make_client(None))
    page.get("/login")
    response = page.post("/login", {"token": ADMIN_TOKEN})
    header = response.headers["set-cookie"]
    assert "HttpOnly" in header and "SameSite=lax" in header
    assert ADMIN_TOKEN not in header


def test_revoking_the_token_ends_its_sessions(
    sign_in: Callable[[str], PageClient], token_with_scope: Callable[[TokenScope], str], client: TestClient
) -> None:
    secret = token_with_scope(TokenScope.admin)
    page = sign_in(secret)
    assert page.get("/").status_code == 200
    token_id = next(t["id"] for t in client.get("/api/v1/tokens").json()["data"] if secret.startswith(t["prefix"]))
    assert client.delete(f"/api/v1/tokens/{token_id}").status_code == 204
    assert page.http.get("/", follow_redirects=False).status_code == 303


def test_sign_out_ends_the_session(admin_page: PageClient) -> None:
    response = admin_page.post("/logout")
    assert response.status_code == 303
    assert admin_page.http.get("/", follow_redirects=False).status_code == 303


def test_sign_in_starts_a_new_csrf_token(make_client: Callable[[str | None], TestClient]) -> None:
    page = PageClient(make_client(None))
    before = csrf_of(page.get("/login").text)
    page.post("/login", {"token": ADMIN_TOKEN})
    assert csrf_of(page.get("/").text) != before
