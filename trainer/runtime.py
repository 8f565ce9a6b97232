"""Runs one role of a run: the parameter server, or a worker that trains a task or runs the
user's own script. Errors end the role with a one-line reason (the run's page shows the last
lines of its log) and, for a task that cannot be loaded, the user's traceback."""

from __future__ import annotations

import gc
import json
import logging
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtrain.contract import EXIT_TOO_FEW_WORKERS
from hybridtrain.task import TaskError, load_task
from trainer import stopping
from trainer.config import TrainConfig
from trainer.frames import ProtocolError
from trainer.linktls import LinkTls
from trainer.loop import WorkerLeft
from trainer.metrics import HttpReporter, MetricsLogger

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class RoleSpec:
    """Which process this is, and where the rendezvous is."""

    role: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    fail_at_step: int | None = None


def _serve(cfg: TrainConfig, spec: RoleSpec) -> None:
    from trainer.checkpoint_store import load_latest
    from trainer.server import ParameterServer
    from trainer.sockets import ServerSocketTransport

    torch.set_num_threads(cfg.threads)
    reporter = HttpReporter(cfg.report_url, cfg.report_token, spool=cfg.report_spool) if cfg.report_url else None
    metrics = MetricsLogger(spec.rank, spec.role, cfg.metrics_out, reporter)
    transport = None
    try:
        # Workers connect whenever they start (and join later): no fixed-size process group.
        transport = ServerSocketTransport(spec.master_addr, spec.master_port, timeout_s=cfg.timeout_s,
                                          tls=LinkTls.given(cfg.link_secret))
        server = ParameterServer(cfg, transport, metrics)
        state = load_latest(cfg) if cfg.resume else None
        if state is not None:
            server.resume(state)
        # A cancel or a spot notice: checkpoint at the next step boundary, then stop with the
        # reason; within trainer.stopping's deadline in any case.
        stopping.install(lambda: setattr(server, "preempted", True))
        server.serve()
    finally:
        if transport is not None:
            transport.close()
        metrics.close()


def use_code_dir(code_dir: str | None) -> None:
    """Put the user's code first on the import path. The trainer's and hybridtrain's own
    modules are already imported (and their submodules resolve through their packages), so a
    user's module of the same top-level name cannot replace them; launchers also start
    Python with PYTHONSAFEPATH, so the working directory is not searched before them."""
    if code_dir and code_dir not in sys.path:
        sys.path.insert(0, code_dir)


def _work(cfg: TrainConfig, spec: RoleSpec) -> None:
    import hybridtrain.task  # noqa: F401 - loaded before the user's code can shadow it
    from trainer import loop, taskloop  # noqa: F401

    use_code_dir(cfg.code_dir)

    # A task that cannot be loaded fails here, before the rendezvous, within seconds.
    task = load_task(cfg.task, json.loads(cfg.task_args)) if not cfg.script else None
    if task is not None:
        from trainer.taskloop import check_target

        check_target(task, cfg.target, cfg.task)
    ctx = loop.bootstrap(cfg, rank=spec.rank, role=spec.role, world_size=spec.world_size,
                         master_addr=spec.master_addr, master_port=spec.master_port,
                         fail_at_step=spec.fail_at_step)
    if cfg.is_ps:
        # A cancel or a spot notice (the agent forwards SIGTERM): leave at the next step
        # boundary, within trainer.stopping's deadline in any case.
        stopping.install(ctx.request_leave)
    try:
        if task is not None:
            from trainer.taskloop import run_task

            run_task(ctx, task=task)
        else:
            _run_script(cfg.script, cfg.script_args)
            ctx.finish()
    finally:
        ctx.metrics.close()
        loop.reset_for_tests()


def _run_script(script: str, args: tuple[str, ...]) -> None:
    """The user's own loop, in this process (it finds the context through hybridtrain.init())."""
    path = Path(script)
    if not path.is_file():
        raise TaskError(f"script {script}: no such file in {os.getcwd()}")
    saved = sys.argv[:]
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except WorkerLeft:
        raise
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise RuntimeError(f"script {script} exited with status {exc.code}") from None
    finally:
        sys.argv = saved


def run_role(cfg: TrainConfig, spec: RoleSpec) -> int:
    """Run `spec.role`; returns the exit status (0 on success) and says why on failure."""
    name = f"{spec.role} rank {spec.rank}"
    try:
        try:
            if spec.role == "ps":
                _serve(cfg, spec)
            else:
                _work(cfg, spec)
        finally:
            stopping.disarm()
    except stopping.Stopped as exc:
        print(f"[{name}] stopped: {exc}", file=sys.stderr, flush=True)
        return stopping.STOPPED_EXIT_CODE
    except KeyboardInterrupt:
        print(f"[{name}] interrupted", file=sys.stderr, flush=True)
        return 130
    except WorkerLeft as exc:
        print(f"[{name}] {exc}", file=sys.stderr, flush=True)
        # A worker that left exits 0 too, so it needs the same teardown as one that finished:
        # without it, about one leave in several under load aborted at exit (SIGABRT).
        _teardown()
        return 0
    except TaskError as exc:
        # The user's own traceback is in the message where there is one: it is what they fix.
        print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
        return 1
    except ProtocolError as exc:
        from trainer.joiner import TooFewWorkers

        print(f"[{name}] failed: {exc}", file=sys.stderr, flush=True)
        # Waiting longer would not help: the control plane fails the run rather than restart it.
        return EXIT_TOO_FEW_WORKERS if isinstance(exc, TooFewWorkers) else 1
    except Exception as exc:
        traceback.print_exc()
        print(f"[{name}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    _teardown()
    return 0


def _teardown() -> None:
    import torch.distributed as dist

    # DDP's reducer holds the process group and gloo work; left to interpreter finalisation it
    # is torn down after the group and aborts the process ("terminate called without an active
    # exception", about one run in three on torch 2.14). Release it while the group is alive.
    gc.collect()
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the run is over; a teardown hiccup must not fail it
        log.debug("process group teardown failed", exc_info=True)
