"""The flags of `hybridtrain runs ...`: what each subcommand takes. The training options' flags
come from hybridtrain.option_flags, which `hybridtrain train` shares; app/cli/run_flags.py turns
the parsed flags into a request and app/cli/run_commands.py runs the commands."""

from __future__ import annotations

import argparse

from app.cli.run_flags import cluster_ref, ids
from hybridtrain.option_flags import add_option


def connection_args(parser: argparse.ArgumentParser) -> None:
    """`--server` and `--token`, which every command that talks to a control plane takes."""
    parser.add_argument("--server", help="control plane URL (default $HYBRIDTRAIN_URL or http://127.0.0.1:8000)")
    parser.add_argument("--token", help="API token (default $HYBRIDTRAIN_TOKEN)")


def add_runs(sub: argparse._SubParsersAction) -> dict[str, argparse.ArgumentParser]:  # type: ignore[type-arg]
    """Add `runs` and its subcommands' flags to the `hybridtrain` parser; the subcommands'
    parsers by name, for the caller to bind each to its handler."""
    runs = sub.add_parser("runs", help="launch, watch and cancel training runs")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)
    parsers = {"create": _add_create(runs_sub)}

    get = parsers["get"] = runs_sub.add_parser("get", help="show a run as JSON")
    connection_args(get)
    get.add_argument("run_id", type=int)

    show = parsers["show"] = runs_sub.add_parser("show", help="show a run's state, ranks and latest checkpoint")
    connection_args(show)
    show.add_argument("run_id", type=int)

    add = parsers["add-nodes"] = runs_sub.add_parser("add-nodes", help="add workers on these nodes to a running PS run")
    connection_args(add)
    add.add_argument("run_id", type=int)
    add.add_argument("--nodes", type=ids, required=True, help="node ids, e.g. 4,5")

    ls = parsers["list"] = runs_sub.add_parser("list", help="list runs, newest first")
    connection_args(ls)
    ls.add_argument("--status", default=None)
    ls.add_argument("--limit", type=int, default=20)

    cancel = parsers["cancel"] = runs_sub.add_parser("cancel", help="cancel a run")
    connection_args(cancel)
    cancel.add_argument("run_id", type=int)
    cancel.add_argument("--reason", default=None)
    cancel.add_argument("--wait", action="store_true",
                        help="wait until the run reads cancelled: every role of it gone from its nodes")
    cancel.add_argument("--timeout", type=float, default=120.0, help="seconds to --wait at most")

    metrics = parsers["metrics"] = runs_sub.add_parser("metrics", help="a run's metric series as JSON (or CSV)")
    connection_args(metrics)
    metrics.add_argument("run_id", type=int)
    metrics.add_argument("--name", action="append", default=[], help="repeatable, e.g. --name loss")
    metrics.add_argument("--rank", type=int, default=None)
    metrics.add_argument("--since", type=float, default=None, help="unix seconds")
    metrics.add_argument("--max-points", type=int, default=1000)
    metrics.add_argument("--csv", action="store_true", help="name,rank,peer,step,t,value rows")

    logs = parsers["logs"] = runs_sub.add_parser("logs", help="the last output lines of a run's ranks")
    connection_args(logs)
    logs.add_argument("run_id", type=int)
    logs.add_argument("--rank", type=int, default=None)
    logs.add_argument("--tail", type=int, default=50)
    return parsers


def _add_create(runs_sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    # Every training option's flag defaults to None: unset, so the request leaves it to the
    # control plane and the strategy's defaults (app/cli/run_flags.py sends only those given).
    create = runs_sub.add_parser("create", help="launch a run (prints it as JSON)")
    connection_args(create)
    create.add_argument("--name", required=True)
    where = create.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=ids, help="node ids, e.g. 1,2,3")
    where.add_argument("--cluster", type=cluster_ref, help="a cluster id or name (`hybridtrain clusters list`)")
    add_option(create, "strategy")
    create.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML or JSON file of the run's request fields (POST /api/v1/runs, e.g. "
                             "compression: {pipeline_chunks: 4, density: 0.05}); flags given win")
    code = create.add_mutually_exclusive_group()
    code.add_argument("--workdir", default=None, metavar="DIR",
                      help="pack DIR (minus .hybridtrainignore / .gitignore) and run from that code bundle")
    code.add_argument("--bundle", default=None, metavar="SHA256", help="run from a bundle uploaded before")
    create.add_argument("--dataset", dest="datasets", action="append", default=None, metavar="NAME",
                        help="a registered data set the run reads with hybridtrain.dataset(NAME) (repeatable)")
    what = create.add_mutually_exclusive_group()
    add_option(what, "task")
    add_option(what, "script")
    add_option(create, "task_args")
    create.add_argument("--max-bundle-mb", type=float, default=64.0, metavar="MIB",
                        help="refuse to pack a work dir larger than this (default 64, the server's default)")
    add_option(create, "global_batch_size")
    steps = create.add_mutually_exclusive_group()
    add_option(steps, "max_steps")
    # A run's epochs are whole (the API's column is an integer); the trainer's own flag takes fractions.
    add_option(steps, "epochs", note="whole passes", kind=int)
    for path in ("target", "stop_at_target", "seed", "allocation", "device"):
        add_option(create, path)
    create.add_argument("--ps-node", type=int, default=None, help="node id of the server")
    add_option(create, "rebalance_every")
    add_option(create, "eval_every")
    exchange = create.add_argument_group(
        "the exchange", "an option left out takes the strategy's default: the configuration the paper "
        "benchmark measured best (docs/user-guide.md, \"Defaults\"); the run shows them as effective_options")
    for path in ("compression.compressor", "compression.value_dtype", "compression.pipeline_chunks",
                 "compression.density", "compression.density_min", "compression.density_max",
                 "compression.server_k_fraction", "compression.warmup_steps", "local_sgd.sync_every",
                 "local_sgd.outer_lr", "local_sgd.outer_momentum", "local_sgd.outer_density", "local_sgd.outer_delay",
                 "local_sgd.asynchronous", "local_sgd.max_staleness", "local_sgd.site_replicas", "local_sgd.fragments"):
        add_option(exchange, path)
    life = create.add_argument_group("checkpoints, restarts, membership")
    life.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS", help="default 100 (0: never)")
    life.add_argument("--checkpoint-every-s", type=float, default=None, metavar="S", help="default 600 (0: off)")
    life.add_argument("--max-restarts", type=int, default=None, help="after a server death; default 3")
    life.add_argument("--min-workers", type=int, default=None, help="PS: fewest live workers; default 1")
    life.add_argument("--min-workers-wait-s", type=float, default=None, metavar="S", help="default 300")
    queue = create.add_argument_group("the queue for busy GPUs")
    queue.add_argument("--priority", type=int, default=None, help="higher starts first; default 0")
    queue.add_argument("--share-gpus", action="store_true", default=None,
                       help="run on GPUs that other sharing runs hold")
    create.add_argument("--plain-links", dest="encrypt_links", action="store_false", default=None,
                        help="PS: ranks talk over plain TCP, not TLS (only inside a VPN that encrypts)")
    create.add_argument("--idempotency-key", default=None,
                        help="a retry with the same key returns the same run (e.g. the CI job id)")
    create.add_argument("--plan-only", action="store_true",
                        help="print the plan and its predicted throughput and cost, launch nothing")
    create.add_argument("--all-strategies", action="store_true",
                        help="with --plan-only: predict every strategy, side by side, as a table")
    from app.cli.profile_commands import add_plan_profile_flags

    add_plan_profile_flags(create)
    create.add_argument("--wait", action="store_true",
                        help="wait for the end; exit 0 only if the run succeeded")
    create.add_argument("--timeout", type=float, default=None, help="seconds to --wait at most")
    create.add_argument("--retry-for", type=float, default=300.0, metavar="SECONDS",
                        help="--wait rides out an unreachable control plane this long (default 300)")
    create.add_argument("script_args", nargs="*", metavar="-- SCRIPT_ARGS",
                        help="arguments of --script, after a literal --")
    return create
