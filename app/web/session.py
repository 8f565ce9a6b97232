"""The dashboard's session: a signed cookie holding who signed in, a CSRF token and a flash.

The cookie is signed (itsdangerous, keyed by `settings.secret_key`), not encrypted, so it never
holds a secret: it names the API token by id plus a keyed fingerprint of the token's stored hash.
Revoking the token, or changing the admin token or the secret key, ends every session that used it.
The cookie is `Secure` over https, including https that a trusted TLS proxy forwarded
(`settings.trusted_proxies`), or as `settings.cookie_secure` forces.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from itsdangerous import BadSignature, URLSafeTimedSerializer
from starlette.requests import Request
from starlette.responses import Response

COOKIE_NAME = "hybridtrain_session"
# A working day: long enough not to interrupt a run being watched, short enough for a shared screen.
MAX_AGE_S = 12 * 3600
_SALT = "hybridtrain.web.session.v1"


@dataclass(frozen=True)
class WebSession:
    """What the cookie carries; `token_id` None with `admin` True is the admin token."""

    csrf: str
    token_id: int | None = None
    admin: bool = False
    fingerprint: str = ""
    flashes: tuple[tuple[str, str], ...] = field(default=())

    @property
    def signed_in(self) -> bool:
        return bool(self.fingerprint)

    def with_flash(self, level: str, message: str) -> WebSession:
        """A copy with one more (level, message) to show on the next page."""
        return replace(self, flashes=(*self.flashes, (level, message))[-5:])


def new_csrf_token() -> str:
    """A fresh per-session CSRF secret."""
    return secrets.token_urlsafe(32)


def anonymous() -> WebSession:
    """A session that has signed nobody in (it still carries a CSRF token, for /login)."""
    return WebSession(csrf=new_csrf_token())


def fingerprint(secret_key: str, token_hash: str) -> str:
    """A keyed digest of a token's stored hash: binds a session to that token without revealing it."""
    return hmac.new(secret_key.encode(), token_hash.encode(), hashlib.sha256).hexdigest()[:32]


def _serializer(secret_key: str) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(secret_key, salt=_SALT)


def load(request: Request, secret_key: str) -> WebSession | None:
    """The session in the request's cookie, or None if absent, forged or expired."""
    raw = request.cookies.get(COOKIE_NAME)
    if not raw:
        return None
    try:
        data: dict[str, Any] = _serializer(secret_key).loads(raw, max_age=MAX_AGE_S)
    except BadSignature:
        return None
    try:
        return WebSession(
            csrf=str(data["csrf"]),
            token_id=data.get("token_id"),
            admin=bool(data.get("admin", False)),
            fingerprint=str(data.get("fingerprint", "")),
            flashes=tuple((str(lvl), str(msg)) for lvl, msg in data.get("flashes", [])),
        )
    except (KeyError, TypeError, ValueError):
        return None


def cookie_is_secure(request: Request) -> bool:
    """Whether the cookie gets `Secure`: as `settings.cookie_secure` says, else when the request
    came over https (behind a TLS proxy, the scheme it forwarded, believed only from
    `settings.trusted_proxies`; app/main.py)."""
    forced: bool | None = request.app.state.settings.cookie_secure
    return request.url.scheme == "https" if forced is None else forced


def store(response: Response, request: Request, session: WebSession, secret_key: str) -> None:
    """Write `session` into the response's cookie (HttpOnly, SameSite=Lax, Secure over https)."""
    response.set_cookie(
        COOKIE_NAME,
        _serializer(secret_key).dumps(asdict(session)),
        max_age=MAX_AGE_S,
        httponly=True,
        samesite="lax",
        secure=cookie_is_secure(request),
        path="/",
    )


def clear(response: Response) -> None:
    """Remove the session cookie."""
    response.delete_cookie(COOKIE_NAME, path="/")


def csrf_matches(session: WebSession | None, submitted: str | None) -> bool:
    """Whether a submitted form's CSRF token is this session's (constant-time)."""
    if session is None or not submitted:
        return False
    return hmac.compare_digest(session.csrf.encode(), submitted.encode())
