"""The tokens page (admins): every API token with its scope, expiry, actions and last use;
create one (its secret shown this once) or revoke one."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from sqlalchemy.orm import Session
from starlette.responses import Response

from app.api.deps import SessionDep
from app.errors import HybridtrainError, InvalidFieldError, NotFoundError
from app.models import TokenScope
from app.models.base import utcnow
from app.queries import tokens as queries
from app.schemas.common import MAX_ID
from app.schemas.tokens import TokenCreate
from app.token_limits import ACTIONS
from app.web import forms
from app.web.auth import AdminViewerDep, FormDep, Viewer
from app.web.pages import PageNotFound
from app.web.templating import redirect, render

router = APIRouter()

TokenIdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
CREATE_FIELDS = ("name", "scope", "expires_in_days")


def _tokens_page(
    request: Request,
    session: Session,
    viewer: Viewer,
    *,
    created: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
    errors: dict[str, str] | None = None,
    status_code: int = 200,
) -> Response:
    rows, _ = queries.list_tokens(session, skip=0, limit=1000)
    context = {
        "viewer": viewer,
        "tokens": rows,
        "now": utcnow(),
        "created": created,
        "values": values or {"scope": "ci"},
        "errors": errors or {},
        "scope_options": [(s.value, s.value) for s in TokenScope],
        "action_options": ACTIONS,
    }
    return render(request, "tokens.html", context, cookie=viewer.session, status_code=status_code)


@router.get("/tokens")
def read_tokens_page(request: Request, session: SessionDep, viewer: AdminViewerDep) -> Response:
    """Every token: scope, expiry, actions and last use (never a secret)."""
    return _tokens_page(request, session, viewer)


@router.post("/tokens")
def create_token(request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep) -> Response:
    """Create a token and show its secret, this once (rendered, not redirected)."""
    echoed = forms.values(form, CREATE_FIELDS)
    chosen = [a for a in form.getlist("actions") if isinstance(a, str)]
    data, errors = forms.typed(echoed, ints=("expires_in_days",))
    if chosen:
        data["actions"] = chosen
    shown = {**echoed, "actions": chosen}
    if not errors:
        body, errors = forms.parse(TokenCreate, forms.non_blank(data))
        if body is not None:
            try:
                days = body.expires_in_days
                expires_at = utcnow() + timedelta(days=days) if days is not None else None
                token, secret = queries.create_token(
                    session, name=body.name, scope=body.scope, expires_at=expires_at, actions=body.actions
                )
                session.commit()
                return _tokens_page(
                    request, session, viewer, created={"name": token.name, "secret": secret}, status_code=201
                )
            except HybridtrainError as exc:
                session.rollback()
                if isinstance(exc, InvalidFieldError) and exc.field == "expires_at":
                    exc.field = "expires_in_days"
                errors = forms.domain_errors(exc)
    return _tokens_page(request, session, viewer, values=shown, errors=errors, status_code=422)


@router.post("/tokens/{token_id}/delete")
def delete_token(
    request: Request, session: SessionDep, viewer: AdminViewerDep, _: FormDep, token_id: TokenIdPath
) -> Response:
    """Revoke a token: the API and every dashboard session it opened refuse it from now on."""
    try:
        queries.delete_token(session, token_id=token_id)
    except NotFoundError as exc:
        raise PageNotFound(exc.message) from exc
    session.commit()
    return redirect(request, "/tokens", cookie=viewer.session, flash=("ok", f"Token {token_id} revoked."))
