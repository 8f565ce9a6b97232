"""The training loop of a task (`--task module:function`), written with the same calls a user's
own loop makes (`trainer.loop`), so the built-in models and users' tasks share one path:
DataLoader shards, the task's loss, optimizer, schedule and metrics, evaluation on schedule,
checkpoints and resume (under a parameter server, the server checkpoints: trainer.checkpointing)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
import warnings

import torch

from hybridtrain.contract import EVENT_CHECKPOINT, EVENT_RESUMED
from hybridtrain.task import Task, TaskError, load_task
from trainer import checkpoint
from trainer.checkpoint_store import Uploader, load_latest
from trainer import loop as ht
from trainer.devices import to_device
from trainer.distributed_optimizer import DistributedOptimizer


def check_target(task: Task, target: str | None, ref: str) -> None:
    """A target must name a metric the task reports, in the direction the task says is better."""
    if not target:
        return
    from hybridtrain.contract import parse_target

    t = parse_target(target)
    directions = task.metric_directions
    if t.metric not in directions:
        raise TaskError(f"target {target}: task {ref} reports no metric {t.metric!r} "
                        f"(it reports {', '.join(sorted(directions)) or 'none: it has no eval_data'})")
    if directions[t.metric] != t.higher_is_better:
        better = "higher" if directions[t.metric] else "lower"
        raise TaskError(f"target {target}: {better} {t.metric} is better for task {ref}, so the target "
                        f"should read {t.metric}{'>=' if directions[t.metric] else '<='}{t.value:g}")


def run_task(ctx: ht.Context, *, task: Task | None = None) -> None:
    """Train the run's task on this worker to the last step or the target."""
    cfg = ctx.cfg
    if task is None:
        task = load_task(cfg.task, json.loads(cfg.task_args))
    check_target(task, cfg.target, cfg.task)
    # Seeded so a run is repeatable; the replicas' common start comes from worker 1 anyway.
    torch.manual_seed(cfg.seed)
    model = ht.prepare_model(task.model())
    module = ht.unwrap(model)
    optimizer = task.optimizer(module)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TaskError(f"task {cfg.task}: optimizer(model) returned {type(optimizer).__name__}, "
                        "not a torch.optim.Optimizer")
    loader = ht.data_loader(task.train_data, collate=task.collate, transform=task.transform,
                            workers=cfg.data_workers if cfg.data_workers is not None else task.data_workers)
    opt = DistributedOptimizer(optimizer, model)
    if ctx.client is not None and ctx.step:
        # Under a parameter server the model and optimizer state came with the start (a
        # joiner's, a resumed run's): the schedule replays the run's steps from its base rates.
        for group in optimizer.param_groups:
            group["lr"] = group.get("initial_lr", group["lr"])
    schedule = task.schedule(optimizer, ctx.max_steps) if task.schedule else None
    if ctx.client is not None:
        _fast_forward(schedule, ctx.step)
    elif cfg.resume:
        _restore(ctx, module, optimizer, schedule)
    store = Uploader(cfg.checkpoint_url, cfg.report_token) if cfg.checkpoint_url and ctx.rank == 0 else None
    saved_at = time.monotonic()
    autocast = (torch.autocast(ctx.device.type, dtype=torch.bfloat16) if cfg.amp
                else contextlib.nullcontext())
    eval_held = False
    while ctx.step < ctx.max_steps and not ctx.should_stop:
        progressed = False
        for inputs, target in loader:
            progressed = True
            opt.zero_grad()
            inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
            with autocast:
                loss = task.loss(model(inputs), target)
            loss.backward()
            opt.step(loss=loss)
            if schedule is not None:
                schedule.step()
            last = ctx.step == ctx.max_steps
            if task.eval_data is not None and (ctx.step % cfg.eval_every == 0 or last or eval_held):
                # An evaluation at an overlapped outer step would wait for its exchange, which
                # then overlaps nothing: it is held to the inner step the outer step lands
                # after, and scores the same common model there.
                eval_held = ctx.evaluation_would_wait and not last
                if not eval_held:
                    ht.evaluate(model, task.eval_data, metrics=task.metrics, loss=task.loss,
                                batch_size=task.eval_batch_size, collate=task.collate)
            due = (cfg.checkpoint_every and (ctx.step % cfg.checkpoint_every == 0 or last or ctx.should_stop)
                   or cfg.checkpoint_every_s and time.monotonic() - saved_at >= cfg.checkpoint_every_s)
            if due and ctx.client is None and ctx.rank == 0:
                _save(ctx, module, optimizer, schedule, store)
                saved_at = time.monotonic()
        if not progressed:
            raise TaskError(f"task {cfg.task}: the training data yielded no batch at step {ctx.step + 1}")
    ctx.finish()
    if store is not None:
        store.close()


def _fast_forward(schedule, step: int) -> None:
    """Step a fresh schedule `step` times, as the run's workers have: the same arithmetic."""
    if schedule is None or not step:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": on purpose
        for _ in range(step):
            schedule.step()


def _save(ctx: ht.Context, module: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule,
          store: Uploader | None) -> None:
    """All-reduce: rank 0 writes the run's one file (the replicas are equal)."""
    state = {"model": module.state_dict(), "optimizer": optimizer.state_dict(),
             "schedule": schedule.state_dict() if schedule is not None else None,
             "elapsed_s": ctx.elapsed(), "batch_sizes": ctx.batch_sizes}
    path = checkpoint.save(ctx.cfg.checkpoint_dir, ctx.step, state, ctx.cfg)
    ctx.metrics.event(ctx.step, EVENT_CHECKPOINT, detail=path.name + (", uploading" if store else ""))
    if store is not None:
        store.submit(ctx.step, path)


def _restore(ctx: ht.Context, module: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule) -> None:
    """All-reduce: rank 0 reads the latest checkpoint (the store's, else the directory's) and
    every rank takes it. PowerSGD's per-rank error feedback is not in it: it starts empty."""
    import torch.distributed as dist

    state = load_latest(ctx.cfg) if ctx.rank == 0 else None
    if dist.is_initialized():
        box = [state]
        dist.broadcast_object_list(box, src=0)
        state = box[0]
    if state is None:
        return
    module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if schedule is not None and state.get("schedule") is not None:
        schedule.load_state_dict(state["schedule"])
    ctx.batch_sizes = list(state["batch_sizes"])
    ctx.elapsed_s = state["elapsed_s"]
    ctx.step = state["step"]
    if ctx.rank == 0:
        ctx.metrics.event(ctx.step, EVENT_RESUMED, detail=f"from the checkpoint of step {ctx.step}")
    print(f"[worker rank {ctx.rank}] resumed from step {ctx.step}", file=sys.stderr, flush=True)
