"""Signing in with an API token, and out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from app.api.deps import SessionDep, SettingsDep
from app.web import session as web_session
from app.web.auth import (
    FormDep,
    LoginRequired,
    TokenRefused,
    current_session,
    get_viewer,
    principal_for_token,
)
from app.web.session import WebSession
from app.web.templating import redirect, render

router = APIRouter()


def safe_next(path: str | None) -> str:
    """`path` if it is a path on this site, else '/': a login link must not send users elsewhere."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


@router.get("/login")
def read_login(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    next: Annotated[str | None, Query(max_length=2000)] = None,
) -> Response:
    """The sign-in form (or straight on, when already signed in)."""
    try:
        get_viewer(request, session, settings)
        return redirect(request, safe_next(next))
    except LoginRequired:
        pass
    cookie = current_session(request, settings)
    fresh = cookie is None
    cookie = cookie or web_session.anonymous()
    response = render(
        request, "login.html", {"next": safe_next(next), "errors": {}, "viewer": None}, cookie=cookie
    )
    if fresh:
        web_session.store(response, request, cookie, settings.secret_key)
    return response


@router.post("/login")
def login(request: Request, session: SessionDep, settings: SettingsDep, form: FormDep) -> Response:
    """Exchange an API token for a session cookie."""
    token = form.get("token")
    next_path = safe_next(str(form.get("next") or "/"))
    cookie = current_session(request, settings) or web_session.anonymous()
    try:
        if not (isinstance(token, str) and token.strip()):
            raise TokenRefused("Enter an API token.")
        principal, token_hash = principal_for_token(session, settings, token.strip())
    except TokenRefused as refused:
        return render(
            request,
            "login.html",
            {"next": next_path, "errors": {"token": str(refused)}, "viewer": None},
            cookie=cookie,
            status_code=401,
        )
    # A new CSRF token on sign-in: nothing learnt before it carries over into the session.
    signed_in = WebSession(
        csrf=web_session.new_csrf_token(),
        token_id=principal.token_id,
        admin=principal.token_id is None,
        fingerprint=web_session.fingerprint(settings.secret_key, token_hash),
    )
    return redirect(request, next_path, cookie=signed_in, flash=("ok", f"Signed in as {principal.name}."))


@router.post("/logout")
def logout(request: Request, _: FormDep) -> Response:
    """End the session."""
    response = redirect(request, "/login")
    web_session.clear(response)
    return response
