"""What each rank's launch order carries: the run's training options (one typed JSON object),
the trainer's flags for how this deployment runs it (sites, speeds, checkpoints) and where the
rank reports, built from the run's rows."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.dispatch import LaunchOrder
from app.models import Node, Run, RunWorker
from hybridtrain.contract import is_ps, proportional_batch_sizes
from hybridtrain.data_access import DatasetAccess
from hybridtrain.train_options import CompressionOptions, TrainOptions


def rank_sites(session: Session, *, run: Run) -> list[str]:
    """The site id of each rank's node, as text, in rank order (the trainer's --sites labels)."""
    node_ids = [w.node_id for w in run.workers]
    rows = session.execute(select(Node.id, Node.site_id).where(Node.id.in_(node_ids))).all()
    site_of = {node_id: site_id for node_id, site_id in rows}
    return [str(site_of.get(w.node_id, "")) for w in sorted(run.workers, key=lambda w: w.rank)]


def train_options(run: Run, sites: Sequence[str]) -> dict[str, Any]:
    """The run's training options as the launch order carries them: the stored request
    (hybridtrain.train_options.TrainOptions) as JSON, unset options left out."""
    across = is_ps(run.strategy) and len(set(sites)) > 1 and all(sites)
    # A run stored before an option was removed (`overlap`) launches without it.
    compression = {k: v for k, v in (run.compression or {}).items() if k in CompressionOptions.model_fields}
    if compression.get("aggregate_at_sites") and not across:
        # Only where there are sites to aggregate at: a run within one site has none.
        del compression["aggregate_at_sites"]
    local_sgd = dict(run.local_sgd or {})
    if local_sgd.get("site_replicas") and not (sites and all(sites)):
        # Only where every rank's site is known: the trainer groups the replicas by them.
        del local_sgd["site_replicas"]
    options = TrainOptions(
        strategy=run.strategy,
        task=run.task, task_args=run.task_args or {}, script=run.script,
        global_batch_size=run.global_batch_size,
        # A run given in epochs has its steps once the trainer has counted the task's samples.
        max_steps=run.max_steps, epochs=run.epochs if run.max_steps is None else None,
        target=run.target,
        stop_at_target=run.stop_at_target is not False,  # None on a run not yet flushed: the default
        seed=run.seed or 0, device=run.device or "auto", eval_every=run.eval_every,
        # The plan's split travels as the batch sizes; the trainer's allocation says only whether
        # it re-splits them from observed times (its default for the strategy unless asked).
        allocation="measured" if run.rebalance_every is not None else None,
        rebalance_every=run.rebalance_every,
        compression=compression or None, local_sgd=local_sgd or None,
    )
    return options.model_dump(mode="json", exclude_none=True)


def _trainer_options(run: Run, sites: Sequence[str]) -> dict[str, Any]:
    """The trainer's flags for how this deployment runs the run: where its metrics go, its
    checkpoints, membership and sites (the training options travel as `train_options`)."""
    # Each node keeps its own copy of the metrics next to the role's log.
    options: dict[str, Any] = {"metrics-out": "metrics.jsonl"}
    if run.script is None:
        # None on a run not yet flushed: the trainer's defaults (off) apply.
        if run.checkpoint_every:
            options["checkpoint-every"] = run.checkpoint_every
        if run.checkpoint_every_s:
            options["checkpoint-every-s"] = run.checkpoint_every_s
    workers = sorted((w for w in run.workers if w.role == "worker"), key=lambda w: w.rank)
    if is_ps(run.strategy) and workers and all(w.speed for w in workers):
        # The speeds the plan split the batch with: a server that re-splits after a loss or a
        # join keeps those proportions, and a joiner says its own in the same units.
        options["speeds"] = [round(float(w.speed), 4) for w in workers]
    if is_ps(run.strategy) and run.min_workers is not None:
        options["min-workers"] = run.min_workers
        options["min-workers-wait-s"] = run.min_workers_wait_s
    replicas = bool((run.local_sgd or {}).get("site_replicas"))
    if is_ps(run.strategy) and (len(set(sites)) > 1 or replicas) and sites and all(sites):
        # The server's update then crosses to each remote site once (trainer/relay.py); site
        # replicas group the workers by them, within one site too (one replica).
        options["sites"] = ",".join(sites)
    return options


def checkpoint_url(run: Run, public_url: str) -> str:
    """Where the run's trainer uploads its checkpoints and reads the latest one back."""
    return f"{public_url.rstrip('/')}/api/v1/runs/{run.id}/checkpoint"


def current_batch_sizes(run: Run, live: Iterable[RunWorker]) -> list[int]:
    """Every worker rank's share of the global batch (rank order), split over the `live` ones
    in proportion to their planned speeds; a rank that is gone keeps the minimum of 1 the
    trainer's command line needs, which its server never hands out."""
    alive = {w.rank for w in live}
    workers = [w for w in run.workers if w.role == "worker"]
    speeds = [(w.speed or 1.0) if w.rank in alive else 1e-9 for w in workers]
    return proportional_batch_sizes(run.global_batch_size, speeds)


def launch_orders(
    run: Run,
    *,
    metrics_token: Callable[[int], str],
    public_url: str,
    link_secret: str | None = None,
    sites: Sequence[str] = (),
    datasets: Sequence[DatasetAccess] = (),
    ranks: Iterable[RunWorker] | None = None,
    join: bool = False,
    resume: bool = False,
    batch_sizes: Sequence[int] | None = None,
    expect_ranks: Sequence[int] | None = None,
) -> list[LaunchOrder]:
    """One launch order per rank (`ranks`, default all), carrying everything the role's command
    line needs, with the report token `metrics_token` gives its rank; `sites` (one label per rank, `rank_sites`) lets a PS run relay its update once
    per remote site; `link_secret` keys the ranks' TLS; `datasets` are the run's data sets as its
    roles read them (with the store's credentials). `join` admits the ranks into the running run, `resume` starts them from
    the latest checkpoint (a restart); `batch_sizes` overrides the plan's split; `expect_ranks` are
    the worker ranks a PS run's start waits for (a restart's, which may have gaps)."""
    sizes = list(batch_sizes) if batch_sizes is not None else [
        w.batch_size for w in run.workers if w.role == "worker" and w.batch_size
    ]
    # The agent fetches the code with the run's own token, from its own server URL.
    bundle = (
        {"sha256": run.bundle_sha256, "path": f"/api/v1/runs/{run.id}/bundle"}
        if run.bundle_sha256 else None
    )
    train = train_options(run, sites)
    options = _trainer_options(run, sites)
    # A script of the user's own checkpoints itself: --resume restores a task's run only.
    checkpoints = run.script is None and (bool(run.checkpoint_every) or bool(run.checkpoint_every_s) or resume)
    if resume and run.script is None:
        options["resume"] = True
    if expect_ranks is not None and is_ps(run.strategy):
        options["expect-ranks"] = sorted(expect_ranks)
    orders = []
    for worker in run.workers if ranks is None else ranks:
        assert worker.node_id is not None
        env = {}
        if worker.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(worker.gpu_index)
        spec = {
            "run_id": run.id,
            "rank": worker.rank,
            "role": worker.role,
            "world_size": len(run.workers),
            "master_addr": run.master_addr,
            "master_port": run.master_port,
            # Rank 0 listens: its agent checks the port is free there, else picks one and
            # reports it in the rank's `started` event; the other ranks are sent it after.
            "pick_port": worker.rank == 0,
            "batch_sizes": sizes,
            "report_url": f"{public_url.rstrip('/')}/api/v1/runs/{run.id}/metrics",
            "report_token": metrics_token(worker.rank),
            # Only where set: an agent that predates encrypted links still takes a plain run.
            **({"link_secret": link_secret} if link_secret else {}),
            "train_options": train,
            "options": options,
            "env": env,
            "bundle": bundle,
            "script_args": list(run.script_args or []),
            "checkpoint_url": checkpoint_url(run, public_url) if checkpoints else None,
            # Only where set: an agent that predates data sets still takes a run without any.
            **({"datasets": [
                # A data set in this control plane's store is fetched with the rank's token.
                d.model_copy(update={"token": metrics_token(worker.rank)} if d.store_url else {}).model_dump(mode="json")
                for d in datasets]} if datasets else {}),
            "join": join,
            "attempt": run.restarts or 0,
        }
        orders.append(LaunchOrder(node_id=worker.node_id, run_id=run.id, rank=worker.rank, spec=spec))
    return orders
