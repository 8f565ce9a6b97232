"""Dependencies of the REST handlers, as typed aliases: declare what a handler needs.

    def read_nodes(session: SessionDep, _: ReadDep, page: PaginationDep) -> ...
    def create_run(session: SessionDep, principal: CiDep, ...) -> ...

Tests swap any of them with `app.dependency_overrides[get_session] = ...`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.config import Settings
from app.dispatch import Dispatcher
from app.models import Node, TokenScope
from app.queries.tokens import token_by_secret
from app.schemas.common import MAX_ID
from app.security import secrets_equal


def get_settings(request: Request) -> Settings:
    """The settings the running app was created with."""
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """A session for one request. Handlers commit once at their end; anything else rolls back."""
    with request.app.state.sessionmaker() as session:
        yield session


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


# --- authentication ---------------------------------------------------------------------------

bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API token (`hybridtrain token create`) or HYBRIDTRAIN_ADMIN_TOKEN.",
)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name and scope (`token_id` is None for the admin token)."""

    name: str
    scope: TokenScope
    token_id: int | None = None


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, message, headers={"WWW-Authenticate": "Bearer"}
    )


def get_principal(
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Principal:
    """The caller named by the `Authorization: Bearer` header; 401 if absent or unknown."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    secret = credentials.credentials
    if settings.admin_token and secrets_equal(secret, settings.admin_token):
        return Principal(name="HYBRIDTRAIN_ADMIN_TOKEN", scope=TokenScope.admin)
    token = token_by_secret(session, secret=secret)
    if token is None:
        raise _unauthorized("invalid or revoked token")
    return Principal(name=token.name, scope=token.scope, token_id=token.id)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_scope(needed: TokenScope) -> Callable[[Principal], Principal]:
    """A dependency that admits callers whose scope includes `needed` (403 otherwise)."""

    def check_scope(principal: PrincipalDep) -> Principal:
        if not principal.scope.allows(needed):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token '{principal.name}' has scope '{principal.scope}'; "
                f"this needs '{needed}' or above",
            )
        return principal

    check_scope.__name__ = f"require_{needed.value}_scope"
    return check_scope


ReadDep = Annotated[Principal, Depends(require_scope(TokenScope.read))]
CiDep = Annotated[Principal, Depends(require_scope(TokenScope.ci))]
AdminDep = Annotated[Principal, Depends(require_scope(TokenScope.admin))]


# --- common parameters ------------------------------------------------------------------------


@dataclass(frozen=True)
class Pagination:
    skip: int
    limit: int


def get_pagination(
    skip: Annotated[int, Query(ge=0, le=1_000_000_000, description="rows to skip")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000, description="rows to return")] = 100,
) -> Pagination:
    """`skip` and `limit` of a list request."""
    return Pagination(skip=skip, limit=limit)


PaginationDep = Annotated[Pagination, Depends(get_pagination)]

IdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
IdQuery = Annotated[int | None, Query(ge=1, le=MAX_ID)]
TextQuery = Annotated[str | None, Query(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")]


# --- runs and agents --------------------------------------------------------------------------


def get_dispatcher(request: Request) -> Dispatcher:
    """The publisher of launch and cancel orders to the node agents."""
    return request.app.state.dispatcher


DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]

agent_bearer = HTTPBearer(
    auto_error=False, scheme_name="AgentToken",
    description="The token a node's agent made up and registered (agent endpoints only).",
)


def get_agent_node(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(agent_bearer)],
) -> Node:
    """The node whose agent presents this bearer token; 401 otherwise."""
    from app.queries.agents import node_by_agent_token

    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing agent token: send 'Authorization: Bearer <agent token>'")
    node = node_by_agent_token(session, token=credentials.credentials)
    if node is None:
        raise _unauthorized("unknown agent token: the node was deleted or re-joined elsewhere")
    return node


AgentNodeDep = Annotated[Node, Depends(get_agent_node)]

metrics_bearer = HTTPBearer(
    auto_error=False, scheme_name="RunMetricsToken",
    description="The per-run token handed to the trainer at launch (metric ingestion only).",
)


def get_metrics_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(metrics_bearer)],
) -> str:
    """The bearer token of a metrics POST (checked against the run by the handler)."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing run token: send 'Authorization: Bearer <run metrics token>'")
    return credentials.credentials


MetricsTokenDep = Annotated[str, Depends(get_metrics_token)]
