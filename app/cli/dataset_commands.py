"""`hybridtrain datasets create|register|list|show|delete`: shard a user's samples, and the
data sets runs read (docs/datasets.md; exit statuses as in app.cli.run_commands)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.cli.run_arguments import connection_args
from app.cli.run_commands import EXIT_USAGE, _client, _guard, _print_json

PROVIDERS = ("onprem", "gcp", "aws", "azure", "lambda", "other")
CONTINENTS = ("north_america", "south_america", "europe", "asia", "oceania", "africa")


def register_datasets(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `datasets create`, `register`, `list`, `show`, `delete` and `serve-cache`."""
    datasets = sub.add_parser("datasets", help="sharded data sets that runs read from a store")
    ds_sub = datasets.add_subparsers(dest="datasets_command", required=True)

    create = ds_sub.add_parser("create", help="shard a folder of samples (KEY.EXT files) into webdataset tars")
    create.add_argument("--from", dest="source", required=True, metavar="DIR",
                        help="files sharing a name up to the first dot are one sample: 0001.jpg, 0001.cls")
    create.add_argument("--out", required=True, metavar="DIR", help="where index.json and the shards go")
    create.add_argument("--shard-mb", type=float, default=64.0, help="shard size in MiB (default 64)")
    create.set_defaults(func=_create)

    reg = ds_sub.add_parser("register", help="register a data set by URL (the control plane reads its index)")
    connection_args(reg)
    reg.add_argument("name")
    reg.add_argument("url", help="s3://bucket/prefix, https://host/path, or a path that exists on the nodes")
    reg.add_argument("--store-provider", choices=PROVIDERS, default="onprem",
                     help="who runs the store: prices the bytes nodes read from it")
    reg.add_argument("--store-continent", choices=CONTINENTS, default="north_america")
    reg.add_argument("--store-region", default=None)
    reg.add_argument("--store-zone", default=None)
    reg.add_argument("--json", action="store_true")
    reg.set_defaults(func=_register)

    up = ds_sub.add_parser("upload", help="upload a sharded folder into the control plane's store and register it")
    connection_args(up)
    up.add_argument("name")
    up.add_argument("folder", help="a folder `datasets create` wrote: index.json and its shards")
    up.add_argument("--json", action="store_true")
    up.set_defaults(func=_upload)

    ls = ds_sub.add_parser("list", help="list data sets")
    connection_args(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_list)

    show = ds_sub.add_parser("show", help="one data set")
    connection_args(show)
    show.add_argument("name")
    show.add_argument("--json", action="store_true")
    show.set_defaults(func=_show)

    delete = ds_sub.add_parser("delete", help="forget a data set (refused while a run reads it)")
    connection_args(delete)
    delete.add_argument("name")
    delete.set_defaults(func=_delete)

    serve = ds_sub.add_parser("serve-cache", help="serve this site's shards over HTTP: each crosses the WAN once")
    serve.add_argument("--dir", required=True, help="the cache's folder")
    serve.add_argument("--max-gb", type=float, default=100.0, help="bound of the cache in GiB (default 100)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8700)
    serve.set_defaults(func=_serve_cache)


def _summary(d: dict[str, Any]) -> str:
    return (f"{d['name']:<24} {d['samples']:>10} samples {d['shards']:>6} shards "
            f"{d['size_bytes'] / 2**20:>10.1f} MiB  {d['store_provider']}  {d['url']}")


def _show_one(args: argparse.Namespace, dataset: dict[str, Any]) -> None:
    if args.json:
        _print_json(dataset)
    else:
        print(_summary(dataset))


def _create(args: argparse.Namespace) -> int:
    try:
        from tqdm import tqdm

        from hybridtrain.datasets import DatasetError, pack_dir
    except ImportError as exc:
        print(f"hybridtrain: datasets create needs the trainer's packages (pip install 'hybridtrain[agent]'): {exc}",
              file=sys.stderr)
        return EXIT_USAGE
    if not args.shard_mb > 0:
        print(f"hybridtrain: --shard-mb must be > 0, got {args.shard_mb}", file=sys.stderr)
        return EXIT_USAGE
    with tqdm(unit=" samples", desc="sharding", file=sys.stderr) as bar:
        try:
            index = pack_dir(args.source, args.out, shard_bytes=int(args.shard_mb * 2**20),
                             progress=lambda n: bar.update(n - bar.n))
        except DatasetError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_USAGE
    shards = len(index.shards)
    print(f"{args.out}: {index.samples} samples in {shards} shard{'s' if shards != 1 else ''}, "
          f"{index.size_bytes} bytes")
    return 0


@_guard
def _register(args: argparse.Namespace) -> int:
    body = {"name": args.name, "url": args.url, "store_provider": args.store_provider,
            "store_continent": args.store_continent, "store_region": args.store_region,
            "store_zone": args.store_zone}
    with _client(args) as client:
        dataset = client.register_dataset({k: v for k, v in body.items() if v is not None})
    _show_one(args, dataset)
    return 0


@_guard
def _upload(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from hybridtrain.data_access import INDEX_FILE, STORE_URL, DatasetError, parse_index

    folder = Path(args.folder)
    try:
        index = parse_index((folder / INDEX_FILE).read_bytes(), str(folder))
    except (OSError, DatasetError) as exc:
        print(f"hybridtrain: {exc}", file=sys.stderr)
        return EXIT_USAGE
    files = [folder / s.name for s in index.shards]
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        print(f"hybridtrain: {folder} lacks shards of its index: {', '.join(missing[:5])}", file=sys.stderr)
        return EXIT_USAGE
    with _client(args) as client, tqdm(total=index.size_bytes, unit="B", unit_scale=True, desc="uploading",
                                       file=sys.stderr) as bar:
        for path in files:
            client.upload_dataset_file(args.name, path, progress=bar.update)
        # The index last: the control plane checks every shard it names is there, whole.
        client.upload_dataset_file(args.name, folder / INDEX_FILE)
        dataset = client.register_dataset({"name": args.name, "url": STORE_URL})
    _show_one(args, dataset)
    return 0


@_guard
def _list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_datasets(limit=1000)
    if args.json:
        _print_json(page)
        return 0
    if not page["data"]:
        print("hybridtrain: no data set yet; register one with `hybridtrain datasets register NAME URL`",
              file=sys.stderr)
    for dataset in page["data"]:
        print(_summary(dataset))
    return 0


@_guard
def _show(args: argparse.Namespace) -> int:
    with _client(args) as client:
        dataset = client.get_dataset(args.name)
    _show_one(args, dataset)
    return 0


@_guard
def _delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_dataset(args.name)
    print(f"deleted data set {args.name}")
    return 0


def _serve_cache(args: argparse.Namespace) -> int:
    import threading

    from hybridtrain.datasets import NodeCache, SiteCache

    server = SiteCache(NodeCache(args.dir, int(args.max_gb * 2**30))).serve(args.host, args.port)
    print(f"site cache on http://{args.host}:{server.server_address[1]} (set HYBRIDTRAIN_AGENT_DATA_SITE_CACHE_URL)",
          flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0
