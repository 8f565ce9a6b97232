"""`GET /metrics`: the control plane's metrics for Prometheus (app/telemetry.py).

Who may scrape: with `HYBRIDTRAIN_METRICS_TOKEN` set, whoever sends it as a bearer token;
without it, only a client on this host that no proxy relayed (docs/deploy.md, "Monitoring").
"""

from __future__ import annotations

import ipaddress

from fastapi import APIRouter, HTTPException, Request, Response, status
from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4

from app.api.deps import SessionDep, SettingsDep
from app.config import Settings
from app.security import secrets_equal

router = APIRouter()

# A request relayed by a proxy on this host arrives from 127.0.0.1 too; these headers give
# it away, and such a request may come from anywhere.
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def _is_loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def check_scraper(request: Request, settings: Settings) -> None:
    """Admit the scraper the settings allow; 401 or 403 saying what to send otherwise."""
    expected = settings.metrics_token
    if expected is not None:
        given = request.headers.get("authorization", "")
        scheme, _, secret = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets_equal(secret.strip(), expected.get_secret_value()):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing or wrong metrics token: send 'Authorization: Bearer <HYBRIDTRAIN_METRICS_TOKEN>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return
    client = request.client.host if request.client else None
    relayed = any(name in request.headers for name in _PROXY_HEADERS)
    if relayed or not _is_loopback(client):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "HYBRIDTRAIN_METRICS_TOKEN is not set, so /metrics answers only on this host "
            "(127.0.0.1 or ::1, not through a proxy); set it to scrape from elsewhere",
        )


@router.get("/metrics", include_in_schema=False)
def read_prometheus_metrics(request: Request, session: SessionDep, settings: SettingsDep) -> Response:
    """Requests, latency, ingestion, runs by state, the launch queue and live runs' figures."""
    check_scraper(request, settings)
    body = request.app.state.telemetry.exposition(session)
    return Response(content=body, media_type=CONTENT_TYPE_PLAIN_0_0_4)
