"""Dependencies of the REST handlers, as typed aliases: declare what a handler needs.

    def read_nodes(session: SessionDep, _: ReadDep, page: PaginationDep) -> ...
    def create_run(session: SessionDep, principal: CiDep, ...) -> ...

Tests swap any of them with `app.dependency_overrides[get_session] = ...`.

FastAPI runs a plain `def` dependency in a worker thread, one hop per dependency per request;
those that only read the request or check a value are `async def`, so a request takes a
thread only for the work that waits on the database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.beat_batches import BeatBatches
from app.config import Settings
from app.dispatch import Dispatcher
from app.models import ApiToken, Node, TokenScope
from app.models.base import utcnow
from app.queries.tokens import record_use, token_by_secret
from app.schemas.common import MAX_ID
from app.security import secrets_equal
from app.token_limits import action_of, refusal


async def get_settings(request: Request) -> Settings:
    """The settings the running app was created with."""
    return request.app.state.settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for one request. Handlers commit once at their end; anything else rolls back."""
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        # Creating a session touches no database, nor does closing one whose work was committed;
        # rolling back an open transaction does, and waits in a thread, not on the event loop.
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]


# --- authentication ---------------------------------------------------------------------------

bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An API token (`hybridtrain token create`) or HYBRIDTRAIN_ADMIN_TOKEN.",
)


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name, scope and action limit (None: none). `token_id` is
    None for the admin token from the settings."""

    name: str
    scope: TokenScope
    token_id: int | None = None
    actions: frozenset[str] | None = None

    @classmethod
    def of_token(cls, token: ApiToken) -> Principal:
        """The principal a stored token stands for."""
        actions = frozenset(token.actions) if token.actions is not None else None
        return cls(name=token.name, scope=token.scope, token_id=token.id, actions=actions)

    def refusal(self, request: Request) -> str | None:
        """Why this principal's action limit refuses `request`; None when it does not."""
        if self.actions is None:
            return None
        route = request.scope.get("route")
        return refusal(self.name, self.actions, action_of(request.method, getattr(route, "name", None)))


def expired_message(token: ApiToken) -> str:
    """What a request bearing an expired token is told."""
    assert token.expires_at is not None
    return f"token '{token.name}' expired at {token.expires_at:%Y-%m-%d %H:%M:%S} UTC"


def accept_token(session: Session, token: ApiToken) -> None:
    """Record that `token` was accepted (throttled), committed at once: a read-only request
    never commits, and the record must not wait for, or roll back with, the handler's work."""
    if record_use(session, token):
        session.commit()


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
    if token.expired(utcnow()):
        raise _unauthorized(expired_message(token))
    accept_token(session, token)
    return Principal.of_token(token)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_scope(needed: TokenScope) -> Callable[..., Coroutine[None, None, Principal]]:
    """A dependency that admits callers whose scope includes `needed` and whose action limit,
    if any, names what the request does (403 otherwise). Every REST route goes through it."""

    async def check_scope(request: Request, principal: PrincipalDep) -> Principal:
        if not principal.scope.allows(needed):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token '{principal.name}' has scope '{principal.scope}'; "
                f"this needs '{needed}' or above",
            )
        refused = principal.refusal(request)
        if refused is not None:
            raise HTTPException(status.HTTP_403_FORBIDDEN, refused)
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


async def get_pagination(
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


async def get_dispatcher(request: Request) -> Dispatcher:
    """The publisher of launch and cancel orders to the node agents."""
    return request.app.state.dispatcher


DispatcherDep = Annotated[Dispatcher, Depends(get_dispatcher)]


async def get_beat_batches(request: Request) -> BeatBatches | None:
    """Where plain heartbeats wait to be written together; None on SQLite (one writer)."""
    return request.app.state.beat_batches


BeatBatchesDep = Annotated[BeatBatches | None, Depends(get_beat_batches)]

agent_bearer = HTTPBearer(
    auto_error=False, scheme_name="AgentToken",
    description="The token a node's agent made up and registered (agent endpoints only).",
)


async def get_agent_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(agent_bearer)],
) -> str:
    """The bearer token of an agent call (checked against the nodes by `agent_node`); 401 if absent."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing agent token: send 'Authorization: Bearer <agent token>'")
    return credentials.credentials


AgentTokenDep = Annotated[str, Depends(get_agent_token)]


def agent_node(session: Session, token: str) -> Node:
    """The node whose agent holds `token`; 401 otherwise."""
    from app.queries.agents import node_by_agent_token

    node = node_by_agent_token(session, token=token)
    if node is None:
        raise _unauthorized("unknown agent token: the node was deleted or re-joined elsewhere")
    return node


def get_agent_node(session: SessionDep, token: AgentTokenDep) -> Node:
    """The node whose agent presents this bearer token; 401 otherwise."""
    return agent_node(session, token)


AgentNodeDep = Annotated[Node, Depends(get_agent_node)]

metrics_bearer = HTTPBearer(
    auto_error=False, scheme_name="RunMetricsToken",
    description="A rank's token handed to its trainer at launch: its own records, its run's checkpoints and bundle.",
)


async def get_metrics_token(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(metrics_bearer)],
) -> str:
    """The bearer token of a metrics POST (checked against the run by the handler)."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise _unauthorized("missing run token: send 'Authorization: Bearer <run metrics token>'")
    return credentials.credentials


MetricsTokenDep = Annotated[str, Depends(get_metrics_token)]
