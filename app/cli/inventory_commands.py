"""`hybridtrain plans optimize`, `hybridtrain bundles ...` and `hybridtrain nodes list/drain`: the
commands about what runs are made of (exit statuses as in app.cli.run_commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.run_arguments import connection_args
from app.cli.run_commands import (
    EXIT_RUN_FAILED, EXIT_TIMEOUT, EXIT_USAGE, _client, _guard, _print_json, prediction_table, resolve_cluster,
)
from app.cli.run_flags import (
    UsageError, add_code_flags, bundle_flag, cluster_ref, code_bundle, ids, task_args_flag, task_flag,
)
from hybridtrain.option_flags import add_option


def register_plans(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `plans optimize` to the `hybridtrain` parser."""
    plans = sub.add_parser("plans", help="choose nodes, server and strategy from the performance model")
    plans_sub = plans.add_subparsers(dest="plans_command", required=True)
    opt = plans_sub.add_parser("optimize", help="the cheapest (or fastest) plan over candidate nodes, explained")
    connection_args(opt)
    where = opt.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=ids, help="candidate node ids, e.g. 1,2,3")
    where.add_argument("--cluster", type=cluster_ref, help="a cluster id or name")
    # The training options' flags default to None, as runs create's do: unset, the request's default applies.
    add_option(opt, "task")
    add_option(opt, "task_args")
    add_code_flags(opt)
    add_option(opt, "global_batch_size")
    opt.add_argument("--goal", choices=("cost", "fastest"), default="cost",
                     help="lowest $/1M samples (default) or highest samples/s")
    opt.add_argument("--budget-usd-per-h", type=float, default=None)
    opt.add_argument("--deadline-s", type=float, default=None, help="with --max-steps: finish within")
    add_option(opt, "max_steps", note="with --deadline-s, the steps that must fit in it")
    opt.add_argument("--dataset", dest="datasets", action="append", default=None, metavar="NAME",
                     help="a registered data set the run reads: its reads from the store count in the cost (repeatable)")
    opt.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    from app.cli.profile_commands import add_plan_profile_flags

    add_plan_profile_flags(opt)
    opt.set_defaults(func=_plans_optimize)


def register_bundles(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `bundles list` and `bundles delete` to the `hybridtrain` parser."""
    bundles = sub.add_parser("bundles", help="the code bundles stored on the control plane")
    bundles_sub = bundles.add_subparsers(dest="bundles_command", required=True)
    ls = bundles_sub.add_parser("list", help="list bundles, newest first")
    connection_args(ls)
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_bundles_list)
    delete = bundles_sub.add_parser("delete", help="delete a bundle no active run uses")
    connection_args(delete)
    delete.add_argument("sha256")
    delete.set_defaults(func=_bundles_delete)


def add_nodes_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `nodes list`, `nodes drain` and `nodes undrain` to the `hybridtrain` parser."""
    nodes = sub.add_parser("nodes", help="the machines the control plane knows")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True)
    ls = nodes_sub.add_parser("list", help="list nodes with status, GPUs and hardware warnings")
    connection_args(ls)
    ls.add_argument("--status", default=None)
    ls.add_argument("--site", type=int, default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_nodes_list)
    for action, text in (("drain", "finish the node's runs and give it no new one"),
                         ("undrain", "end a drain: the node takes runs again")):
        cmd = nodes_sub.add_parser(action, help=text)
        connection_args(cmd)
        cmd.add_argument("node", help="the node's name or id")
        cmd.set_defaults(func=_nodes_drain, action=action)


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


@_guard
def _nodes_drain(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node_id = _node_id(client, args.node)
        node = client.drain_node(node_id) if args.action == "drain" else client.undrain_node(node_id)
    print(f"node {node['name']} (id {node['id']}) is {node['status']}")
    return 0


def _node_id(client: Any, ref: str) -> int:
    """The id of the node named (or numbered) `ref`; UsageError naming it when unknown."""
    if ref.isdigit():
        return int(ref)
    for node in client.list_nodes(limit=1000)["data"]:
        if node["name"] == ref:
            return int(node["id"])
    raise UsageError(f"no node named {ref!r} (see `hybridtrain nodes list`)")


@_guard
def _bundles_list(args: argparse.Namespace) -> int:
    from hybridtrain.packing import human_bytes

    with _client(args) as client:
        page = client.list_bundles(limit=args.limit)
    if args.json:
        _print_json(page)
        return 0
    for bundle in page["data"]:
        print(f"{bundle['sha256']}  {human_bytes(bundle['size_bytes']):>10} {bundle['files']:>6} files  "
              f"{str(bundle['created_at'])[:19].replace('T', ' ')}  {bundle.get('filename') or '-'}  "
              f"by {bundle['created_by']}")
    return 0


@_guard
def _bundles_delete(args: argparse.Namespace) -> int:
    try:
        sha256 = bundle_flag(args.sha256)
    except UsageError as exc:
        print(f"hybridtrain: {str(exc).replace('--bundle', 'SHA256')}", file=sys.stderr)
        return EXIT_USAGE
    with _client(args) as client:
        client.delete_bundle(sha256)
    print(f"hybridtrain: deleted bundle {sha256}", file=sys.stderr)
    return 0


@_guard
def _plans_optimize(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"goal": args.goal}
    if args.nodes is not None:
        body["node_ids"] = args.nodes
    else:
        body["cluster_id"] = args.cluster
    for key, value in [("task", task_flag(args.task)), ("task_args", task_args_flag(args.task_args)),
                       ("global_batch_size", args.global_batch), ("budget_usd_per_h", args.budget_usd_per_h),
                       ("deadline_s", args.deadline_s), ("max_steps", args.max_steps),
                       ("datasets", args.datasets)]:
        if value is not None:
            body[key] = value
    with _client(args) as client:
        resolve_cluster(client, body)
        if (sha256 := code_bundle(client, args)) is not None:
            body["bundle_sha256"] = sha256
        from app.cli.profile_commands import inputs_text, wait_for_profiles

        if args.profile:
            body["profile_missing"] = True
        answer, ended = wait_for_profiles(lambda: client.optimize_plan(body), client.optimize_plan(body),
                                          wait_s=args.profile_wait, out=sys.stderr)
    if args.json:
        _print_json(answer)
        return 0 if ended else EXIT_TIMEOUT
    if "plan" not in answer:  # still profiling: the reason there is no plan yet
        print(f"hybridtrain: no plan yet: {answer.get('detail')}", file=sys.stderr)
        return EXIT_TIMEOUT if not ended else EXIT_RUN_FAILED
    plan = answer["plan"]
    print(answer["explanation"])
    print(prediction_table([plan]))
    print(f"nodes: {', '.join(str(w['node_id']) for w in plan['workers'] if w['role'] == 'worker')}; "
          f"server: {plan.get('ps_node_id') or 'none'}; strategy {plan['strategy']}")
    inputs = inputs_text(plan)
    if inputs:
        print(inputs)
    return 0
