"""Jinja2 templates of the dashboard (autoescaped), their filters, and the page responses.

`render` and `redirect` are the only ways a page handler answers: both write the session cookie
back when its flash messages changed, so a message is shown exactly once.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from fastapi.templating import Jinja2Templates
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from app.web import session as web_session
from app.web.assets import static_url
from app.web.session import WebSession

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"


def ago(when: datetime | None, now: datetime | None = None) -> str:
    """'12 s ago', '3 min ago', '5 h ago', '2 d ago'; 'never' for None."""
    if when is None:
        return "never"
    seconds = max(0.0, ((now or datetime.now(UTC)) - when).total_seconds())
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def usd(amount: Decimal | float | None, places: int = 2) -> str:
    """'$1,234.57'; small non-zero amounts keep enough places to be seen; '—' for None."""
    if amount is None:
        return "—"
    value = float(amount)
    if 0 < abs(value) < 0.01 and places <= 2:
        return f"${value:,.4f}"
    return f"${value:,.{places}f}"


def utc(when: datetime | None) -> str:
    """'2026-04-01 12:00 UTC'; '—' for None."""
    return "—" if when is None else when.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def duration(seconds: float | None) -> str:
    """'1 h 02 min', '3 min 05 s', '42 s'; '—' for None."""
    if seconds is None:
        return "—"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=select_autoescape(enabled_extensions=("html", "jinja"), default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    # `tojson` writes a run page's figures (~200 kB): Jinja's default sorts every dict's keys
    # and pads separators, a tenth of the page's time for nothing the browser reads.
    env.policies["json.dumps_kwargs"] = {"sort_keys": False, "separators": (",", ":")}
    env.filters.update(ago=ago, usd=usd, utc=utc, duration=duration)
    env.globals.update(static_url=static_url)
    return env


templates = Jinja2Templates(env=_environment())


def _settle_flashes(request: Request, cookie: WebSession | None) -> tuple[list[tuple[str, str]], WebSession | None]:
    if cookie is None or not cookie.flashes:
        return [], None
    return list(cookie.flashes), WebSession(
        csrf=cookie.csrf, token_id=cookie.token_id, admin=cookie.admin, fingerprint=cookie.fingerprint
    )


def render(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    cookie: WebSession,
    status_code: int = 200,
) -> Response:
    """The template `name` with `context`, the session's CSRF token and its pending flashes."""
    flashes, settled = _settle_flashes(request, cookie)
    response = templates.TemplateResponse(
        request,
        name,
        {"csrf_token": cookie.csrf, "flashes": flashes, "path": request.url.path} | context,
        status_code=status_code,
    )
    response.headers["Cache-Control"] = "no-store"
    if settled is not None:
        web_session.store(response, request, settled, request.app.state.settings.secret_key)
    return response


def redirect(
    request: Request, url: str, *, cookie: WebSession | None = None, flash: tuple[str, str] | None = None
) -> Response:
    """A 303 to `url` (after a form post), carrying an optional flash message to show there."""
    response = RedirectResponse(url, status_code=303)
    if cookie is not None and flash is not None:
        web_session.store(
            response, request, cookie.with_flash(*flash), request.app.state.settings.secret_key
        )
    return response
