"""The control plane's FastAPI application, built by `create_app(settings)`."""

from __future__ import annotations

import gc
import logging
import math
import reprlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from app.api.main import api_router
from app.agent_wheel import AgentWheel, source_tree
from app.beat_batches import BeatBatches
from app.api.routes import dist, health, prometheus
from app.config import Settings, get_settings
from app.capacity import RETRY_AFTER_S, AdmissionMiddleware
from app.request_limits import RequestLimitsMiddleware
from app.db import make_engine, make_health_engine, make_sessionmaker
from app.errors import (
    ConflictError,
    HybridtrainError,
    InvalidFieldError,
    NotFoundError,
)
from app.dispatch import Dispatcher
from app.monitor import Monitor
from app.telemetry import install_telemetry
from app.web import install_dashboard

logger = logging.getLogger(__name__)

API_PREFIX = "/api/v1"


def _error(status_code: int, detail: Any) -> JSONResponse:
    return JSONResponse(status_code=status_code, content={"detail": detail})


def _loc(field: str) -> list[str | int]:
    # "gpus.0.model" -> ["body", "gpus", 0, "model"], the shape of FastAPI's own 422s.
    return ["body", *(int(part) if part.isdigit() else part for part in field.split("."))]


# How much of an offending value a validation error shows: enough to recognise it, never the
# whole body back (a 10^6-point batch was once echoed in a 91 MB answer).
EXCERPT_CHARS = 80
MAX_ERRORS_SHOWN = 20
# A bounded repr of nested values: its cost does not grow with the value's size.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 4, 4, 4
_REPR.maxstring = _REPR.maxother = EXCERPT_CHARS


def excerpt(value: Any) -> Any:
    """`value` as a validation error may show it: numbers and short text as they are (NaN and
    Infinity as text, which JSON can carry), anything longer or nested as a bounded repr."""
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    text = value if isinstance(value, str) else _REPR.repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "..."


def _trimmed(errors: Sequence[Any]) -> list[dict[str, Any]]:
    trimmed = []
    for error in errors[:MAX_ERRORS_SHOWN]:
        error = dict(error)
        if "input" in error:
            error["input"] = excerpt(error["input"])
        if "ctx" in error:
            error["ctx"] = {key: excerpt(value) for key, value in error["ctx"].items()}
        trimmed.append(error)
    if len(errors) > MAX_ERRORS_SHOWN:
        trimmed.append({"type": "too_many_errors", "loc": ["body"],
                        "msg": f"{len(errors) - MAX_ERRORS_SHOWN} more errors not shown", "input": None})
    return jsonable_encoder(trimmed)


def _install_error_handlers(app: FastAPI) -> None:
    """Translate domain and database errors into HTTP answers, at the boundary."""

    @app.exception_handler(RequestValidationError)
    def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(status.HTTP_422_UNPROCESSABLE_CONTENT, _trimmed(exc.errors()))

    @app.exception_handler(NotFoundError)
    def not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        detail = f"{exc.field}: {exc.message}" if exc.field else exc.message
        return _error(status.HTTP_404_NOT_FOUND, detail)

    @app.exception_handler(ConflictError)
    def conflict(_: Request, exc: ConflictError) -> JSONResponse:
        return _error(status.HTTP_409_CONFLICT, exc.message)

    @app.exception_handler(InvalidFieldError)
    def invalid_field(_: Request, exc: InvalidFieldError) -> JSONResponse:
        detail = [{"type": "value_error", "loc": _loc(exc.field), "msg": exc.message}]
        return _error(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)

    @app.exception_handler(HybridtrainError)
    def other_domain_error(_: Request, exc: HybridtrainError) -> JSONResponse:
        return _error(status.HTTP_400_BAD_REQUEST, exc.message)

    @app.exception_handler(IntegrityError)
    def integrity(_: Request, exc: IntegrityError) -> JSONResponse:
        # The queries check uniqueness first; this catches the race between two requests.
        logger.info("integrity error answered as 409: %s", exc.orig)
        return _error(status.HTTP_409_CONFLICT, "conflicts with a concurrent change; retry")

    @app.exception_handler(OperationalError)
    def database_unavailable(_: Request, exc: OperationalError) -> JSONResponse:
        logger.warning("database unavailable: %s", exc.orig)
        return _error(status.HTTP_503_SERVICE_UNAVAILABLE, "the database is unavailable")

    @app.exception_handler(PoolTimeoutError)
    def pool_exhausted(_: Request, exc: PoolTimeoutError) -> JSONResponse:
        # Admission keeps a connection for every admitted request; this is a bug's symptom.
        logger.error("no pooled connection in time: %s", exc)
        response = _error(status.HTTP_503_SERVICE_UNAVAILABLE, "the server is at capacity; retry")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(DBAPIError)
    def database_error(_: Request, exc: DBAPIError) -> JSONResponse:
        logger.error("database error: %s", exc.orig)
        return _error(status.HTTP_503_SERVICE_UNAVAILABLE, "the database refused the request")


def create_app(settings: Settings | None = None) -> FastAPI:
    """A control-plane app on `settings` (default: the environment's). It does not migrate."""
    settings = settings or get_settings()
    engine = make_engine(settings)
    health_engine = make_health_engine(settings, engine)
    factory = make_sessionmaker(engine)
    # Runs: orders to the agents, and the periodic check for silent nodes (app/monitor.py).
    dispatcher = Dispatcher(settings.celery_broker_url)
    monitor = Monitor(factory, settings, dispatcher)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Move everything loaded at start-up (modules, the OpenAPI schema, validators) out of
        # the collector's reach: otherwise each full collection walks them all and stalls a
        # request for ~100 ms (it set the p99 of a node page in bench/api.py).
        gc.collect()
        gc.freeze()
        monitor.start()
        yield
        monitor.stop()
        dispatcher.close()
        engine.dispose()
        health_engine.dispose()

    app = FastAPI(
        title="hybridtrain control plane",
        summary="Inventory, prices and runs of data-parallel training across sites.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.health_engine = health_engine
    app.state.sessionmaker = factory
    app.state.dispatcher = dispatcher
    app.state.beat_batches = None if settings.is_sqlite else BeatBatches()
    app.state.monitor = monitor
    app.state.agent_wheel = AgentWheel(settings.agent_wheel, source_tree())
    _install_error_handlers(app)
    app.include_router(health.router, tags=["health"])
    app.include_router(prometheus.router, tags=["operations"])
    app.include_router(dist.router, tags=["operations"])
    app.include_router(api_router, prefix=API_PREFIX)
    install_dashboard(app)
    # Inside the request metrics, so that their 503s and 413s are counted with the rest.
    app.add_middleware(RequestLimitsMiddleware, settings=settings)
    app.add_middleware(AdmissionMiddleware, settings=settings)
    install_telemetry(app)
    if settings.trusted_proxies:
        # Added last, so outermost: everything inside sees the client and scheme it forwarded.
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.trusted_proxies)
    return app
