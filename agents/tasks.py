"""Celery tasks on a node's own queue: launch one trainer role, cancel a run's roles,
profile a task, probe links to other nodes.

Each task is a thin wrapper: `launch_role`, `cancel_run`, `profile_task` and `probe_links` are plain
functions that take what they use explicitly, so tests call them without a broker; the tasks
hand them the supervisor (or profiling context) of the running agent.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agents import probe, profiles
from agents import supervisor as supervision
from agents import task_context
from agents.bundles import BundleCache, remove_tree
from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE, app
from agents.client import ControlPlaneClient, call_with_retry
from agents.errors import AgentError, ControlPlaneError, ControlPlaneRejected, LaunchError
from agents.spec import ProfileSpec, RoleSpec
from hybridtrain.contract import PROBE_LINKS_TASK, PROFILE_TASK

log = logging.getLogger(__name__)


def launch_role(run_id: int, rank: int, spec: dict[str, Any], *, supervisor: supervision.Supervisor) -> dict[str, Any]:
    """Validate a launch order and start the role; returns its run, rank, pid and state.

    An order for a rank that this node already runs, or already ran (recorded in the state
    dir), starts nothing and reports that rank's current state.
    """
    if spec.get("run_id", run_id) != run_id or spec.get("rank", rank) != rank:
        raise LaunchError(
            f"launch order for run {run_id} rank {rank} carries a spec for "
            f"run {spec.get('run_id')} rank {spec.get('rank')}"
        )
    try:
        role_spec = RoleSpec.model_validate({**spec, "run_id": run_id, "rank": rank})
    except ValidationError as exc:
        raise LaunchError(f"invalid launch order for run {run_id} rank {rank}: {exc}") from exc
    role = supervisor.launch(role_spec)
    return {"run_id": run_id, "rank": rank, "pid": role.pid, "state": role.state}


def cancel_run(run_id: int, reason: str, *, supervisor: supervision.Supervisor,
               before_attempt: int | None = None) -> dict[str, Any]:
    """Stop every role of the run on this node (with `before_attempt`, those of earlier
    attempts only); returns the ranks that were running."""
    ranks = supervisor.cancel(run_id, reason=reason, before_attempt=before_attempt)
    return {"run_id": run_id, "cancelled_ranks": ranks}


def profile_task(
    profile_id: int,
    spec: dict[str, Any],
    *,
    client: ControlPlaneClient,
    cache: BundleCache,
    state_dir: Path,
    command: list[str] | None = None,
    timeout_s: float = profiles.DEFAULT_TIMEOUT_S,
    report_retry_s: float = 30.0,
    threads: int | None = None,
    lock_path: Path = profiles.DEFAULT_LOCK_PATH,
    lock_wait_s: float = profiles.DEFAULT_LOCK_WAIT_S,
    min_repeats: int = profiles.MIN_REPEATS,
    max_repeats: int = profiles.MAX_REPEATS,
    stable_spread: float = profiles.STABLE_SPREAD,
) -> dict[str, Any]:
    """Measure a task on this node (with the roles' `threads`) and report it; returns the body
    sent to the control plane.

    Fetches the bundle with the agent's own token, unpacks it into
    `state_dir/profiles/<id>/code`, then, holding the host's profile lock (`lock_path`), runs
    the profiler there as a child process until its samples/s are stable
    (`profiles.stable_measurement`) and POSTs {"status": "done", "result": ...} (with `spread`
    and `repeats`) or {"status": "failed", "error": ...}.
    """
    work = Path(state_dir) / "profiles" / str(int(profile_id))
    repeat = {"min_repeats": min_repeats, "max_repeats": max_repeats, "tolerance": stable_spread}
    try:
        result = _measure(work, spec, client, cache, command, timeout_s, threads,
                          lock=(Path(lock_path), lock_wait_s), repeat=repeat)
        body = {"status": "done", "result": result}
    except ValidationError as exc:
        body = {"status": "failed", "error": f"invalid profile order: {_first_error(exc)}"}
    except AgentError as exc:
        body = {"status": "failed", "error": str(exc)}
    except Exception as exc:  # a profile left pending forever would be worse than this report
        log.exception("profile %s: unexpected error", profile_id)
        body = {"status": "failed", "error": f"agent error: {exc!r}"}
    finally:
        remove_tree(work)
    if body["status"] == "failed":
        log.warning("profile %s failed: %s", profile_id, body["error"])
    try:
        call_with_retry(client.profile_result, profile_id, body, deadline_s=report_retry_s)
    except ControlPlaneRejected as exc:
        if body["status"] != "done":
            log.warning("could not report profile %s: %s", profile_id, exc)
            return body
        # A measurement the control plane cannot store (a profiler printing another shape)
        # must still end the profile rather than leave it pending.
        body = {"status": "failed", "error": f"the control plane refused the measurement: {exc}"}
        try:
            call_with_retry(client.profile_result, profile_id, body, deadline_s=report_retry_s)
        except ControlPlaneError as again:
            log.warning("could not report profile %s: %s", profile_id, again)
    except ControlPlaneError as exc:
        log.warning("could not report profile %s: %s", profile_id, exc)
    return body


def _measure(
    work: Path, spec: dict[str, Any], client: ControlPlaneClient, cache: BundleCache,
    command: list[str] | None, timeout_s: float, threads: int | None,
    *, lock: tuple[Path, float], repeat: dict[str, Any],
) -> dict[str, Any]:
    order = ProfileSpec.model_validate(spec)
    code = work / "code"
    if order.bundle is not None:
        token = client.agent_token
        if not token:
            raise LaunchError("the agent has no token to fetch the bundle with")
        cache.unpack(cache.ensure(order.bundle, token), code, ref=order.bundle)
    else:
        code.mkdir(parents=True, exist_ok=True)
    argv = profiles.profile_argv(order, command or profiles.DEFAULT_COMMAND)

    def once() -> dict[str, Any]:
        return profiles.run_profile(
            argv, cwd=code, code_dir=code if order.bundle is not None else None, timeout_s=timeout_s,
            threads=threads,
        )

    lock_path, wait_s = lock
    with profiles.host_lock(lock_path, wait_s=wait_s) as waited:
        if waited > 1:
            log.info("waited %.0f s for the host's profile lock %s", waited, lock_path)
        return profiles.stable_measurement(once, **repeat)


# Bounds of one probe order: a bulk send is capped so an order of many targets stays minutes long.
MAX_PROBE_SECONDS = 30.0
MAX_PROBE_TARGETS = 256


def probe_links(
    spec: dict[str, Any],
    *,
    client: ControlPlaneClient,
    node_id: int | None = None,
    measure: Any = probe.measure,
    report_retry_s: float = 30.0,
) -> dict[str, Any]:
    """Measure the link to each target in turn and report them; returns the body sent.

    `spec` is {"targets": [{"node_id", "host", "port"}], "seconds": s}; a target that fails
    is reported under "errors" with the reason, the others under "results".
    """
    body: dict[str, Any] = {"results": [], "errors": []}
    if node_id is not None:
        body["src_node_id"] = node_id
    try:
        seconds = float(spec.get("seconds", 1.0))
        targets = list(spec["targets"])
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("invalid probe order %r: %s", spec, exc)
        return body
    seconds = min(max(seconds, 0.05), MAX_PROBE_SECONDS)
    for target in targets[:MAX_PROBE_TARGETS]:
        try:
            dst = int(target["node_id"])
            host, port = str(target["host"]), int(target["port"])
        except (KeyError, TypeError, ValueError):
            log.warning("probe order names an invalid target %r", target)
            continue
        # The control plane schedules probes in rounds that share no node and no WAN pipe:
        # probing before the round's slot would share a link and under-read it.
        probe.wait_for_slot(target.get("start_at"))
        try:
            result = measure(host, port, seconds=seconds)
        except probe.ProbeError as exc:
            body["errors"].append({"dst_node_id": dst, "error": str(exc)[:1000]})
            continue
        body["results"].append({"dst_node_id": dst, **result.to_json()})
        log.info("link to node %s (%s:%s): %.1f Mbit/s, %.2f ms", dst, host, port,
                 result.mbps, result.rtt_ms)
    try:
        call_with_retry(client.link_results, body, deadline_s=report_retry_s)
    except ControlPlaneError as exc:
        log.warning("could not report link probes: %s", exc)
    return body


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "spec"
    return f"{where}: {err['msg']}"


# Late ack: a launch is idempotent per (run, rank) on this node (the supervisor's records
# outlive the agent process), so an order whose agent died before starting the role is
# delivered again rather than lost. No retries: a LaunchError is a bad order or a stopping
# agent, which a retry would not fix.
@app.task(name=LAUNCH_ROLE, acks_late=True)
def launch_role_task(run_id: int, rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point of `launch_role`."""
    return launch_role(run_id, rank, spec, supervisor=task_context.current().supervisor)


# Cancelling is idempotent (a run with nothing running is a no-op), so it acks late: an
# agent that dies mid-cancel gets the order again when it comes back.
@app.task(name=CANCEL_RUN, acks_late=True)
def cancel_run_task(run_id: int, reason: str = "cancelled", before_attempt: int | None = None) -> dict[str, Any]:
    """Celery entry point of `cancel_run`."""
    return cancel_run(run_id, reason, supervisor=task_context.current().supervisor, before_attempt=before_attempt)


# Early ack: a profile is cheap to ask for again, and a re-delivered one would compete for
# the GPU with a run. Bounded by the profiler's timeout plus the bundle's download deadline.
@app.task(name=PROFILE_TASK)
def profile_task_task(profile_id: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point of `profile_task`."""
    ctx = task_context.current().profiling
    return profile_task(
        profile_id, spec, client=ctx.client, cache=ctx.cache, state_dir=ctx.state_dir,
        command=ctx.command, timeout_s=ctx.timeout_s, threads=ctx.threads, lock_path=ctx.lock_path,
        lock_wait_s=ctx.lock_wait_s, min_repeats=ctx.min_repeats, max_repeats=ctx.max_repeats,
        stable_spread=ctx.stable_spread,
    )


# Early ack: a probe is cheap to order again, and a re-delivered one would measure a link
# twice. Bounded by its targets times (seconds + the probe's timeouts).
@app.task(name=PROBE_LINKS_TASK)
def probe_links_task(spec: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point of `probe_links`."""
    ctx = task_context.current()
    return probe_links(spec, client=ctx.client, node_id=ctx.node_id)
