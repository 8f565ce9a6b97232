"""A Python client of the control plane's REST API (httpx), for CI pipelines and the CLI.

    client = HybridtrainClient("http://cp:8000", token)
    run = client.create_run({"name": "nightly", "node_ids": [1, 2, 3]}, idempotency_key="build-42")
    run = client.wait_for_run(run["id"])
    assert run["status"] == "succeeded", run["reason"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

FINISHED = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(Exception):
    """The control plane answered with an error (or could not be reached: status 0)."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"{status_code}: {detail}" if status_code else str(detail))
        self.status_code = status_code
        self.detail = detail


class RunTimeout(Exception):
    """A run did not finish within the time given to `wait_for_run`."""


class HybridtrainClient:
    """Calls /api/v1 with a bearer token; every method returns the decoded JSON answer."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/") + "/api/v1", headers=headers, timeout=timeout_s,
            transport=transport,
        )

    def close(self) -> None:
        """Release the connection pool."""
        self._http.close()

    def __enter__(self) -> HybridtrainClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise ApiError(0, f"cannot reach the control plane at {self._http.base_url}: {exc}") from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response.json() if response.content else None

    # -- runs -----------------------------------------------------------------------------

    def plan_run(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Preview a run's plan."""
        return self._call("POST", "/runs/plan", json=dict(body))

    def create_run(self, body: Mapping[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        """Launch a run; with the same `idempotency_key`, a retry returns the same run."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/runs", json=dict(body), headers=headers)

    def get_run(self, run_id: int) -> dict[str, Any]:
        """A run with its plan and status."""
        return self._call("GET", f"/runs/{run_id}")

    def list_runs(self, *, status: str | None = None, skip: int = 0, limit: int = 100) -> dict[str, Any]:
        """A page of runs, newest first."""
        params: dict[str, Any] = {"skip": skip, "limit": limit}
        if status:
            params["status"] = status
        return self._call("GET", "/runs", params=params)

    def cancel_run(self, run_id: int, *, reason: str | None = None) -> dict[str, Any]:
        """Cancel an active run."""
        return self._call("POST", f"/runs/{run_id}/cancel", json={"reason": reason} if reason else None)

    def metrics(
        self,
        run_id: int,
        *,
        names: Sequence[str] = (),
        rank: int | None = None,
        since: float | None = None,
        max_points: int = 1000,
    ) -> dict[str, Any]:
        """A run's metric series (downsampled to `max_points` per series)."""
        params: list[tuple[str, Any]] = [("name", n) for n in names]
        if rank is not None:
            params.append(("rank", rank))
        if since is not None:
            params.append(("since", since))
        params.append(("max_points", max_points))
        return self._call("GET", f"/runs/{run_id}/metrics", params=params)

    def logs(self, run_id: int, *, rank: int | None = None, tail: int = 200) -> dict[str, Any]:
        """The last output lines of a run's ranks."""
        params: dict[str, Any] = {"tail": tail}
        if rank is not None:
            params["rank"] = rank
        return self._call("GET", f"/runs/{run_id}/logs", params=params)

    def wait_for_run(
        self,
        run_id: int,
        *,
        timeout_s: float | None = None,
        poll_s: float = 2.0,
        on_change: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the run has finished and return it; RunTimeout after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = None
        while True:
            run = self.get_run(run_id)
            state = (run["status"], tuple(w["status"] for w in run["workers"]))
            if state != last and on_change is not None:
                on_change(run)
            last = state
            if run["status"] in FINISHED:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout(f"run {run_id} is still {run['status']} after {timeout_s} s")
            time.sleep(poll_s)

    # -- nodes ----------------------------------------------------------------------------

    def list_nodes(self, *, skip: int = 0, limit: int = 100, **filters: Any) -> dict[str, Any]:
        """A page of nodes (filters: site_id, status, spot, provider, kind)."""
        params = {"skip": skip, "limit": limit, **{k: v for k, v in filters.items() if v is not None}}
        return self._call("GET", "/nodes", params=params)
