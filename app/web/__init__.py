"""The web dashboard: server-rendered pages over the same queries as the REST API.

`install_dashboard(app)` mounts the static files and every page router, and answers the
dashboard's own errors (not signed in, scope too small, stale form) with pages, not JSON.
"""

from __future__ import annotations

from urllib.parse import quote

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from app.web import session as web_session
from app.web.assets import mount_static
from app.web.auth import ActionNotAllowed, CsrfRejected, LoginRequired, ScopeTooSmall, current_session
from app.web.pages import PageNotFound


def _wants_html(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return "text/html" in accept or "*/*" in accept and "text/event-stream" not in accept


def _error_page(request: Request, status_code: int, heading: str, message: str) -> Response:
    from app.web.templating import render

    cookie = current_session(request, request.app.state.settings) or web_session.anonymous()
    return render(
        request,
        "error.html",
        {"viewer": None, "heading": heading, "message": message, "back_url": "/", "back_label": "Back to the overview"},
        cookie=cookie,
        status_code=status_code,
    )


def install_dashboard(app: FastAPI) -> None:
    """Serve the dashboard's pages and static files from `app`."""
    from app.web.routes import compare, login, nodes, overview, prices, runs, tokens

    mount_static(app)
    for module in (login, overview, nodes, prices, runs, compare, tokens):
        app.include_router(module.router, include_in_schema=False)

    @app.exception_handler(LoginRequired)
    def login_required(request: Request, exc: LoginRequired) -> Response:
        if not _wants_html(request):
            return JSONResponse({"detail": "sign in first"}, status_code=401)
        return RedirectResponse(f"/login?next={quote(exc.next_path, safe='/')}", status_code=303)

    @app.exception_handler(ScopeTooSmall)
    def scope_too_small(request: Request, exc: ScopeTooSmall) -> Response:
        return _error_page(
            request, 403, "Not allowed",
            f"You are signed in as '{exc.principal.name}' with scope '{exc.principal.scope}'; "
            f"this needs scope '{exc.needed}'. Sign in with a token that has it.",
        )

    @app.exception_handler(ActionNotAllowed)
    def action_not_allowed(request: Request, exc: ActionNotAllowed) -> Response:
        return _error_page(
            request, 403, "Not allowed",
            f"Refused: {exc}. Sign in with a token that may do it.",
        )

    @app.exception_handler(CsrfRejected)
    def csrf_rejected(request: Request, _: CsrfRejected) -> Response:
        return _error_page(
            request, 403, "Form expired",
            "This form was not sent from a page of this session (it may have been open across a "
            "sign-out). Go back, reload the page and submit it again.",
        )

    @app.exception_handler(PageNotFound)
    def page_not_found(request: Request, exc: PageNotFound) -> Response:
        return _error_page(request, 404, "Not found", str(exc))
