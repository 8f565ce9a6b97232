"""A Python client of the control plane's REST API (httpx), for CI pipelines and the CLI.

    client = HybridtrainClient("http://cp:8000", token)
    packed = pack_workdir(".")  # hybridtrain.packing
    client.upload_bundle(packed.data, packed.sha256, "work.tar.gz")
    run = client.create_run({"name": "nightly", "node_ids": [1, 2, 3], "bundle_sha256": packed.sha256,
                             "task": "mytask:task"}, idempotency_key="build-42")
    run = client.wait_for_run(run["id"])
    assert run["status"] == "succeeded", run["reason"]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from hybridtrain.contract import BUNDLE_MEDIA_TYPE

FINISHED = frozenset({"succeeded", "failed", "cancelled"})
# Answers of a control plane that is restarting or behind a proxy that lost it (and 0: no
# answer at all); a poll rides these out instead of abandoning a run that goes on.
TRANSIENT_STATUS = frozenset({0, 502, 503, 504})
_MAX_BACKOFF_S = 30.0


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
                body = response.json()
            except ValueError:
                body = None
            detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
            raise ApiError(response.status_code, detail.strip() if isinstance(detail, str) else detail)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            # A proxy's HTML page in place of the API: say so rather than fail on decoding.
            raise ApiError(response.status_code, f"not a JSON answer from {response.url}") from exc

    # -- runs -----------------------------------------------------------------------------

    def plan_run(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Preview a run's plan."""
        return self._call("POST", "/runs/plan", json=dict(body))

    def optimize_plan(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The plan the performance model finds best over candidate nodes, explained."""
        return self._call("POST", "/plans/optimize", json=dict(body))

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

    def drain_node(self, node_id: int) -> dict[str, Any]:
        """Let a node finish its runs and give it no new one."""
        return self._call("POST", f"/nodes/{node_id}/drain")

    def undrain_node(self, node_id: int) -> dict[str, Any]:
        """End a node's drain: it takes runs again."""
        return self._call("POST", f"/nodes/{node_id}/undrain")

    def add_run_nodes(self, run_id: int, node_ids: Sequence[int]) -> dict[str, Any]:
        """Add workers on these nodes to a running PS run."""
        return self._call("POST", f"/runs/{run_id}/nodes", json={"node_ids": list(node_ids)})

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
        retry_for_s: float = 300.0,
        on_change: Callable[[dict[str, Any]], None] | None = None,
        on_poll: Callable[[dict[str, Any]], None] | None = None,
        on_retry: Callable[[ApiError, float], None] | None = None,
    ) -> dict[str, Any]:
        """Poll until the run has finished and return it; RunTimeout after `timeout_s`.

        A dropped connection or a restarting control plane (502/503/504) is retried with
        exponential backoff (capped at 30 s) for up to `retry_for_s`, then raised as ApiError
        with status 0 (unreachable). `on_poll` sees every answer, `on_change` each new state.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last = None
        failing_since: float | None = None
        backoff = poll_s
        while True:
            try:
                run = self.get_run(run_id)
            except ApiError as exc:
                if exc.status_code not in TRANSIENT_STATUS:
                    raise
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= retry_for_s:
                    raise ApiError(
                        0, f"gave up on run {run_id} after {retry_for_s:g} s without an answer: {exc}"
                    ) from exc
                if deadline is not None and now > deadline:
                    raise RunTimeout(f"run {run_id}: no answer from the control plane for "
                                     f"{now - failing_since:.0f} s when the {timeout_s} s ran out") from exc
                pause = min(backoff, _MAX_BACKOFF_S, failing_since + retry_for_s - now)
                if on_retry is not None:
                    on_retry(exc, pause)
                time.sleep(max(pause, 0.0))
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            failing_since, backoff = None, poll_s
            state = (run["status"], run.get("restarts"), tuple(w["status"] for w in run["workers"]))
            if state != last and on_change is not None:
                on_change(run)
            last = state
            if on_poll is not None:
                on_poll(run)
            if run["status"] in FINISHED:
                return run
            if deadline is not None and time.monotonic() > deadline:
                raise RunTimeout(f"run {run_id} is still {run['status']} after {timeout_s} s")
            time.sleep(poll_s)

    # -- bundles --------------------------------------------------------------------------

    def upload_bundle(self, data: bytes, sha256: str, filename: str | None = None) -> dict[str, Any]:
        """Store a code bundle (a gzipped tar); the server verifies `sha256` against the bytes."""
        headers = {"Content-Type": BUNDLE_MEDIA_TYPE, "X-Bundle-Sha256": sha256}
        if filename:
            headers["X-Bundle-Filename"] = filename
        return self._call("POST", "/bundles", content=data, headers=headers)

    def get_bundle(self, sha256: str) -> dict[str, Any]:
        """A stored bundle's description (ApiError 404 when the server does not have it)."""
        return self._call("GET", f"/bundles/{sha256}")

    def list_bundles(self, *, skip: int = 0, limit: int = 100) -> dict[str, Any]:
        """A page of stored bundles."""
        return self._call("GET", "/bundles", params={"skip": skip, "limit": limit})

    def delete_bundle(self, sha256: str) -> None:
        """Delete a bundle (ApiError 409 while an active run uses it)."""
        self._call("DELETE", f"/bundles/{sha256}")

    # -- task profiles --------------------------------------------------------------------

    def create_profiles(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Ask each node in `body["node_ids"]` to profile a task; one pending profile per node."""
        return self._call("POST", "/tasks/profiles", json=dict(body))

    def get_profile(self, profile_id: int) -> dict[str, Any]:
        """A task profile with its status and, once done, its result."""
        return self._call("GET", f"/tasks/profiles/{profile_id}")

    def list_profiles(self, *, task_key: str | None = None, node_id: int | None = None) -> Any:
        """Task profiles, optionally of one task key or one node."""
        params = {k: v for k, v in (("task_key", task_key), ("node_id", node_id)) if v is not None}
        return self._call("GET", "/tasks/profiles", params=params)

    # -- nodes ----------------------------------------------------------------------------

    def list_nodes(self, *, skip: int = 0, limit: int = 100, **filters: Any) -> dict[str, Any]:
        """A page of nodes (filters: site_id, status, spot, provider, kind)."""
        params = {"skip": skip, "limit": limit, **{k: v for k, v in filters.items() if v is not None}}
        return self._call("GET", "/nodes", params=params)

    # -- clusters -------------------------------------------------------------------------

    def list_datasets(self, *, skip: int = 0, limit: int = 100) -> dict[str, Any]:
        """A page of data sets, by name."""
        return self._call("GET", "/datasets", params={"skip": skip, "limit": limit})

    def get_dataset(self, name: str) -> dict[str, Any]:
        """One data set."""
        return self._call("GET", f"/datasets/{name}")

    def register_dataset(self, body: dict[str, Any]) -> dict[str, Any]:
        """Register a data set by URL (the control plane reads its index)."""
        return self._call("POST", "/datasets", json=body)

    def upload_dataset_file(self, name: str, path: Any, progress: Any = None) -> dict[str, Any]:
        """Stream one file of a data set into the control plane's store; `progress(n)` is
        called with each chunk's bytes."""
        def chunks() -> Any:
            with open(path, "rb") as source:
                while chunk := source.read(1024 * 1024):
                    if progress is not None:
                        progress(len(chunk))
                    yield chunk

        return self._call("PUT", f"/datasets/{name}/files/{path.name}", content=chunks(),
                          headers={"Content-Type": "application/octet-stream"}, timeout=None)

    def delete_dataset(self, name: str) -> None:
        """Forget a data set (its files stay in the store)."""
        self._call("DELETE", f"/datasets/{name}")

    def list_clusters(self, *, skip: int = 0, limit: int = 100) -> dict[str, Any]:
        """A page of clusters, ordered by id."""
        return self._call("GET", "/clusters", params={"skip": skip, "limit": limit})

    def get_cluster(self, cluster_id: int) -> dict[str, Any]:
        """One cluster with its node ids."""
        return self._call("GET", f"/clusters/{cluster_id}")

    def create_cluster(self, name: str, node_ids: Sequence[int], *, description: str = "") -> dict[str, Any]:
        """Group existing nodes into a named cluster."""
        return self._call("POST", "/clusters",
                          json={"name": name, "node_ids": list(node_ids), "description": description})

    def delete_cluster(self, cluster_id: int) -> None:
        """Remove a cluster (its nodes stay)."""
        self._call("DELETE", f"/clusters/{cluster_id}")
