"""`hybridtrain train ...` / `python -m trainer ...`: launch a local run, or one role of it;
`hybridtrain launch [options] train.py ARGS`: the same for a user's own training script.

Without --role the command starts the server and the workers as local processes on a free
port of 127.0.0.1 (like torchrun) and supervises them. With --role it is one of those processes,
which is how the node agents start a run across machines.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from hybridtrain.contract import is_ps
from hybridtrain.option_flags import add_option
from trainer.config import TrainConfig
from trainer.run_options import UsageError, option_fields, options_from_args

__all__ = ["UsageError", "build_parser", "config_from_args", "launch_main", "main", "role_in"]


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


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except None and where the help names its default already (an option's
    per strategy, hybridtrain.option_flags)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The trainer's options; defaults give a one-minute CPU run on the bundled digits."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="hybridtrain train", description=__doc__,
                                formatter_class=_Help)
    run = p.add_argument_group("run")
    add_option(run, "strategy", d.strategy)
    run.add_argument("--workers", type=int, default=None, help="workers (default 4, or from --world-size)")
    run.add_argument("--speeds", type=_floats, default=(), help="relative device speeds s_m, worker order")
    run.add_argument("--batch-sizes", type=_ints, default=(),
                     help="explicit per-worker batch sizes n_m (worker order), honoured exactly")
    add_option(run, "global_batch_size")
    add_option(run, "allocation")
    add_option(run, "rebalance_every", note=f"with --allocation measured, {d.rebalance_every} for the others")
    add_option(run, "max_steps", d.max_steps)
    add_option(run, "epochs")
    add_option(run, "target")
    run.add_argument("--target-accuracy", type=float, default=None, help="same as --target accuracy>=X")
    add_option(run, "stop_at_target", d.stop_at_target)
    add_option(run, "seed", d.seed)
    code = p.add_argument_group("your code")
    add_option(code, "task", d.task)
    add_option(code, "task_args", d.task_args)
    add_option(code, "script")
    code.add_argument("--code-dir", default=None,
                      help="where the task's or script's modules are (first on the import path once "
                           "the trainer's own packages are loaded); launchers set it")
    code.add_argument("--data-workers", type=int, default=None,
                      help="DataLoader processes per worker (default: the task's, else 0)")
    code.add_argument("--amp", action="store_true", help="bf16 autocast around the task's forward pass and loss")
    gc = p.add_argument_group("compression", "a flag left out takes the strategy's default, the paper "
                              "benchmark's configuration where one is given (docs/trainer.md, \"Defaults\")")
    for path in ("compressor", "value_dtype", "select"):
        add_option(gc, f"compression.{path}", getattr(d, path))
    for path in ("density", "density_min", "density_max"):
        add_option(gc, f"compression.{path}")
    gc.add_argument("--density-gamma", type=float, default=d.density_gamma)
    gc.add_argument("--density-time-floor", type=float, default=d.density_time_floor_s,
                    help="transmission times below this many seconds count as equal")
    add_option(gc, "compression.server_k_fraction")
    add_option(gc, "compression.error_feedback", d.error_feedback)
    add_option(gc, "compression.momentum_correction", d.momentum_correction)
    add_option(gc, "compression.warmup_steps")
    add_option(gc, "compression.pipeline_chunks")
    add_option(gc, "compression.apply_in_forward", False)
    gc.add_argument("--dense-numel", type=int, default=d.dense_numel,
                    help="tensors with fewer elements (and all 1-D ones) travel dense")
    add_option(gc, "compression.powersgd_rank", d.powersgd_rank)
    gc.add_argument("--powersgd-start", type=int, default=d.powersgd_start)
    local = p.add_argument_group("local SGD (diloco, diloco-gc)")
    for path in ("sync_every", "outer_lr", "outer_delay", "asynchronous", "max_staleness", "outer_density",
                 "outer_momentum", "site_replicas", "fragments"):
        # A switch defaults to off, not None, as every switch of this parser does.
        add_option(local, f"local_sgd.{path}", False if path in ("asynchronous", "site_replicas") else None)
    io = p.add_argument_group("evaluation, checkpoints, metrics")
    add_option(io, "eval_every", d.eval_every)
    io.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="0: never")
    io.add_argument("--checkpoint-every-s", type=float, default=d.checkpoint_every_s,
                    help="also checkpoint when this many seconds have passed (0: by steps only)")
    io.add_argument("--checkpoint-dir", default=d.checkpoint_dir)
    io.add_argument("--checkpoint-url", default=None,
                    help="upload checkpoints there and, with --resume, start from its latest")
    io.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    io.add_argument("--metrics-out", default=None, help="JSON-lines file")
    io.add_argument("--report-url", default=None)
    io.add_argument("--report-token", default=None, help="prefer --report-token-file: a command line is public")
    io.add_argument("--report-token-file", default=None,
                    help="a file holding the report token (an agent writes one, owner-only, per role)")
    io.add_argument("--report-spool", default=None,
                    help="JSON-lines file for records the control plane could not take before exit")
    io.add_argument("--link-secret-file", default=None,
                    help="a file holding the run's link secret: parameter-server connections are then "
                         "mutual TLS keyed by it (an agent writes one, owner-only, per role)")
    io.add_argument("--datasets-file", default=None,
                    help="a file naming the run's data sets, their store's credentials and the node's "
                         "cache (an agent writes one, owner-only, per role): hybridtrain.dataset(name) reads it")
    sysg = p.add_argument_group("system")
    sysg.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    add_option(sysg, "device", d.device)
    sysg.add_argument("--timeout-s", type=float, default=d.timeout_s,
                      help="a peer silent this long fails the role instead of hanging it (a PS server "
                           "drops a silent worker a step time after its peers' frames, beyond their usual spread: "
                           "docs/elastic.md)")
    sysg.add_argument("--link-mbps", type=_floats, default=(),
                      help="emulated per-worker link bandwidth (Mbit/s), worker order")
    sysg.add_argument("--sites", type=_labels, default=(),
                      help="site label per rank, server first (PS strategies): the server's update "
                           "crosses to each remote site once and a worker there relays it")
    add_option(sysg, "compression.aggregate_at_sites", False)
    sysg.add_argument("--emulate-speeds", action="store_true",
                      help="stretch each worker's compute to its --speeds share (local demos)")
    sysg.add_argument("--min-workers", type=int, default=d.min_workers,
                      help="PS strategies: below this many live workers training waits for joiners")
    sysg.add_argument("--min-workers-wait-s", type=float, default=d.min_workers_wait_s,
                      help="how long to wait below --min-workers before the run fails")
    sysg.add_argument("--start-wait-s", type=float, default=d.start_wait_s,
                      help="PS strategies: how long a run waits for its workers (--expect-ranks) before it "
                           "starts with those connected (the rest join later)")
    sysg.add_argument("--expect-ranks", type=_ints, default=(),
                      help="PS strategies: the worker ranks the start waits for (default all); a restart "
                           "names the ranks it launched")
    sysg.add_argument("--join", action="store_true",
                      help="PS strategies: join a running run (any rank not in it); admitted at the next "
                           "step boundary with the run's model")
    sysg.add_argument("--verbose", action="store_true")
    role = p.add_argument_group("one role (for the node agents)")
    role.add_argument("--role", choices=("ps", "worker"), default=None)
    role.add_argument("--options-json", default=None,
                      help="the run's training options as one JSON object (hybridtrain.train_options."
                           "TrainOptions, as a launch order carries them), instead of their flags")
    role.add_argument("--rank", type=int, default=None)
    role.add_argument("--world-size", type=int, default=None)
    role.add_argument("--master-addr", default="127.0.0.1")
    role.add_argument("--master-port", type=int, default=None)
    # Fault injection for the exit-status tests: RANK:STEP.
    role.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    p.add_argument("script_args", nargs="*", help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> TrainConfig:
    """Validate the options and freeze them into a TrainConfig: the training options (flags or
    --options-json, `options_from_args`), then this process's share and settings."""
    opts = options_from_args(args, parser or build_parser())
    ps = is_ps(opts.strategy)
    workers = args.workers
    if args.world_size is not None:
        derived = args.world_size - (1 if ps else 0)
        if workers is not None and workers != derived:
            raise UsageError(f"--workers {workers} disagrees with --world-size {args.world_size} for {opts.strategy}")
        workers = derived
    workers = 4 if workers is None else workers
    if workers < 1:
        raise UsageError(f"--workers must be >= 1, got {workers}")
    global_batch = opts.global_batch_size
    if args.batch_sizes:
        if len(args.batch_sizes) != workers or min(args.batch_sizes) < 1:
            raise UsageError(f"--batch-sizes {list(args.batch_sizes)}: need {workers} sizes, each >= 1")
        if global_batch != sum(args.batch_sizes):
            raise UsageError(f"--batch-sizes sum to {sum(args.batch_sizes)}, not --global-batch {global_batch}")
    if global_batch < workers:
        raise UsageError(f"--global-batch {global_batch} is smaller than the {workers} workers")
    if args.speeds and (len(args.speeds) != workers or min(args.speeds) <= 0):
        raise UsageError(f"--speeds {list(args.speeds)}: need {workers} positive speeds")
    if args.link_mbps and (len(args.link_mbps) != workers or min(args.link_mbps) <= 0):
        raise UsageError(f"--link-mbps {list(args.link_mbps)}: need {workers} positive bandwidths")
    fields = option_fields(opts)
    densities = [fields.get(k, getattr(TrainConfig, k)) for k in ("density_min", "density", "density_max")]
    if not 0 < densities[0] <= densities[1] <= densities[2] <= 1:
        raise UsageError("need 0 < --density-min <= --density <= --density-max <= 1")
    if args.sites:
        if not ps:
            raise UsageError(f"--sites relays a parameter server's update; {opts.strategy} has none")
        if len(args.sites) != workers + 1 or not all(args.sites):
            raise UsageError(f"--sites {list(args.sites)}: need {workers + 1} non-empty labels, the server's first")
    if fields.get("site_aggregation") and not args.sites:
        raise UsageError("--aggregate-at-sites combines each remote site's gradients at its relay: give --sites")
    if fields.get("site_replicas") and not args.sites:
        raise UsageError("--site-replicas makes each site's workers one replica: give --sites")
    if args.expect_ranks and not (ps and all(1 <= r <= workers for r in args.expect_ranks)):
        raise UsageError(f"--expect-ranks {list(args.expect_ranks)}: need worker ranks in 1..{workers} "
                         "of a parameter-server run")
    if args.density_time_floor < 0:
        raise UsageError(f"--density-time-floor must be >= 0 seconds, got {args.density_time_floor}")
    if args.data_workers is not None and args.data_workers < 0:
        raise UsageError(f"--data-workers must be >= 0, got {args.data_workers}")
    if args.script_args and not opts.script:
        raise UsageError(f"unexpected arguments {args.script_args}: only --script takes arguments after --")
    if opts.script and args.resume:
        raise UsageError("--resume restores a task's run; a script of your own checkpoints itself")
    return TrainConfig(
        **fields, workers=workers,
        batch_sizes=tuple(args.batch_sizes), speeds=tuple(args.speeds),
        code_dir=args.code_dir,
        script_args=tuple(args.script_args), data_workers=args.data_workers, amp=args.amp,
        density_gamma=args.density_gamma, density_time_floor_s=args.density_time_floor,
        dense_numel=args.dense_numel,
        checkpoint_every=args.checkpoint_every, checkpoint_every_s=args.checkpoint_every_s,
        checkpoint_dir=args.checkpoint_dir, checkpoint_url=args.checkpoint_url, resume=args.resume,
        min_workers=args.min_workers, min_workers_wait_s=args.min_workers_wait_s,
        start_wait_s=args.start_wait_s, expect_ranks=tuple(sorted(set(args.expect_ranks))),
        join=args.join,
        metrics_out=args.metrics_out, report_url=args.report_url, report_token=_report_token(args),
        report_spool=args.report_spool, link_secret=_read_secret(args.link_secret_file, "--link-secret-file"),
        threads=args.threads, timeout_s=args.timeout_s,
        link_mbps=tuple(args.link_mbps), sites=tuple(args.sites), emulate_speeds=args.emulate_speeds,
        powersgd_start=args.powersgd_start,
    )


def _report_token(args: argparse.Namespace) -> str | None:
    if args.report_token_file is None:
        return args.report_token
    if args.report_token is not None:
        raise UsageError("give --report-token or --report-token-file, not both")
    return _read_secret(args.report_token_file, "--report-token-file")


def _read_secret(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror}") from None
    if not value:
        raise UsageError(f"{flag} {path} is empty")
    return value


def _role_spec(args: argparse.Namespace, cfg: TrainConfig):
    from trainer.runtime import RoleSpec

    if args.rank is None or args.world_size is None or args.master_port is None:
        raise UsageError("--role needs --rank, --world-size and --master-port")
    # A joiner's rank is the next unused one, beyond the world size the run started with.
    if args.rank < 0 or (args.rank >= args.world_size and not (args.join and cfg.is_ps)):
        raise UsageError(f"--rank {args.rank} is outside 0..{args.world_size - 1}")
    expected = "ps" if cfg.is_ps and args.rank == 0 else "worker"
    if args.role != expected:
        raise UsageError(f"rank {args.rank} of {cfg.strategy} is a {expected}, not a {args.role}")
    fail_at = None
    if args.inject_failure:
        rank, step = (int(v) for v in args.inject_failure.split(":"))
        fail_at = step if rank == args.rank else None
    return RoleSpec(args.role, args.rank, args.world_size, args.master_addr, args.master_port, fail_at)


def _role_argv(argv: list[str], cfg: TrainConfig) -> list[str]:
    """The options every role gets: this command's, the script's arguments after a `--`."""
    if "--" in argv:
        argv = argv[: argv.index("--")]
    elif cfg.script_args:
        argv = [a for a in argv if a not in cfg.script_args]
    return [*argv, "--", *cfg.script_args] if cfg.script_args else list(argv)


def launch_main(argv: list[str]) -> int:
    """`hybridtrain launch [options] SCRIPT [ARGS...]`: run a training script of your own on a
    local server and workers, like torchrun; options are `hybridtrain train`'s."""
    parser = build_parser()
    parser.prog = "hybridtrain launch"
    parser.usage = "hybridtrain launch [options] SCRIPT [SCRIPT ARGS...]"
    script_at = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")
                      and (i == 0 or not _takes_value(parser, argv[i - 1]))), None)
    if script_at is None and any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    if script_at is None:
        print("hybridtrain launch: error: name the training script, e.g. `hybridtrain launch "
              "--workers 4 train.py --epochs 3`", file=sys.stderr)
        return 2
    options, script, rest = argv[:script_at], argv[script_at], argv[script_at + 1 :]
    return main([*options, "--script", script, "--", *rest])


def _takes_value(parser: argparse.ArgumentParser, flag: str) -> bool:
    action = parser._option_string_actions.get(flag)  # noqa: SLF001 - argparse has no public lookup
    return action is not None and action.nargs != 0


def role_in(argv: list[str]) -> str | None:
    """The role (`ps`, `worker`) this command line runs, None for a local launch; read from the
    trainer's own flags, never from a script's arguments after `--` (see trainer/__main__.py)."""
    own = argv[: argv.index("--")] if "--" in argv else argv
    role = None
    for flag, value in zip(own, [*own[1:], None]):
        if flag.startswith("--role="):
            role = flag.partition("=")[2]
        elif flag == "--role" and value is not None:
            role = value  # argparse keeps the last of a repeated flag, and so does this
    return role


def _use_datasets(path: str) -> None:
    from hybridtrain.datasets import DatasetError, load_datasets_file, use_datasets

    try:
        use_datasets(load_datasets_file(path))
    except DatasetError as exc:
        raise UsageError(str(exc)) from None


def main(argv: list[str]) -> int:
    """Parse `argv`, then launch a local run or run one role; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args, parser)
        if args.role is not None:
            spec = _role_spec(args, cfg)
        if args.datasets_file:
            _use_datasets(args.datasets_file)
    except UsageError as exc:
        print(f"hybridtrain train: error: {exc}", file=sys.stderr)
        return 2
    if args.role is None:
        from trainer.launch import launch_local

        return launch_local(cfg, _role_argv(argv, cfg))
    from trainer.runtime import run_role

    return run_role(cfg, spec)
