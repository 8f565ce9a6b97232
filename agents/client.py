"""The agent's HTTP client for the control plane (see "Agent ↔ control plane" in
docs/architecture.md): register, heartbeat, role events, logs, profile results, link
probes and bundle downloads."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping
from typing import Any, Protocol

import httpx

from agents.errors import (
    AgentAuthError,
    ControlPlaneError,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1/agent"
DOWNLOAD_CHUNK_BYTES = 1 << 20
# Below the control plane's keep-alive (app/config.py `keep_alive_s`), above a heartbeat's interval.
KEEPALIVE_EXPIRY_S = 20.0


class Sink(Protocol):
    """Where a download's bytes go; `write` may raise to abort the download."""

    def write(self, data: bytes, /) -> Any: ...


class ControlPlaneClient:
    """Calls the agent endpoints of one control plane; thread-safe (httpx.Client is)."""

    def __init__(
        self,
        server_url: str,
        *,
        agent_token: str | None = None,
        timeout_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self._agent_token = agent_token
        # An idle connection is dropped by the agent after 20 s, before the control plane's 30 s
        # (`keep_alive_s`): with httpx's 5 s, as long as a heartbeat's interval, each beat raced
        # the server's close of the connection it was about to reuse.
        self._http = httpx.Client(
            base_url=self.server_url + API_PREFIX, timeout=timeout_s, transport=transport,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    def close(self) -> None:
        """Release the connection pool."""
        self._http.close()

    def set_agent_token(self, token: str) -> None:
        """Authenticate later calls with the node's agent token."""
        self._agent_token = token

    @property
    def agent_token(self) -> str | None:
        """The node's agent token, once registered (profile bundles are fetched with it)."""
        return self._agent_token

    def _post(self, path: str, body: Mapping[str, Any], *, auth: bool = True) -> dict[str, Any]:
        headers = {}
        if auth:
            if not self._agent_token:
                raise AgentAuthError(f"no agent token to call {path}")
            headers["Authorization"] = f"Bearer {self._agent_token}"
        try:
            response = self._http.post(path, json=dict(body), headers=headers)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"control plane at {self.server_url} unreachable on {path}: {exc!r}"
            ) from exc
        _raise_for_status(response, path)
        if response.status_code == 204 or not response.content:
            return {}
        return dict(response.json())

    def download(self, path: str, *, token: str, sink: Sink) -> int:
        """Stream GET `<server_url><path>` with `token` into `sink`; returns the byte count.

        `path` is absolute on the server (e.g. /api/v1/runs/7/bundle), not under the agent
        prefix. Errors as for the other calls; whatever `sink.write` raises propagates.
        """
        headers = {"Authorization": f"Bearer {token}"}
        size = 0
        try:
            with self._http.stream("GET", self.server_url + path, headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for_status(response, path)
                for chunk in response.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                    sink.write(chunk)
                    size += len(chunk)
        except httpx.HTTPError as exc:
            raise ControlPlaneUnavailable(
                f"control plane at {self.server_url} unreachable on {path}: {exc!r}"
            ) from exc
        return size

    def register(
        self, *, join_token: str, agent_token: str, hardware: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Bind this machine to the node of `join_token`; returns node id, name and queue."""
        body = {"join_token": join_token, "agent_token": agent_token, "hardware": dict(hardware)}
        return self._post("/register", body, auth=False)

    def broker(self) -> dict[str, Any]:
        """The broker to take orders from: {"url", "node_user"} (a Redis user of this node's own)."""
        return self._post("/broker", {})

    def heartbeat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Report liveness and roles; the answer may list roles the agent must stop."""
        return self._post("/heartbeat", body)

    def role_event(self, run_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
        """Report that a role started or exited."""
        return self._post(f"/runs/{run_id}/events", body)

    def logs(self, run_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
        """Ship a batch of a role's output lines."""
        return self._post(f"/runs/{run_id}/logs", body)

    def reports(self, run_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
        """Deliver records a trainer of this node spooled (with the agent's own token)."""
        return self._post(f"/runs/{run_id}/metrics", body)

    def profile_result(self, profile_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
        """Report a task profile: {"status": "done", "result": ...} or {"status": "failed", ...}."""
        return self._post(f"/profiles/{profile_id}", body)

    def link_results(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Report link probes: {"results": [...], "errors": [...]} measured from this node."""
        return self._post("/links", body)


def _raise_for_status(response: httpx.Response, path: str) -> None:
    if response.status_code >= 500:
        raise ControlPlaneUnavailable(
            f"control plane failed on {path}: {response.status_code} {response.text[:300]}",
            status_code=response.status_code, retry_after_s=_retry_after_s(response),
        )
    if response.status_code in (401, 403):
        raise AgentAuthError(
            f"control plane refused the credentials on {path}: {_detail(response)}",
            status_code=response.status_code,
        )
    if response.status_code >= 400:
        raise ControlPlaneRejected(
            f"control plane rejected {path}: {response.status_code} {_detail(response)}",
            status_code=response.status_code,
        )


def _retry_after_s(response: httpx.Response) -> float | None:
    """The Retry-After of an answer in seconds; None when absent or a date (we never send one)."""
    try:
        seconds = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < 3600 else None


def beat_retry_delay_s(
    retry_after_s: float | None, *, interval_s: float, failures: int, rng: random.Random | None = None
) -> float:
    """How long the heartbeat loop waits after `failures` failed beats in a row. A beat the
    control plane shed (an answer with Retry-After) is sent again after Retry-After, stretched
    by up to half again so that agents shed together come back spread out, doubling with each
    refusal in a row; never later than the regular interval, which any other failure waits."""
    if retry_after_s is None:
        return interval_s
    spread = (rng or random).uniform(1.0, 1.5)
    return min(interval_s, retry_after_s * 2 ** (max(failures, 1) - 1) * spread)


def call_with_retry(
    fn: Any,
    *args: Any,
    deadline_s: float,
    first_delay_s: float = 0.5,
    max_delay_s: float = 5.0,
    **kwargs: Any,
) -> Any:
    """Call `fn`, retrying only ControlPlaneUnavailable with exponential backoff until
    `deadline_s` has passed; other errors propagate at once."""
    start = time.monotonic()
    delay = first_delay_s
    while True:
        try:
            return fn(*args, **kwargs)
        except ControlPlaneUnavailable as exc:
            if time.monotonic() - start + delay > deadline_s:
                raise
            log.warning("%s; retrying in %.1f s", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)


def retry_conflicts(
    fn: Any, *args: Any, deadline_s: float, conflict_deadline_s: float,
    first_delay_s: float = 1.0, max_delay_s: float = 10.0, **kwargs: Any,
) -> Any:
    """`call_with_retry` until `deadline_s`, also retrying 409 answers for
    `conflict_deadline_s`: a conflict at registration is often transient (another agent of
    the node still registering or stopping), and the control plane says "retry"."""
    start = time.monotonic()
    delay = first_delay_s
    while True:
        remaining = deadline_s - (time.monotonic() - start)
        try:
            return call_with_retry(fn, *args, deadline_s=max(remaining, 0.0), **kwargs)
        except ControlPlaneRejected as exc:
            if exc.status_code != 409 or time.monotonic() - start + delay > conflict_deadline_s:
                raise
            log.warning("%s; retrying in %.1f s", exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, max_delay_s)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:300]


__all__ = ["ControlPlaneClient", "ControlPlaneError", "beat_retry_delay_s", "call_with_retry", "retry_conflicts"]
