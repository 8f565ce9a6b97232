"""`hybridtrain train ...` / `python -m trainer ...`: launch a local run, or one role of it.

Without --role the command starts the server and the workers as local processes on a free
port of 127.0.0.1 (like torchrun) and supervises them. With --role it is one of those processes,
which is how the node agents start a run across machines.
"""

from __future__ import annotations

import argparse
import logging
import sys

from trainer.allocation import ALLOCATIONS
from trainer.compression import COMPRESSORS, SELECT_METHODS, VALUE_DTYPES
from trainer.config import STRATEGIES, TrainConfig, default_allocation
from trainer.data import DATASETS
from trainer.models import MODELS


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _labels(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    """The trainer's options; defaults give a one-minute CPU run on the bundled digits."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="hybridtrain train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--strategy", choices=STRATEGIES, default=d.strategy)
    run.add_argument("--workers", type=int, default=None, help="workers (default 4, or from --world-size)")
    run.add_argument("--speeds", type=_floats, default=(), help="relative device speeds s_m, worker order")
    run.add_argument("--batch-sizes", type=_ints, default=(),
                     help="explicit per-worker batch sizes n_m (worker order), honoured exactly")
    run.add_argument("--global-batch", type=int, default=None, help=f"B (default {d.global_batch})")
    run.add_argument("--allocation", choices=ALLOCATIONS, default=None,
                     help="batch split: equal, flops (by --speeds), measured (re-balanced); "
                          "default flops for ps-bz-gc, equal otherwise")
    run.add_argument("--rebalance-every", type=int, default=d.rebalance_every)
    run.add_argument("--max-steps", type=int, default=d.max_steps)
    run.add_argument("--target-accuracy", type=float, default=None,
                     help="record the time to reach it; stop there unless --no-stop-at-target")
    run.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=d.stop_at_target,
                     help="stop once --target-accuracy is reached")
    run.add_argument("--seed", type=int, default=d.seed)
    run.add_argument("--model", choices=MODELS, default=d.model)
    run.add_argument("--dataset", choices=DATASETS, default=d.dataset)
    opt = p.add_argument_group("optimiser")
    opt.add_argument("--lr", type=float, default=d.lr)
    opt.add_argument("--lr-schedule", choices=("cosine", "constant"), default=d.lr_schedule)
    opt.add_argument("--lr-warmup-steps", type=int, default=d.lr_warmup_steps)
    opt.add_argument("--momentum", type=float, default=d.momentum)
    opt.add_argument("--weight-decay", type=float, default=d.weight_decay)
    gc = p.add_argument_group("compression")
    gc.add_argument("--compressor", choices=sorted(COMPRESSORS), default=d.compressor)
    gc.add_argument("--value-dtype", choices=VALUE_DTYPES, default=d.value_dtype)
    gc.add_argument("--select", choices=SELECT_METHODS, default=d.select, help="top-k selection method")
    gc.add_argument("--density", type=float, default=d.density, help="initial and mean worker density")
    gc.add_argument("--density-min", type=float, default=d.density_min)
    gc.add_argument("--density-max", type=float, default=d.density_max)
    gc.add_argument("--density-gamma", type=float, default=d.density_gamma)
    gc.add_argument("--density-time-floor", type=float, default=d.density_time_floor_s,
                    help="transmission times below this many seconds count as equal")
    gc.add_argument("--server-k-fraction", type=float, default=d.server_k_fraction)
    gc.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=d.error_feedback)
    gc.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction,
                    default=d.momentum_correction,
                    help="compressing strategies: momentum accumulated before compression (DGC)")
    gc.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="uncompressed first steps")
    gc.add_argument("--pipeline-chunks", type=int, default=d.pipeline_chunks,
                    help="PS strategies: compress, send, aggregate and answer the gradient in this many "
                         "chunks, one on the wire and at the server while the next is compressed")
    gc.add_argument("--dense-numel", type=int, default=d.dense_numel,
                    help="tensors with fewer elements (and all 1-D ones) travel dense")
    gc.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank)
    gc.add_argument("--powersgd-start", type=int, default=d.powersgd_start)
    io = p.add_argument_group("evaluation, checkpoints, metrics")
    io.add_argument("--eval-every", type=int, default=d.eval_every)
    io.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: never")
    io.add_argument("--checkpoint-dir", default=d.checkpoint_dir)
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    io.add_argument("--metrics-out", default=None, help="JSON-lines file")
    io.add_argument("--report-url", default=None)
    io.add_argument("--report-token", default=None)
    sysg = p.add_argument_group("system")
    sysg.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    sysg.add_argument("--device", choices=("cpu", "cuda", "auto"), default=d.device)
    sysg.add_argument("--timeout-s", type=float, default=d.timeout_s,
                      help="a peer silent this long fails the role instead of hanging it")
    sysg.add_argument("--link-mbps", type=_floats, default=(),
                      help="emulated per-worker link bandwidth (Mbit/s), worker order")
    sysg.add_argument("--sites", type=_labels, default=(),
                      help="site label per rank, server first (PS strategies): the server's update "
                           "crosses to each remote site once and a worker there relays it")
    sysg.add_argument("--emulate-speeds", action="store_true",
                      help="stretch each worker's compute to its --speeds share (local demos)")
    sysg.add_argument("--verbose", action="store_true")
    role = p.add_argument_group("one role (for the node agents)")
    role.add_argument("--role", choices=("ps", "worker"), default=None)
    role.add_argument("--rank", type=int, default=None)
    role.add_argument("--world-size", type=int, default=None)
    role.add_argument("--master-addr", default="127.0.0.1")
    role.add_argument("--master-port", type=int, default=None)
    # Fault injection for the exit-status tests: RANK:STEP.
    role.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    return p


class UsageError(ValueError):
    """A command line that names an impossible run."""


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Validate the options and freeze them into a TrainConfig."""
    ps = args.strategy in ("ps", "ps-gc", "ps-bz-gc")
    workers = args.workers
    if args.world_size is not None:
        derived = args.world_size - (1 if ps else 0)
        if workers is not None and workers != derived:
            raise UsageError(f"--workers {workers} disagrees with --world-size {args.world_size} for {args.strategy}")
        workers = derived
    workers = 4 if workers is None else workers
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    global_batch = args.global_batch
    if args.batch_sizes:
        if len(args.batch_sizes) != workers or min(args.batch_sizes) < 1:
            raise UsageError(f"--batch-sizes {list(args.batch_sizes)}: need {workers} sizes, each >= 1")
        if global_batch is not None and global_batch != sum(args.batch_sizes):
            raise UsageError(f"--batch-sizes sum to {sum(args.batch_sizes)}, not --global-batch {global_batch}")
        global_batch = sum(args.batch_sizes)
    global_batch = TrainConfig.global_batch if global_batch is None else global_batch
    if global_batch < workers:
        raise UsageError(f"--global-batch {global_batch} is smaller than the {workers} workers")
    if args.speeds and (len(args.speeds) != workers or min(args.speeds) <= 0):
        raise UsageError(f"--speeds {list(args.speeds)}: need {workers} positive speeds")
    if args.link_mbps and (len(args.link_mbps) != workers or min(args.link_mbps) <= 0):
        raise UsageError(f"--link-mbps {list(args.link_mbps)}: need {workers} positive bandwidths")
    if not 0 < args.density_min <= args.density <= args.density_max <= 1:
        raise UsageError("need 0 < --density-min <= --density <= --density-max <= 1")
    if not 0 < args.server_k_fraction <= 1:
        raise UsageError(f"--server-k-fraction must be in (0, 1], got {args.server_k_fraction}")
    if args.max_steps < 1 or args.eval_every < 1 or args.rebalance_every < 1:
        raise UsageError("--max-steps, --eval-every and --rebalance-every must be >= 1")
    if args.sites:
        if not ps:
            raise UsageError(f"--sites relays a parameter server's update; {args.strategy} has none")
        if len(args.sites) != workers + 1 or not all(args.sites):
            raise UsageError(f"--sites {list(args.sites)}: need {workers + 1} non-empty labels, the server's first")
    if not 1 <= args.pipeline_chunks <= 64:
        raise UsageError(f"--pipeline-chunks must be in 1..64, got {args.pipeline_chunks}")
    if args.pipeline_chunks > 1 and not ps:
        raise UsageError(f"--pipeline-chunks pipelines a parameter server's step; {args.strategy} has none")
    if args.density_time_floor < 0:
        raise UsageError(f"--density-time-floor must be >= 0 seconds, got {args.density_time_floor}")
    return TrainConfig(
        strategy=args.strategy, workers=workers, global_batch=global_batch,
        batch_sizes=tuple(args.batch_sizes), speeds=tuple(args.speeds),
        allocation=args.allocation or default_allocation(args.strategy),
        rebalance_every=args.rebalance_every, max_steps=args.max_steps,
        target_accuracy=args.target_accuracy, stop_at_target=args.stop_at_target, seed=args.seed,
        model=args.model, dataset=args.dataset,
        lr=args.lr, lr_schedule=args.lr_schedule, lr_warmup_steps=args.lr_warmup_steps,
        momentum=args.momentum, weight_decay=args.weight_decay, compressor=args.compressor,
        value_dtype=args.value_dtype, select=args.select, density=args.density,
        density_min=args.density_min, density_max=args.density_max, density_gamma=args.density_gamma,
        density_time_floor_s=args.density_time_floor,
        server_k_fraction=args.server_k_fraction, error_feedback=args.error_feedback,
        warmup_steps=args.warmup_steps, momentum_correction=args.momentum_correction,
        pipeline_chunks=args.pipeline_chunks,
        dense_numel=args.dense_numel, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
        metrics_out=args.metrics_out, report_url=args.report_url, report_token=args.report_token,
        threads=args.threads, device=args.device, timeout_s=args.timeout_s,
        link_mbps=tuple(args.link_mbps), sites=tuple(args.sites), emulate_speeds=args.emulate_speeds,
        powersgd_rank=args.powersgd_rank, powersgd_start=args.powersgd_start,
    )


def _role_spec(args: argparse.Namespace, cfg: TrainConfig):
    from trainer.runtime import RoleSpec

    if args.rank is None or args.world_size is None or args.master_port is None:
        raise UsageError("--role needs --rank, --world-size and --master-port")
    if not 0 <= args.rank < args.world_size:
        raise UsageError(f"--rank {args.rank} is outside 0..{args.world_size - 1}")
    expected = "ps" if cfg.is_ps and args.rank == 0 else "worker"
    if args.role != expected:
        raise UsageError(f"rank {args.rank} of {cfg.strategy} is a {expected}, not a {args.role}")
    fail_at = None
    if args.inject_failure:
        rank, step = (int(v) for v in args.inject_failure.split(":"))
        fail_at = step if rank == args.rank else None
    return RoleSpec(args.role, args.rank, args.world_size, args.master_addr, args.master_port, fail_at)


def main(argv: list[str]) -> int:
    """Parse `argv`, then launch a local run or run one role; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        if args.role is not None:
            spec = _role_spec(args, cfg)
    except UsageError as exc:
        print(f"hybridtrain train: error: {exc}", file=sys.stderr)
        return 2
    if args.role is None:
        from trainer.launch import launch_local

        return launch_local(cfg, argv)
    from trainer.runtime import run_role

    return run_role(cfg, spec)
