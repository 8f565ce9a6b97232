"""Who is looking at a page: the signed-in principal behind the session cookie, and CSRF checks.

Page handlers declare what they need, as the REST handlers do (`ViewerDep`, `AdminViewerDep`);
an anonymous visitor is sent to /login, a too-small scope gets a 403 page, a token limited to
other actions a 403, and every form post must carry the session's CSRF token (`FormDep`). A
session lasts only as long as its token: deleted or expired, the next page asks to sign in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.datastructures import FormData

from app.api.deps import Principal, SessionDep, SettingsDep, accept_token
from app.config import Settings
from app.models import ApiToken, TokenScope
from app.models.base import utcnow
from app.security import hash_secret, secrets_equal
from app.web import session as web_session
from app.web.session import WebSession


class LoginRequired(Exception):
    """Nobody (valid) is signed in; the visitor goes to /login and comes back to `next_path`."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


class ScopeTooSmall(Exception):
    """The signed-in token may not do this."""

    def __init__(self, principal: Principal, needed: TokenScope) -> None:
        super().__init__(f"token '{principal.name}' has scope '{principal.scope}'; this needs '{needed}'")
        self.principal = principal
        self.needed = needed


class ActionNotAllowed(Exception):
    """The signed-in token's action limit does not name what this form does; the message says
    what it is limited to and what this needs."""


class TokenRefused(Exception):
    """The token offered at sign-in is unknown, revoked or expired; the message says which."""


class CsrfRejected(Exception):
    """A form post without this session's CSRF token: stale page, or another site posting."""


@dataclass(frozen=True)
class Viewer:
    """The signed-in principal and the session it came with."""

    principal: Principal
    session: WebSession

    def can(self, scope: TokenScope | str) -> bool:
        """Whether this viewer's scope includes `scope` (templates use it to hide forms)."""
        return self.principal.scope.allows(TokenScope(scope))


def current_session(request: Request, settings: Settings) -> WebSession | None:
    """The request's session cookie, decoded once per request."""
    if not hasattr(request.state, "web_session"):
        request.state.web_session = web_session.load(request, settings.secret_key)
    return request.state.web_session


def principal_for_token(session: Session, settings: Settings, secret: str) -> tuple[Principal, str]:
    """The principal an API token signs in as, with the stored hash the session binds to;
    TokenRefused if the token is unknown, revoked or expired."""
    if settings.admin_token and secrets_equal(secret, settings.admin_token):
        return Principal(name="HYBRIDTRAIN_ADMIN_TOKEN", scope=TokenScope.admin), hash_secret(secret)
    from app.queries.tokens import token_by_secret

    token = token_by_secret(session, secret=secret)
    if token is None:
        raise TokenRefused("That token is not valid (or was revoked).")
    if token.expired(utcnow()):
        raise TokenRefused(f"That token expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC.")
    accept_token(session, token)
    return Principal.of_token(token), token.token_hash


def _principal_of(session: Session, settings: Settings, cookie: WebSession) -> Principal | None:
    key = settings.secret_key
    if cookie.admin:
        if not settings.admin_token:
            return None
        expected = web_session.fingerprint(key, hash_secret(settings.admin_token))
        if not secrets_equal(cookie.fingerprint, expected):
            return None
        return Principal(name="HYBRIDTRAIN_ADMIN_TOKEN", scope=TokenScope.admin)
    if cookie.token_id is None:
        return None
    token = session.get(ApiToken, cookie.token_id)
    if token is None:  # revoked
        return None
    if not secrets_equal(cookie.fingerprint, web_session.fingerprint(key, token.token_hash)):
        return None
    if token.expired(utcnow()):
        return None
    accept_token(session, token)
    return Principal.of_token(token)


def _next_path(request: Request) -> str:
    query = f"?{request.url.query}" if request.url.query else ""
    return request.url.path + query


def get_viewer(request: Request, session: SessionDep, settings: SettingsDep) -> Viewer:
    """The signed-in viewer, or LoginRequired (answered by a redirect to /login)."""
    cookie = current_session(request, settings)
    principal = _principal_of(session, settings, cookie) if cookie and cookie.signed_in else None
    if principal is None or cookie is None:
        raise LoginRequired(_next_path(request))
    return Viewer(principal=principal, session=cookie)


ViewerDep = Annotated[Viewer, Depends(get_viewer)]


def require_page_scope(needed: TokenScope) -> Callable[..., Viewer]:
    """A dependency that admits signed-in viewers whose scope includes `needed` and whose
    token's action limit, if any, names what the request does."""

    def check_page_scope(request: Request, viewer: ViewerDep) -> Viewer:
        if not viewer.principal.scope.allows(needed):
            raise ScopeTooSmall(viewer.principal, needed)
        refused = viewer.principal.refusal(request)
        if refused is not None:
            raise ActionNotAllowed(refused)
        return viewer

    check_page_scope.__name__ = f"require_page_{needed.value}_scope"
    return check_page_scope


CiViewerDep = Annotated[Viewer, Depends(require_page_scope(TokenScope.ci))]
AdminViewerDep = Annotated[Viewer, Depends(require_page_scope(TokenScope.admin))]


async def _checked(request: Request, settings: Settings, max_files: int) -> FormData:
    form = await request.form(max_files=max_files, max_fields=200)
    submitted = form.get("csrf_token")
    cookie = current_session(request, settings)
    if not isinstance(submitted, str) or not web_session.csrf_matches(cookie, submitted):
        raise CsrfRejected()
    return form


async def checked_form(request: Request, settings: SettingsDep) -> FormData:
    """The posted form, once its `csrf_token` field is shown to be this session's."""
    return await _checked(request, settings, max_files=0)


async def checked_upload_form(request: Request, settings: SettingsDep) -> FormData:
    """`checked_form` for a multipart form that may carry one file (the launch form's bundle)."""
    return await _checked(request, settings, max_files=1)


FormDep = Annotated[FormData, Depends(checked_form)]
UploadFormDep = Annotated[FormData, Depends(checked_upload_form)]


def get_stream_viewer(request: Request, settings: SettingsDep) -> Viewer:
    """`get_viewer` on a session of its own, closed at once: a stream that lasts an hour must
    not hold a pooled connection for that hour."""
    with request.app.state.sessionmaker() as session:
        return get_viewer(request, session, settings)


StreamViewerDep = Annotated[Viewer, Depends(get_stream_viewer)]
