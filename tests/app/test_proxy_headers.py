"""Behind a TLS proxy: forwarded scheme and client believed only from `trusted_proxies`, and the
session cookie `Secure` when the proxy says the browser used https (or when forced)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.api.deps import get_session
from app.config import Settings
from app.main import create_app
from tests.app.conftest import make_settings

PROXY = "10.20.0.7"
STRANGER = "203.0.113.9"
HTTPS = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.23"}

MakeApp = Callable[..., FastAPI]


@pytest.fixture
def make_app(migrated_postgres_url: str, session: Session) -> Iterator[MakeApp]:
    """A control-plane app of its own settings (on the test's session), with a route that
    says which client and scheme the app saw, as the access log and any limit would."""
    built: list[FastAPI] = []

    def _make(**overrides: object) -> FastAPI:
        app = create_app(make_settings(migrated_postgres_url, **overrides))
        app.dependency_overrides[get_session] = lambda: session

        @app.get("/_seen")
        def seen(request: Request) -> dict[str, str | None]:
            return {"client": request.client.host if request.client else None, "scheme": request.url.scheme}

        built.append(app)
        return app

    yield _make
    for app in built:
        app.state.engine.dispose()


def _session_cookie(app: FastAPI, client_host: str, headers: dict[str, str] | None = None) -> str:
    browser = TestClient(app, client=(client_host, 41000))
    response = browser.get("/login", headers=headers or {})
    assert response.status_code == 200, response.text
    return response.headers["set-cookie"]


def test_cookie_is_secure_when_a_trusted_proxy_forwards_https(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=[PROXY])
    assert "Secure" in _session_cookie(app, PROXY, HTTPS)


def test_cookie_is_not_secure_when_an_untrusted_client_claims_https(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=[PROXY])
    assert "Secure" not in _session_cookie(app, STRANGER, HTTPS)


def test_no_forwarded_header_is_believed_without_trusted_proxies(make_app: MakeApp) -> None:
    app = make_app()
    assert "Secure" not in _session_cookie(app, PROXY, HTTPS)


def test_a_proxy_network_given_as_cidr_is_trusted(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=["10.20.0.0/16"])
    assert "Secure" in _session_cookie(app, PROXY, HTTPS)


def test_client_address_is_the_forwarded_one_from_a_trusted_proxy(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=[PROXY])
    seen = TestClient(app, client=(PROXY, 41000)).get("/_seen", headers=HTTPS).json()
    assert seen == {"client": "198.51.100.23", "scheme": "https"}


def test_client_address_is_the_connecting_one_from_an_untrusted_client(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=[PROXY])
    seen = TestClient(app, client=(STRANGER, 41000)).get("/_seen", headers=HTTPS).json()
    assert seen == {"client": STRANGER, "scheme": "http"}


def test_cookie_secure_setting_forces_secure_over_plain_http(make_app: MakeApp) -> None:
    app = make_app(cookie_secure=True)
    assert "Secure" in _session_cookie(app, STRANGER)


def test_cookie_secure_false_drops_secure_even_over_https(make_app: MakeApp) -> None:
    app = make_app(trusted_proxies=[PROXY], cookie_secure=False)
    assert "Secure" not in _session_cookie(app, PROXY, HTTPS)


def test_trusted_proxies_are_read_comma_separated_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HYBRIDTRAIN_TRUSTED_PROXIES", "10.0.0.1, 192.168.0.0/16")
    assert Settings().trusted_proxies == ["10.0.0.1", "192.168.0.0/16"]


def test_a_trusted_proxy_that_is_not_an_address_is_refused_naming_it() -> None:
    with pytest.raises(ValidationError, match="'proxy.local' is not an IP address or CIDR"):
        Settings(trusted_proxies=["proxy.local"])


def test_server_command_believes_no_forwarded_header_without_trusted_proxies(tmp_path: Path) -> None:
    from tests.app.test_health_and_server import _serve, _stop, _wait_healthy

    process, url = _serve({"HYBRIDTRAIN_ADMIN_TOKEN": "proxy-test"}, cwd=tmp_path)
    try:
        _wait_healthy(process, url)
        response = httpx.get(f"{url}/login", headers=HTTPS, timeout=5)
        assert response.status_code == 200
        assert "Secure" not in response.headers["set-cookie"]
    finally:
        _stop(process)
