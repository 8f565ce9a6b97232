"""`hybridtrain runs ...`, `hybridtrain nodes list` and `hybridtrain local`: the commands a CI
pipeline or a laptop user runs against a control plane.

Exit status: 0 success; 1 the run failed or was cancelled (`runs create --wait`), or the
control plane refused the request; 2 bad usage; 3 `--wait` timed out; 4 unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `runs`, `nodes` and `local` to the `hybridtrain` parser."""
    _add_runs(sub)
    _add_nodes(sub)
    from app.local import add_local_command

    add_local_command(sub)


def _connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="control plane URL (default $HYBRIDTRAIN_URL or http://127.0.0.1:8000)")
    parser.add_argument("--token", help="API token (default $HYBRIDTRAIN_TOKEN)")


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated ids, got {text!r}") from exc


def _add_runs(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    runs = sub.add_parser("runs", help="launch, watch and cancel training runs")
    runs_sub = runs.add_subparsers(dest="runs_command", required=True)

    create = runs_sub.add_parser("create", help="launch a run (prints it as JSON)")
    _connection_args(create)
    create.add_argument("--name", required=True)
    where = create.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=_ints, help="node ids, e.g. 1,2,3")
    where.add_argument("--cluster", type=int, help="a cluster id")
    create.add_argument("--strategy", default=None, help="ps-bz-gc (default), ps-gc, ps, allreduce, allreduce-powersgd")
    create.add_argument("--model", default=None)
    create.add_argument("--dataset", default=None)
    create.add_argument("--global-batch", type=int, default=None)
    create.add_argument("--lr", type=float, default=None)
    steps = create.add_mutually_exclusive_group()
    steps.add_argument("--max-steps", type=int, default=None)
    steps.add_argument("--epochs", type=int, default=None)
    create.add_argument("--target-accuracy", type=float, default=None)
    create.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=None,
                        help="stop once the target accuracy is reached (the default)")
    create.add_argument("--seed", type=int, default=None)
    create.add_argument("--allocation", choices=("equal", "flops", "measured"), default=None)
    create.add_argument("--device", choices=("cpu", "cuda", "auto"), default=None)
    create.add_argument("--ps-node", type=int, default=None, help="node id of the server")
    create.add_argument("--rebalance-every", type=int, default=None,
                        help="PS strategies: re-split the batch every N steps from compute times")
    create.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps")
    create.add_argument("--compressor", choices=("none", "topk", "randomk"), default=None)
    create.add_argument("--density", type=float, default=None)
    create.add_argument("--value-dtype", choices=("fp32", "fp16"), default=None)
    create.add_argument("--idempotency-key", default=None,
                        help="a retry with the same key returns the same run (e.g. the CI job id)")
    create.add_argument("--plan-only", action="store_true", help="print the plan, launch nothing")
    create.add_argument("--wait", action="store_true",
                        help="wait for the end; exit 0 only if the run succeeded")
    create.add_argument("--timeout", type=float, default=None, help="seconds to --wait at most")
    create.set_defaults(func=_runs_create)

    get = runs_sub.add_parser("get", help="show a run as JSON")
    _connection_args(get)
    get.add_argument("run_id", type=int)
    get.set_defaults(func=_runs_get)

    ls = runs_sub.add_parser("list", help="list runs, newest first")
    _connection_args(ls)
    ls.add_argument("--status", default=None)
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(func=_runs_list)

    cancel = runs_sub.add_parser("cancel", help="cancel a run")
    _connection_args(cancel)
    cancel.add_argument("run_id", type=int)
    cancel.add_argument("--reason", default=None)
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


def _add_nodes(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    nodes = sub.add_parser("nodes", help="the machines the control plane knows")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True)
    ls = nodes_sub.add_parser("list", help="list nodes with status, GPUs and hardware warnings")
    _connection_args(ls)
    ls.add_argument("--status", default=None)
    ls.add_argument("--site", type=int, default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_nodes_list)


# -- handlers -------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from app.client import HybridtrainClient
    from app.config import get_client_settings

    settings = get_client_settings()
    return HybridtrainClient(args.server or settings.url, args.token or settings.token)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def _guard(fn: Any) -> Any:
    # Errors of the API become one line on stderr and an exit status, never a traceback.
    def run(args: argparse.Namespace) -> int:
        from app.client import ApiError

        try:
            return int(fn(args) or 0)
        except ApiError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE if exc.status_code == 0 else EXIT_RUN_FAILED

    return run


def _run_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"name": args.name}
    if args.nodes is not None:
        body["node_ids"] = args.nodes
    else:
        body["cluster_id"] = args.cluster
    for key, value in [
        ("strategy", args.strategy), ("model", args.model), ("dataset", args.dataset),
        ("global_batch_size", args.global_batch), ("lr", args.lr), ("max_steps", args.max_steps),
        ("epochs", args.epochs), ("target_accuracy", args.target_accuracy), ("seed", args.seed),
        ("allocation", args.allocation), ("device", args.device), ("ps_node_id", args.ps_node),
        ("rebalance_every", args.rebalance_every), ("eval_every", args.eval_every),
        ("stop_at_target", args.stop_at_target),
    ]:
        if value is not None:
            body[key] = value
    compression = {
        k: v for k, v in [("compressor", args.compressor), ("density", args.density),
                          ("value_dtype", args.value_dtype)] if v is not None
    }
    if compression:
        body["compression"] = compression
    return body


def _describe(run: dict[str, Any]) -> str:
    ranks = " ".join(f"{w['rank']}:{w['status']}" for w in run["workers"])
    reason = f" ({run['reason']})" if run.get("reason") else ""
    return f"run {run['id']} {run['status']}{reason} [{ranks}]"


@_guard
def _runs_create(args: argparse.Namespace) -> int:
    from app.client import RunTimeout

    body = _run_body(args)
    with _client(args) as client:
        if args.plan_only:
            _print_json(client.plan_run(body))
            return 0
        run = client.create_run(body, idempotency_key=args.idempotency_key)
        print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
        if not args.wait:
            _print_json(run)
            return 0
        try:
            run = client.wait_for_run(
                run["id"], timeout_s=args.timeout,
                on_change=lambda r: print(f"hybridtrain: {_describe(r)}", file=sys.stderr),
            )
        except RunTimeout as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_TIMEOUT
        _print_json(run)
        return 0 if run["status"] == "succeeded" else EXIT_RUN_FAILED


@_guard
def _runs_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.get_run(args.run_id))
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
    with _client(args) as client:
        run = client.cancel_run(args.run_id, reason=args.reason)
    print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
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


@_guard
def _nodes_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_nodes(status=args.status, site_id=args.site, limit=1000)
    if args.json:
        _print_json(page)
        return 0
    for node in page["data"]:
        gpus = ", ".join(f"{g['count']}x {g['model']}" for g in node["gpus"]) or "no GPU"
        beat = node["last_heartbeat"] or "never"
        print(f"{node['id']:>5}  {node['status']:<8} {node['name']:<24} {gpus:<28} heartbeat {beat}")
        warning = (node.get("detected_hardware") or {}).get("mismatch")
        if warning:
            print(f"       warning: {warning}")
    return 0
