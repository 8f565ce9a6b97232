"""API tokens that expire, and the record of their last use (to find stale ones)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import ApiToken, TokenScope
from app.models.base import utcnow
from app.queries.tokens import create_token, list_tokens, record_use

API = "/api/v1"
MakeClient = Callable[[str | None], TestClient]


def _expired_token(session: Session, name: str = "expired") -> tuple[ApiToken, str]:
    """A token created two hours ago that was valid for one hour."""
    created = utcnow() - timedelta(hours=2)
    token, secret = create_token(
        session, name=name, scope=TokenScope.ci, expires_at=created + timedelta(hours=1), now=created
    )
    session.commit()
    return token, secret


def test_create_token_with_expires_in_days_sets_its_expiry(client: TestClient) -> None:
    before = datetime.now(UTC)
    body = client.post(f"{API}/tokens", json={"name": "month", "scope": "ci", "expires_in_days": 30}).json()
    expires = datetime.fromisoformat(body["expires_at"])
    assert before + timedelta(days=30) <= expires <= datetime.now(UTC) + timedelta(days=30)


def test_create_token_with_expires_at_keeps_that_instant(client: TestClient) -> None:
    body = client.post(
        f"{API}/tokens", json={"name": "until", "scope": "read", "expires_at": "2199-01-31T12:00:00Z"}
    ).json()
    assert datetime.fromisoformat(body["expires_at"]) == datetime(2199, 1, 31, 12, tzinfo=UTC)


def test_a_token_without_expiry_never_expires(client: TestClient) -> None:
    body = client.post(f"{API}/tokens", json={"name": "forever", "scope": "read"}).json()
    assert body["expires_at"] is None


def test_create_token_refuses_both_expiry_fields_naming_expires_at(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={
        "name": "both", "scope": "read", "expires_in_days": 1, "expires_at": "2199-01-01T00:00:00Z",
    })
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "expires_at"]


def test_create_token_refuses_an_expiry_in_the_past_naming_expires_at(client: TestClient) -> None:
    response = client.post(
        f"{API}/tokens", json={"name": "past", "scope": "read", "expires_at": "2020-01-01T00:00:00Z"}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "expires_at"]


def test_create_token_refuses_zero_days_naming_expires_in_days(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "zero", "scope": "read", "expires_in_days": 0})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "expires_in_days"]


def test_an_expired_token_gets_401_saying_when_it_expired(session: Session, make_client: MakeClient) -> None:
    token, secret = _expired_token(session)
    response = make_client(secret).get(f"{API}/sites")
    assert response.status_code == 401
    assert response.json()["detail"] == (
        f"token 'expired' expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC"
    )
    assert response.headers["www-authenticate"] == "Bearer"


def test_a_token_is_accepted_until_its_expiry(client: TestClient, make_client: MakeClient) -> None:
    secret = client.post(f"{API}/tokens", json={"name": "day", "scope": "read", "expires_in_days": 1}).json()["token"]
    assert make_client(secret).get(f"{API}/sites").status_code == 200


def test_an_accepted_request_records_the_tokens_last_use(client: TestClient, make_client: MakeClient) -> None:
    created = client.post(f"{API}/tokens", json={"name": "used", "scope": "read"}).json()
    assert created["last_used_at"] is None
    before = datetime.now(UTC)
    make_client(created["token"]).get(f"{API}/sites")
    listed = next(t for t in client.get(f"{API}/tokens").json()["data"] if t["id"] == created["id"])
    assert before <= datetime.fromisoformat(listed["last_used_at"]) <= datetime.now(UTC)


def test_last_use_is_written_at_most_once_a_minute(session: Session) -> None:
    token, _ = create_token(session, name="busy", scope=TokenScope.read)
    t0 = utcnow()
    assert record_use(session, token, now=t0)
    assert not record_use(session, token, now=t0 + timedelta(seconds=59))
    assert token.last_used_at == t0
    assert record_use(session, token, now=t0 + timedelta(seconds=60))


def test_list_of_unused_tokens_holds_old_tokens_never_or_long_ago_used(session: Session) -> None:
    now = utcnow()
    old = now - timedelta(days=100)
    never, _ = create_token(session, name="never-used", scope=TokenScope.read, now=old)
    stale, _ = create_token(session, name="used-long-ago", scope=TokenScope.read, now=old)
    record_use(session, stale, now=now - timedelta(days=40))
    fresh, _ = create_token(session, name="used-today", scope=TokenScope.read, now=old)
    record_use(session, fresh, now=now)
    create_token(session, name="created-today", scope=TokenScope.read, now=now)
    rows, _ = list_tokens(session, skip=0, limit=100, unused_days=30, now=now)
    assert {t.name for t in rows} == {"never-used", "used-long-ago"}


def test_api_lists_tokens_unused_for_some_days(session: Session, client: TestClient) -> None:
    old = utcnow() - timedelta(days=100)
    create_token(session, name="forgotten", scope=TokenScope.read, now=old)
    session.commit()
    names = [t["name"] for t in client.get(f"{API}/tokens", params={"unused_days": 90}).json()["data"]]
    assert names == ["forgotten"]
