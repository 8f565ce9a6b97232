"""Data sets streamed from an object store through the caches: the input pipeline's share of a
worker's step, first epoch against later ones, and the WAN bytes and egress with and without a
site cache.

    .venv/bin/python bench/datasets.py --out results-datasets.json

The store is moto's S3 server (a real process over loopback HTTP; tests/object_store.py), the
data set the shapes images (3x32x32 float32, 12 KiB) in webdataset shards.

1. Input share: the real CLI trains SmallCNN (`ps-bz-gc`, 2 workers, B = 128) on the data set
   through a site cache and the node cache, with 0 and 2 DataLoader processes. A worker's share
   is its `data_s` over its step time (as bench/dataloader.py), for the first epoch's steps
   (cold caches: every shard crosses from the store) and the later ones (warm).
2. WAN bytes: SITES sites of W workers, each worker a node with its own node cache, reading
   their batch shares of two epochs in process, without and with one site cache per site; the
   bytes read from the store are billed as AWS (us-east-1) egress to the sites, two on-prem
   rooms (internet rate) at Table 1's prices (seed 003).

With --testbed (root: it builds the namespace testbed), part 2 runs over real processes and
emulated links instead (bench/dataset_testbed.py): an allreduce run of five nodes in three
sites (on-prem `lab`, AWS `east` holding the store, AWS `west`) reads two epochs of a blobs
data set, once without and once with a site cache in every site; the WAN bytes are the store's
packets counted on each link, the $ the run's bill at the seeded prices.

    sudo .venv/bin/python bench/datasets.py --testbed --out results-datasets-testbed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "tasks"))

from app.billing import NodeUsage, RunUsage, Site, StoreRead, compute_bill  # noqa: E402
from app.billing.table1 import TABLE1_EFFECTIVE, table1_price_table  # noqa: E402
from hybridtrain.data_access import FROM_SITE, FROM_STORE, DatasetAccess  # noqa: E402
from hybridtrain.datasets import NodeCache, ShardedDataset, SiteCache, read_index  # noqa: E402
from tests.object_store import ACCESS_KEY, REGION, SECRET_KEY, moto_server  # noqa: E402
from trainer.loader import make_loader  # noqa: E402


def _access(url: str, endpoint: str, cache_url: str | None = None) -> dict:
    return {"id": 1, "name": "shapes", "url": url, "endpoint_url": endpoint, "region": REGION,
            "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "cache_url": cache_url}


def input_share(tmp: Path, url: str, endpoint: str, loaders: int, steps: int, batch: int, per_epoch: int) -> dict:
    """One CLI run through a fresh site cache and node cache; shares for the first and later epochs."""
    site = SiteCache(NodeCache(tmp / f"site{loaders}", 10**10))
    server = site.serve("127.0.0.1", 0)
    try:
        handed = {"datasets": [_access(url, endpoint, f"http://127.0.0.1:{server.server_address[1]}")],
                  "cache_dir": str(tmp / f"node{loaders}"), "cache_bytes": 10**10}
        (tmp / "datasets.json").write_text(json.dumps(handed))
        out = tmp / f"m{loaders}.jsonl"
        cmd = [sys.executable, "-m", "trainer", "--strategy", "ps-bz-gc", "--workers", "2", "--threads", "1",
               "--task", "shard_images:task", "--global-batch", str(batch), "--max-steps", str(steps),
               "--data-workers", str(loaders), "--datasets-file", str(tmp / "datasets.json"), "--metrics-out", str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench" / "tasks"), str(ROOT)]), OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        server.shutdown()
    if proc.returncode:
        raise SystemExit(f"run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    shares: dict[str, dict[int, float]] = {"first": {}, "later": {}}
    for rank in (1, 2):
        data = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "data_s"}
        rate = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "samples_per_s"}
        size = {r["step"]: r["value"] for r in records if r["rank"] == rank and r["name"] == "batch_size"}
        for part, keep in (("first", lambda s: 1 < s <= per_epoch), ("later", lambda s: s > per_epoch)):
            chosen = [s for s in data if keep(s) and s in rate]
            step_s = sum(size[s] / rate[s] + data[s] for s in chosen)
            shares[part][rank] = sum(data[s] for s in chosen) / step_s if step_s else float("nan")
    fetched = sum(r["value"] for r in records if r.get("name") == "data_bytes")
    return {"data_workers": loaders, "input_share": shares, "store_bytes": fetched,
            "site_cache_fetched": site.fetched_bytes}


def wan_bytes(tmp: Path, url: str, endpoint: str, sites: int, per_site: int, batch: int, epochs: int,
              site_cache: bool) -> dict:
    """Every worker of every site reads its share of `epochs` epochs; bytes from the store per epoch."""
    workers = sites * per_site
    sizes = [batch // workers] * workers
    label = "with" if site_cache else "without"
    servers = [SiteCache(NodeCache(tmp / f"{label}-site{s}", 10**10)).serve("127.0.0.1", 0) if site_cache else None
               for s in range(sites)]
    datasets = []
    for w in range(workers):
        server = servers[w // per_site]
        cache_url = f"http://127.0.0.1:{server.server_address[1]}" if server else None
        access = DatasetAccess(**_access(url, endpoint, cache_url))
        datasets.append(ShardedDataset(access, NodeCache(tmp / f"{label}-node{w}", 10**10)))
    for ds in datasets:
        ds.take_reads()  # the index reads: not the shards' traffic
    # Enough steps that each pass reads its whole epoch (the last batch reaches into the next).
    per_epoch = -(-len(datasets[0]) // sum(sizes))
    by_epoch = []
    reads = {w: 0 for w in range(workers)}
    for epoch in range(epochs):
        first = epoch * per_epoch + 1
        for w, ds in enumerate(datasets):
            for _ in make_loader(ds, first_step=first, last_step=first + per_epoch - 1, worker=w,
                                 batch_sizes=sizes, seed=0):
                pass
        totals = [ds.take_reads() for ds in datasets]
        for w, t in enumerate(totals):
            reads[w] += t[FROM_STORE]
        by_epoch.append({"store": sum(t[FROM_STORE] for t in totals), "site": sum(t[FROM_SITE] for t in totals)})
    for server in servers:
        if server:
            server.shutdown()
    store = Site("store", "cloud", "aws", "north_america", "us-east-1")
    rooms = [Site(f"room{s}", "onprem", "onprem", "europe") for s in range(sites)]
    nodes = [NodeUsage(f"node{w}", rooms[w // per_site], 0.0) for w in range(workers)]
    bill = compute_bill(RunUsage(priced_at=TABLE1_EFFECTIVE, nodes=nodes,
                                 reads=[StoreRead(store, f"node{w}", n) for w, n in reads.items()]), table1_price_table())
    return {"site_cache": site_cache, "by_epoch": by_epoch, "egress_usd": str(bill.egress_usd)}


def testbed_wan(samples: int, shard_mb: float, state_dir: Path) -> dict:
    """The same run on the testbed without and with site caches: WAN bytes on the links, the bill."""
    from bench import dataset_testbed as dt
    from testbed import lifecycle, services

    settings = dt.RunSettings(max_steps=2 * samples // dt.RunSettings.global_batch, timeout_s=900.0)
    result: dict = {"settings": {"samples": samples, "max_steps": settings.max_steps,
                                 "global_batch": settings.global_batch, "nodes": dt.NODES}}
    rows = []
    with tempfile.TemporaryDirectory() as name, lifecycle.signals_raise():
        tmp = Path(name)
        shards = dt.make_dataset(tmp, samples, shard_mb)
        index = read_index(shards)
        result["data_set"] = {"samples": index.samples, "shards": len(index.shards), "bytes": index.size_bytes}
        for caches in (False, True):
            tb = "dsbench" + ("c" if caches else "n")
            path = dt.write_config(tmp / f"{tb}.yaml", tb, site_caches=caches)
            try:
                state = lifecycle.up(path, state_dir=state_dir, log=print)
                with services.admin_client(state) as api:
                    dt.put_and_register(api, state, shards, "blobs")
                    run = dt.run(api, state, "blobs", settings)
                    bill = api.get(f"/api/v1/runs/{run['id']}/cost").json()
                wan = dt.store_bytes_by_site(state)
            finally:
                lifecycle.down(tb, state_dir=state_dir, log=print)
            if run["status"] != "succeeded":
                raise SystemExit(f"the run with site caches={caches} ended {run['status']}: {run.get('reason')}")
            reads = [link for link in bill["egress_by_link"] if link["src"] == "store of blobs"]
            rows.append({"site_cache": caches, "wan_bytes": wan, "data_read_bytes": bill["data_read_bytes"],
                         "data_read_usd": bill["data_read_usd"], "reads": reads})
    result["runs"] = rows
    return result


def print_testbed(result: dict) -> None:
    """The testbed part's table."""
    d = result["data_set"]
    print(f"\n{d['samples']} blobs in {d['shards']} shards, {d['bytes'] / 2**20:.2f} MiB, in the store on AWS east; "
          f"{result['settings']['max_steps']} steps of {result['settings']['global_batch']} (two epochs), "
          f"nodes {result['settings']['nodes']}")
    print_table(["site cache", "WAN bytes store->lab", "store->west", "data bytes billed",
                 "data read $ (AWS, seeded prices)"],
                [[_yes(r["site_cache"]), f"{r['wan_bytes']['lab'] / 2**20:.2f} MiB",
                  f"{r['wan_bytes']['west'] / 2**20:.2f} MiB", f"{r['data_read_bytes'] / 2**20:.2f} MiB",
                  f"{r['data_read_usd']:.6f}"] for r in result["runs"]])


def print_in_process(result: dict, sites: int, workers_per_site: int) -> None:
    """The in-process parts' tables: the input share, then the WAN bytes."""
    d = result["data_set"]
    print(f"\n{d['samples']} images in {d['shards']} shards, {d['bytes'] / 2**20:.1f} MiB, in moto's S3 server")
    print_table(["--data-workers", "first epoch (w1 / w2)", "later epochs (w1 / w2)", "bytes from the store"],
                [[str(r["data_workers"]), _workers(r["input_share"]["first"]), _workers(r["input_share"]["later"]),
                  f"{r['store_bytes'] / 2**20:.1f} MiB"] for r in result["input"]])
    print(f"\n{sites} sites x {workers_per_site} workers, two epochs")
    print_table(["site cache", "WAN bytes epoch 1", "epoch 2", "egress $ (AWS to on-prem, Table 1)"],
                [[_yes(r["site_cache"]), f"{r['by_epoch'][0]['store'] / 2**20:.1f} MiB",
                  f"{r['by_epoch'][1]['store'] / 2**20:.1f} MiB", f"{Decimal(r['egress_usd']):.6f}"]
                 for r in result["wan"]])


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A Markdown table: its header, the rule under it, then a line a row."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _workers(shares: dict) -> str:
    """Two workers' input shares (keys 1 and 2) as `w1 / w2`."""
    return f"{shares[1]:.1%} / {shares[2]:.1%}"


def main(argv: list[str] | None = None) -> int:
    """Write the shards, put them in moto, run both parts, print the tables, write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=None, help="default 4000 (in process), 1536 (--testbed)")
    p.add_argument("--shard-mb", type=float, default=None, help="default 4 (in process), 0.45 (--testbed)")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--epochs", type=int, default=3, help="of the CLI runs")
    p.add_argument("--sites", type=int, default=2)
    p.add_argument("--workers-per-site", type=int, default=3)
    p.add_argument("--testbed", action="store_true", help="part 2 on the namespace testbed (root)")
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.testbed:
        result = testbed_wan(args.samples or 1536, args.shard_mb or 0.45, args.state_dir)
        print_testbed(result)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return 0
    args.samples, args.shard_mb = args.samples or 4000, args.shard_mb or 4.0
    from shard_images import write_images

    result: dict = {}
    with tempfile.TemporaryDirectory() as name, moto_server() as s3:
        tmp = Path(name)
        write_images(tmp / "shards", args.samples, int(args.shard_mb * 2**20))
        index = read_index(tmp / "shards")
        url = s3.put_folder(tmp / "shards", "bench-datasets", "shapes")
        per_epoch = args.samples // args.global_batch
        result["data_set"] = {"samples": index.samples, "shards": len(index.shards), "bytes": index.size_bytes}
        result["input"] = [input_share(tmp, url, s3.endpoint, loaders, per_epoch * args.epochs, args.global_batch,
                                       per_epoch) for loaders in (0, 2)]
        result["wan"] = [wan_bytes(tmp, url, s3.endpoint, args.sites, args.workers_per_site, args.global_batch, 2, on)
                         for on in (False, True)]
    print_in_process(result, args.sites, args.workers_per_site)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
