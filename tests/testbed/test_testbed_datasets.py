"""A data set in an object store in one cloud, read by a run across three sites of the testbed
(real processes in namespaces, emulated WAN links): the run trains to its target, reads every
sample once per epoch, each shard crosses each WAN link once, and the bill prices the bytes."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

import pytest

from bench import dataset_testbed as dt
from hybridtrain.datasets import read_index, sample_digest
from testbed import lifecycle, services

pytestmark = pytest.mark.e2e

SAMPLES, SHARD_MB = 384, 0.45  # 2.4 MB in 5 shards
PER_EPOCH = SAMPLES // dt.RunSettings.global_batch  # 6 steps of 64; the run is two epochs
# The rates in force when the run starts, by the reading node's site: AWS's internet egress
# (revised just before the run), Table 1's AWS inter-region rate in the US, and nothing within
# the store's own zone.
RATE = {"lab": Decimal("0.25"), "west": Decimal("0.01"), "east": Decimal("0")}
CLASS = {"lab": "internet", "west": "inter_region", "east": "intra_zone"}


def _usd(bytes_at_rates: list[tuple[int, Decimal]]) -> Decimal:
    """By hand: bytes / 2**30 at $/GB each, summed, rounded half-even to a micro-dollar as bills are."""
    total = sum((Decimal(n) / 2**30 * rate for n, rate in bytes_at_rates), Decimal(0))
    return total.quantize(Decimal("0.000001"), rounding=ROUND_HALF_EVEN)


def _revise_aws_internet_price(api, usd_per_gb: Decimal) -> None:
    rows = api.get("/api/v1/prices/egress", params={"provider": "aws", "traffic_class": "internet"}).json()["data"]
    latest = max(rows, key=lambda r: r["effective_from"])
    revised = api.patch(f"/api/v1/prices/egress/{latest['id']}", json={"usd_per_gb": float(usd_per_gb)})
    services.check_response(revised, "revise AWS internet egress")


def test_a_three_site_run_reads_each_sample_once_an_epoch_and_each_shard_once_a_site(
    needs_root: None, tmp_path: Path, state_dir: Path
) -> None:
    name = "d" + secrets.token_hex(4)
    try:
        with ThreadPoolExecutor(1) as pool:  # the data set is made while the testbed comes up
            made = pool.submit(dt.make_dataset, tmp_path, SAMPLES, SHARD_MB)
            state = lifecycle.up(dt.write_config(tmp_path / "tb.yaml", name, site_caches=True),
                                 state_dir=state_dir, log=lambda _m: None)
            shards = made.result()
        index = read_index(shards)
        index_bytes = (shards / "index.json").stat().st_size
        with services.admin_client(state) as api:
            registered = dt.put_and_register(api, state, shards, "blobs")
            _revise_aws_internet_price(api, RATE["lab"])
            run = dt.run(api, state, "blobs")
            assert run["status"] == "succeeded", run.get("reason")
            points = dt.records(api, run["id"], (*dt.DATA_METRICS, "time_to_target_s"))
            bill = api.get(f"/api/v1/runs/{run['id']}/cost").json()
        caches, wan = dt.site_cache_stats(state), dt.store_bytes_by_site(state)
    finally:
        lifecycle.down(name, state_dir=state_dir, log=lambda _m: None)

    assert (registered["samples"], registered["shards"]) == (SAMPLES, len(index.shards))
    assert any(p["name"] == "time_to_target_s" for p in points)  # accuracy >= 0.9 within the two epochs
    # Every sample once an epoch across the five workers: counts and digests of what they read.
    for first in range(1, dt.RunSettings.max_steps + 1, PER_EPOCH):
        epoch = [p for p in points if first <= p["step"] < first + PER_EPOCH]
        assert sum(int(p["value"]) for p in epoch if p["name"] == "data_samples") == SAMPLES
        digest = sum(int(p["value"]) for p in epoch if p["name"] == "data_sample_digest")
        assert digest == sample_digest(range(SAMPLES))
    # Each site's cache fetched each shard from the store once and served it to each of its
    # nodes, and passed the index on to each of them.
    for site, nodes in dt.NODES.items():
        assert caches[site]["shards"] == {s.sha256: {"name": s.name, "fetched": 1, "served": len(nodes)}
                                          for s in index.shards}
        assert caches[site]["index_bytes"] == len(nodes) * index_bytes
    # So each remote site's WAN link carried the data set once, not once a node (headers and the
    # index reads of its nodes and the control plane on top), as the link's counters show.
    assert set(wan) == {"lab", "west"}
    for site in wan:
        assert index.size_bytes < wan[site] < 1.25 * index.size_bytes, (site, wan)
    # The workers reported what their caches read from the store for them; the bill prices it.
    reported = dt.bytes_by_site(run, points, state)
    assert reported == {site: c["fetched_bytes"] + c["index_bytes"] for site, c in caches.items()}
    assert bill["data_read_bytes"] == sum(reported.values())
    assert bill["data_read_usd"] == float(_usd([(reported[s], RATE[s]) for s in dt.NODES]))
    sites = dt.site_of_node(state)
    reads = [link for link in bill["egress_by_link"] if link["src"] == "store of blobs"]
    assert {(link["dst"], link["traffic_class"], link["usd_per_gb"]) for link in reads} == \
        {(node, CLASS[sites[node]], float(RATE[sites[node]])) for node in sites}
