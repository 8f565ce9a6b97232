"""`hybridtrain clusters list|create|show|delete`: the named sets of nodes that `runs create
--cluster` and `plans optimize --cluster` take (exit statuses as in app.cli.run_commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.inventory_commands import _node_id
from app.cli.run_arguments import connection_args
from app.cli.run_commands import _client, _guard, _print_json
from app.cli.run_flags import UsageError


def register_clusters(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `clusters list`, `create`, `show` and `delete` to the `hybridtrain` parser."""
    clusters = sub.add_parser("clusters", help="named sets of nodes to launch runs on")
    clusters_sub = clusters.add_subparsers(dest="clusters_command", required=True)

    ls = clusters_sub.add_parser("list", help="list clusters with their nodes")
    connection_args(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_clusters_list)

    create = clusters_sub.add_parser("create", help="group existing nodes into a cluster (prints its id)")
    connection_args(create)
    create.add_argument("--name", required=True)
    members = create.add_mutually_exclusive_group()
    members.add_argument("--nodes", default=None, metavar="NODES",
                         help="node ids or names, comma-separated, e.g. 1,2 or gpu-a,gpu-b")
    members.add_argument("--online", action="store_true", help="every node that is online now")
    create.add_argument("--description", default="")
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=_clusters_create)

    show = clusters_sub.add_parser("show", help="a cluster's nodes with their status and GPUs")
    connection_args(show)
    show.add_argument("cluster", help="the cluster's name or id")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_clusters_show)

    delete = clusters_sub.add_parser("delete", help="delete a cluster (its nodes stay)")
    connection_args(delete)
    delete.add_argument("cluster", help="the cluster's name or id")
    delete.set_defaults(func=_clusters_delete)


def cluster_id(client: Any, ref: str) -> int:
    """The id of the cluster named (or numbered) `ref`; UsageError naming it when unknown."""
    if ref.isdigit():
        return int(ref)
    for cluster in client.list_clusters(limit=1000)["data"]:
        if cluster["name"] == ref:
            return int(cluster["id"])
    raise UsageError(f"no cluster named {ref!r} (see `hybridtrain clusters list`)")


def _member_ids(client: Any, args: argparse.Namespace) -> list[int]:
    if args.online:
        return [int(n["id"]) for n in client.list_nodes(status="online", limit=1000)["data"]]
    refs = [ref.strip() for ref in (args.nodes or "").split(",") if ref.strip()]
    return [_node_id(client, ref) for ref in refs]


def _summary(cluster: dict[str, Any]) -> str:
    ids = ",".join(str(i) for i in cluster["node_ids"]) or "-"
    count = len(cluster["node_ids"])
    line = f"{cluster['id']:>5}  {cluster['name']:<24} {count:>3} node{'' if count == 1 else 's'}  {ids}"
    return f"{line}  {cluster['description']}" if cluster["description"] else line


@_guard
def _clusters_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_clusters(limit=1000)
    if args.json:
        _print_json(page)
        return 0
    if not page["data"]:
        print("hybridtrain: no cluster yet; make one with "
              "`hybridtrain clusters create --name NAME --nodes 1,2` (or --online)", file=sys.stderr)
    for cluster in page["data"]:
        print(_summary(cluster))
    return 0


@_guard
def _clusters_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        node_ids = _member_ids(client, args)
        cluster = client.create_cluster(args.name, node_ids, description=args.description)
    if args.json:
        _print_json(cluster)
    else:
        print(_summary(cluster))
    return 0


@_guard
def _clusters_show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        cluster = client.get_cluster(cluster_id(client, args.cluster))
        nodes = {n["id"]: n for n in client.list_nodes(limit=1000)["data"]}
    if args.json:
        _print_json(cluster)
        return 0
    print(_summary(cluster))
    for node_id in cluster["node_ids"]:
        node = nodes.get(node_id)
        if node is None:
            print(f"{node_id:>5}  (not visible)")
            continue
        gpus = ", ".join(f"{g['count']}x {g['model']}" for g in node["gpus"]) or "no GPU"
        print(f"{node_id:>5}  {node['status']:<8} {node['name']:<24} {gpus}")
    return 0


@_guard
def _clusters_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        target = cluster_id(client, args.cluster)
        client.delete_cluster(target)
    print(f"hybridtrain: deleted cluster {args.cluster}", file=sys.stderr)
    return 0
