"""`hybridtrain runs ...`, `hybridtrain bundles ...`, `hybridtrain nodes list` and
`hybridtrain local`: the commands a CI pipeline or a laptop user runs against a control plane
(their flags become request fields in app/cli/run_flags.py).

Exit status: 0 success; 1 the run failed or was cancelled (`runs create --wait`), or the
control plane refused the request; 2 bad usage; 3 `--wait` timed out; 4 unreachable (for
`--wait`: for longer than `--retry-for`); 130 Ctrl-C while waiting (the run goes on).
`runs cancel --wait` returns 0 once the run reads `cancelled` (its agents reported every role
gone), 3 if it still reads `cancelling` after `--timeout`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from app.cli.run_flags import UsageError, cluster_ref, ids, pack, run_body, upload
from hybridtrain.contract import ALLOCATIONS, COMPRESSORS, DEVICES, STRATEGIES, VALUE_DTYPES
from hybridtrain.strategy_defaults import describe

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `runs`, `nodes` and `local` to the `hybridtrain` parser."""
    from app.cli.inventory_commands import add_nodes_command

    _add_runs(sub)
    add_nodes_command(sub)
    from app.cli.local import add_local_command

    add_local_command(sub)


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="control plane URL (default $HYBRIDTRAIN_URL or http://127.0.0.1:8000)")
    parser.add_argument("--token", help="API token (default $HYBRIDTRAIN_TOKEN)")


def _add_runs(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    runs = sub.add_parser("runs", help="launch, watch and cancel training runs")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)

    create = runs_sub.add_parser("create", help="launch a run (prints it as JSON)")
    _connection_args(create)
    create.add_argument("--name", required=True)
    where = create.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=ids, help="node ids, e.g. 1,2,3")
    where.add_argument("--cluster", type=cluster_ref, help="a cluster id or name (`hybridtrain clusters list`)")
    create.add_argument("--strategy", choices=STRATEGIES, default=None, help="default ps-bz-gc")
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
    what.add_argument("--task", default=None, metavar="MOD:FN",
                      help="a function returning a hybridtrain.Task (default hybridtrain.tasks.digits:smallcnn)")
    what.add_argument("--script", default=None, metavar="PATH",
                      help="your own training script, a path inside --workdir; its arguments follow `--`")
    create.add_argument("--task-args", default=None, metavar="JSON",
                        help='keyword arguments of the task as a JSON object, e.g. \'{"lr": 0.05}\'')
    create.add_argument("--max-bundle-mb", type=float, default=64.0, metavar="MIB",
                        help="refuse to pack a work dir larger than this (default 64, the server's default)")
    create.add_argument("--global-batch", type=int, default=None)
    steps = create.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, default=None)
    steps.add_argument("--epochs", type=int, default=None)
    create.add_argument("--target", default=None, metavar="METRIC>=VALUE",
                        help="e.g. accuracy>=0.9 or val_loss<=0.3 (a metric the task evaluates)")
    create.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=None,
                        help="stop once the target is reached (the default)")
    create.add_argument("--seed", type=int, default=None)
    create.add_argument("--allocation", choices=ALLOCATIONS, default=None)
    create.add_argument("--device", choices=DEVICES, default=None)
    create.add_argument("--ps-node", type=int, default=None, help="node id of the server")
    create.add_argument("--rebalance-every", type=int, default=None,
                        help="PS strategies: re-split the batch every N steps from compute times "
                             f"(default {describe('rebalance_every')})")
    create.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps")
    exchange = create.add_argument_group(
        "the exchange", "an option left out takes the strategy's default: the configuration the paper "
        "benchmark measured best (docs/user-guide.md, \"Defaults\"); the run shows them as effective_options")
    exchange.add_argument("--compressor", choices=COMPRESSORS, default=None)
    exchange.add_argument("--value-dtype", choices=VALUE_DTYPES, default=None)
    exchange.add_argument("--pipeline-chunks", type=int, default=None, metavar="N",
                          help=f"PS strategies: the step in N pipelined chunks "
                               f"(default {describe('compression.pipeline_chunks')}; 1: one piece)")
    exchange.add_argument("--density", type=float, default=None,
                          help=f"top-k density to start from (default {describe('compression.density')})")
    exchange.add_argument("--density-min", type=float, default=None,
                          help=f"the lowest adapted density (default {describe('compression.density_min')}; "
                               "with --density, 0.4 times it)")
    exchange.add_argument("--density-max", type=float, default=None,
                          help=f"the highest adapted density (default {describe('compression.density_max')}; "
                               "with --density, twice it)")
    exchange.add_argument("--server-k-fraction", type=float, default=None,
                          help=f"the share of the aggregate the server sends back "
                               f"(default {describe('compression.server_k_fraction')})")
    exchange.add_argument("--warmup-steps", type=int, default=None,
                          help=f"first steps sent uncompressed (default {describe('compression.warmup_steps')})")
    exchange.add_argument("--sync-every", type=int, default=None, metavar="H",
                          help=f"inner steps between outer steps (default {describe('local_sgd.sync_every')})")
    exchange.add_argument("--outer-lr", type=float, default=None, help=f"default {describe('local_sgd.outer_lr')}")
    exchange.add_argument("--outer-momentum", type=float, default=None,
                          help=f"default {describe('local_sgd.outer_momentum')}")
    exchange.add_argument("--outer-density", type=float, default=None,
                          help=f"default {describe('local_sgd.outer_density')}")
    exchange.add_argument("--outer-delay", type=int, default=None, metavar="STEPS",
                          help="overlap the outer exchange with this many inner steps "
                               f"(default {describe('local_sgd.outer_delay')}, or H - 1 when H is smaller)")
    exchange.add_argument("--async-outer", dest="asynchronous", action="store_true", default=None,
                          help="diloco, diloco-gc: apply each outer step as soon as it has arrived instead of "
                               "--outer-delay steps later; a worker waits only at --max-staleness")
    exchange.add_argument("--max-staleness", type=int, default=None, metavar="STEPS",
                          help="with --async-outer: the most inner steps an outer step may land after its "
                               "change was sent (default H - 1)")
    exchange.add_argument("--site-replicas", action="store_true", default=None,
                          help="diloco, diloco-gc: each site's workers one replica, averaging every inner "
                               "step over their LAN; one change per site crosses the WAN")
    exchange.add_argument("--fragments", type=int, default=None, metavar="P",
                          help="diloco, diloco-gc: streaming, the model in P fragments whose outer steps are "
                               "staggered over the H steps (at most H; default 1, off)")
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
    create.set_defaults(func=_runs_create)

    get = runs_sub.add_parser("get", help="show a run as JSON")
    _connection_args(get)
    get.add_argument("run_id", type=int)
    get.set_defaults(func=_runs_get)

    show = runs_sub.add_parser("show", help="show a run's state, ranks and latest checkpoint")
    _connection_args(show)
    show.add_argument("run_id", type=int)
    show.set_defaults(func=_runs_show)

    add = runs_sub.add_parser("add-nodes", help="add workers on these nodes to a running PS run")
    _connection_args(add)
    add.add_argument("run_id", type=int)
    add.add_argument("--nodes", type=ids, required=True, help="node ids, e.g. 4,5")
    add.set_defaults(func=_runs_add_nodes)

    ls = runs_sub.add_parser("list", help="list runs, newest first")
    _connection_args(ls)
    ls.add_argument("--status", default=None)
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(func=_runs_list)

    cancel = runs_sub.add_parser("cancel", help="cancel a run")
    _connection_args(cancel)
    cancel.add_argument("run_id", type=int)
    cancel.add_argument("--reason", default=None)
    cancel.add_argument("--wait", action="store_true",
                        help="wait until the run reads cancelled: every role of it gone from its nodes")
    cancel.add_argument("--timeout", type=float, default=120.0, help="seconds to --wait at most")
    cancel.set_defaults(func=_runs_cancel)

    metrics = runs_sub.add_parser("metrics", help="a run's metric series as JSON (or CSV)")
    _connection_args(metrics)
    metrics.add_argument("run_id", type=int)
    metrics.add_argument("--name", action="append", default=[], help="repeatable, e.g. --name loss")
    metrics.add_argument("--rank", type=int, default=None)
    metrics.add_argument("--since", type=float, default=None, help="unix seconds")
    metrics.add_argument("--max-points", type=int, default=1000)
    metrics.add_argument("--csv", action="store_true", help="name,rank,peer,step,t,value rows")
    metrics.set_defaults(func=_runs_metrics)

    logs = runs_sub.add_parser("logs", help="the last output lines of a run's ranks")
    _connection_args(logs)
    logs.add_argument("run_id", type=int)
    logs.add_argument("--rank", type=int, default=None)
    logs.add_argument("--tail", type=int, default=50)
    logs.set_defaults(func=_runs_logs)


def register_plans(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `plans optimize` to the `hybridtrain` parser (app.cli.inventory_commands)."""
    from app.cli.inventory_commands import register_plans as register

    register(sub)


def register_bundles(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `bundles list` and `bundles delete` to the `hybridtrain` parser (app.cli.inventory_commands)."""
    from app.cli.inventory_commands import register_bundles as register

    register(sub)


# -- handlers -------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from app.cli.client import HybridtrainClient
    from app.config import get_client_settings

    settings = get_client_settings()
    return HybridtrainClient(args.server or settings.url, args.token or settings.token)


def resolve_cluster(client: Any, body: dict[str, Any]) -> None:
    """Replace a `cluster_id` given by name with the cluster's id (UsageError when unknown)."""
    if isinstance(body.get("cluster_id"), str):
        from app.cli.cluster_commands import cluster_id

        body["cluster_id"] = cluster_id(client, body["cluster_id"])


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def _guard(fn: Any) -> Any:
    # A bad flag or an error of the API becomes one line on stderr and an exit status, never a
    # traceback.
    def run(args: argparse.Namespace) -> int:
        from app.cli.client import ApiError

        try:
            return int(fn(args) or 0)
        except UsageError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ApiError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE if exc.status_code == 0 else EXIT_RUN_FAILED

    return run


def prediction_table(plans: list[dict[str, Any]]) -> str:
    """Each strategy's predicted throughput, step, granularity and cost (the data sets' reads
    spread over the run as data $/h), as a Markdown table; under it, what the reads cost."""
    rows = ["| strategy | samples/s | step s | granularity | egress $/h | compute $/h | data $/h | $/1M samples "
            "| egress share |",
            "|---|---|---|---|---|---|---|---|---|"]
    data_lines: list[str] = []
    reasons: dict[str, list[str]] = {}  # one line per reason, however many strategies share it
    for plan in plans:
        p = plan.get("prediction")
        if p is None:
            reasons.setdefault(plan.get("prediction_unavailable") or "no prediction", []).append(plan["strategy"])
            continue
        c = p["costs"]

        def num(v: Any, fmt: str) -> str:
            return "n/a" if v is None else format(v, fmt)

        rows.append(f"| {plan['strategy']} | {p['samples_per_s']:.1f} | {p['step_s']:.3f} | "
                    f"{num(p['granularity'], '.2f')} | {c['egress_usd_per_h']:.3f} | {c['compute_usd_per_h']:.3f} | "
                    f"{c.get('data_usd_per_h', 0.0):.3f} | "
                    f"{num(c['usd_per_million_samples'], '.3f')} | {num(c['egress_share'], '.0%')} |")
        if c.get("data_bytes"):
            line = (f"data sets: {c['data_bytes'] / 2**30:.3g} GB from their stores over the run, "
                    f"${c['data_usd']:.4g}")
            if line not in data_lines:
                data_lines.append(line)
    why = [f"{', '.join(strategies) if len(strategies) < len(plans) or len(plans) == 1 else 'every strategy'}: "
           f"{reason}" for reason, strategies in reasons.items()]
    return "\n".join(rows + why + data_lines)


def _plan_only(client: Any, body: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the plan (every strategy's with --all-strategies); first, unless --no-profile,
    wait for the nodes that profile its task (bounded by --profile-wait)."""
    from app.cli.profile_commands import inputs_text, wait_for_profiles

    request = {**body, **({"strategies": "all"} if args.all_strategies else {})}
    if args.profile and body.get("script") is None:
        request["profile_missing"] = True
    answer, ended = wait_for_profiles(lambda: client.plan_run(request), client.plan_run(request),
                                      wait_s=args.profile_wait, out=sys.stderr)
    if args.all_strategies:
        print(prediction_table(answer["plans"]))
        inputs = inputs_text(answer["plans"][0]) if answer["plans"] else ""
        if inputs:
            print(inputs)
    else:
        _print_json(answer)
    return 0 if ended else EXIT_TIMEOUT


def _describe(run: dict[str, Any]) -> str:
    from hybridtrain.progress import status_text

    ranks = " ".join(f"{w['rank']}:{w['status']}" for w in run["workers"])
    reason = f" ({run['reason']})" if run.get("reason") else ""
    if run.get("queue_position"):
        waiting = "; ".join(run.get("waiting_for") or [])
        reason += f" (number {run['queue_position']} in the queue{': ' + waiting if waiting else ''})"
    return f"run {run['id']} {status_text(run)}{reason} [{ranks}]"


@_guard
def _runs_create(args: argparse.Namespace) -> int:
    from app.cli.client import RunTimeout

    body = run_body(args)  # every flag checked before anything is packed or sent
    packed = pack(args) if args.workdir is not None else None
    with _client(args) as client:
        resolve_cluster(client, body)
        if packed is not None:
            body["bundle_sha256"] = upload(client, packed, args.workdir)
        if args.plan_only:
            return _plan_only(client, body, args)
        run = client.create_run(body, idempotency_key=args.idempotency_key)
        print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
        if not args.wait:
            _print_json(run)
            return 0
        from app.cli.run_progress import run_progress

        progress = run_progress(client, sys.stderr)
        try:
            run = client.wait_for_run(
                run["id"], timeout_s=args.timeout, retry_for_s=args.retry_for,
                on_change=lambda r: progress.note(f"hybridtrain: {_describe(r)}"),
                on_poll=progress.poll,
                on_retry=lambda exc, pause: progress.note(f"hybridtrain: {exc}; retrying in {pause:.3g} s"),
            )
        except RunTimeout as exc:
            progress.close()
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_TIMEOUT
        except KeyboardInterrupt:
            progress.close()
            print(f"hybridtrain: stopped waiting; run {run['id']} goes on "
                  f"(`hybridtrain runs cancel {run['id']}` stops it)", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            progress.close()
        _print_json(run)
        return 0 if run["status"] == "succeeded" else EXIT_RUN_FAILED


@_guard
def _runs_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.get_run(args.run_id))
    return 0


@_guard
def _runs_show(args: argparse.Namespace) -> int:
    from app.cli.run_progress import describe_run

    with _client(args) as client:
        print(describe_run(client.get_run(args.run_id)))
    return 0


@_guard
def _runs_add_nodes(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.add_run_nodes(args.run_id, args.nodes)
    print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
    return 0


@_guard
def _runs_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_runs(status=args.status, limit=args.limit)
    for run in page["data"]:
        print(f"{run['id']:>6}  {run['status']:<10} {run['strategy']:<18} {run['name']}"
              + (f"  ({run['reason']})" if run.get("reason") else ""))
    return 0


@_guard
def _runs_cancel(args: argparse.Namespace) -> int:
    from app.cli.client import RunTimeout

    with _client(args) as client:
        run = client.cancel_run(args.run_id, reason=args.reason)
        print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
        if args.wait and not run["status"] == "cancelled":
            try:
                # A cancelling run's roles stop within seconds: poll often.
                run = client.wait_for_run(
                    run["id"], timeout_s=args.timeout, poll_s=0.5,
                    on_change=lambda r: print(f"hybridtrain: {_describe(r)}", file=sys.stderr),
                )
            except RunTimeout as exc:
                print(f"hybridtrain: {exc}", file=sys.stderr)
                return EXIT_TIMEOUT
    _print_json(run)
    return 0


@_guard
def _runs_metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.metrics(args.run_id, names=args.name, rank=args.rank, since=args.since,
                              max_points=args.max_points)
    if not args.csv:
        _print_json(data)
        return 0
    print("name,rank,peer,step,t,value")
    for series in data["series"]:
        peer = "" if series["peer"] is None else series["peer"]
        for step, t, value in series["points"]:
            print(f"{series['name']},{series['rank']},{peer},{step},{t},{'' if value is None else value}")
    return 0


@_guard
def _runs_logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.logs(args.run_id, rank=args.rank, tail=args.tail)
    for line in data["lines"]:
        print(f"[rank {line['rank']}] {line['line']}")
    return 0


