"""Data sets read by workers: webdataset shards in moto's S3 server (a real process), through a
bounded node cache and a site cache, each worker its batch share of every epoch."""

from __future__ import annotations

import bisect
import collections
from pathlib import Path

import pytest
import torch

from hybridtrain.data_access import FROM_SITE, FROM_STORE, DatasetAccess, DatasetError
from hybridtrain.datasets import (
    DIGEST,
    SAMPLES,
    NodeCache,
    ShardedDataset,
    SiteCache,
    pack_dir,
    read_index,
    sample_digest,
    write_dataset,
)
from tests.object_store import ACCESS_KEY, REGION, SECRET_KEY
from trainer.loader import make_loader

N = 200


def _samples() -> list[tuple[torch.Tensor, int]]:
    return [(torch.full((8,), float(i)), i) for i in range(N)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds")
    # About 20 samples per shard: 10 shards.
    write_dataset(_samples(), out, shard_bytes=20 * 1800)
    return out


@pytest.fixture(scope="module")
def s3_url(s3_server, folder) -> str:
    return s3_server.put_folder(folder, "datasets-test", "toy/v1")


def _access(s3_server, url: str, **changes) -> DatasetAccess:
    base = dict(id=7, name="toy", url=url, endpoint_url=s3_server.endpoint, region=REGION,
                access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    return DatasetAccess(**(base | changes))


def _ids(batch) -> list[int]:
    return [int(v) for v in batch[1]]


def test_writer_shards_samples_and_indexes_them(folder):
    index = read_index(folder)
    assert index.samples == N and len(index.shards) > 3
    assert sum((folder / s.name).stat().st_size for s in index.shards) == index.size_bytes


def test_two_workers_with_unequal_shares_read_each_sample_once_per_epoch(s3_server, s3_url, tmp_path):
    sizes = [30, 10]  # a faster GPU's worker reads three times as much
    steps = N // sum(sizes)
    seen: collections.Counter[int] = collections.Counter()
    per_worker = []
    for worker in (0, 1):
        ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path / f"node{worker}", 10**8))
        batches = list(make_loader(ds, first_step=1, last_step=steps, worker=worker, batch_sizes=sizes, seed=3))
        ids = [i for b in batches for i in _ids(b)]
        per_worker.append(len(ids))
        seen.update(ids)
        for b in batches:
            assert torch.equal(b[0][:, 0], b[1].float())  # each sample is the one written
    assert per_worker == [30 * steps, 10 * steps]
    assert seen == collections.Counter(range(N))


def test_the_sample_digest_adds_up_across_batches_in_any_order():
    assert sample_digest([3, 1]) + sample_digest([0, 2]) == sample_digest(range(4))
    assert sample_digest([]) == 0 and sample_digest([5]) < 2**32


def test_the_sample_digest_tells_a_sample_read_twice_from_one_read_once_each():
    # The same count, one sample twice and one not at all.
    assert sample_digest([0, 1, 1, 3]) != sample_digest(range(4))


def test_the_loaders_batches_are_counted_with_their_digest_once_per_epoch(s3_server, s3_url, tmp_path):
    sizes, steps = [30, 10], N // 40  # one epoch: every sample once across the two workers
    totals = {SAMPLES: 0, DIGEST: 0}
    for worker in (0, 1):
        ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path / f"node{worker}", 10**8))
        ds.take_reads()
        for _ in make_loader(ds, first_step=1, last_step=steps, worker=worker, batch_sizes=sizes, seed=3,
                             transform=lambda sample: sample):
            pass
        reads = ds.take_reads()
        totals = {k: totals[k] + reads[k] for k in totals}
    assert totals == {SAMPLES: N, DIGEST: sample_digest(range(N))}


def test_epoch_order_is_the_same_for_a_seed_and_differs_across_epochs(s3_server, s3_url, tmp_path):
    ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path, 10**8))
    assert torch.equal(ds.epoch_order(5, 0), ds.epoch_order(5, 0))
    assert not torch.equal(ds.epoch_order(5, 0), ds.epoch_order(5, 1))
    assert sorted(ds.epoch_order(5, 1).tolist()) == list(range(N))


def test_reading_resumes_mid_epoch_with_the_batches_it_would_have_read(s3_server, s3_url, tmp_path):
    ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path, 10**8))
    whole = [_ids(b) for b in make_loader(ds, first_step=1, last_step=8, worker=1, batch_sizes=[12, 8], seed=1)]
    resumed = [_ids(b) for b in make_loader(ds, first_step=5, last_step=8, worker=1, batch_sizes=[12, 8], seed=1)]
    assert resumed == whole[4:]


def test_a_global_batch_touches_the_shards_of_at_most_two_windows(s3_server, s3_url, tmp_path):
    ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path, 10**8), window=2)
    assert len(ds.index.shards) >= 8

    def shards_touched(order: list[int]) -> int:
        return max(len({bisect.bisect_right(ds.starts, i) for i in order[b:b + 20]}) for b in range(0, N, 20))

    assert shards_touched(ds.epoch_order(0, 0).tolist()) <= 4
    # A plain permutation would have each global batch reach into most shards.
    assert shards_touched(torch.randperm(N).tolist()) >= 6


def test_a_second_read_comes_from_the_node_cache(s3_server, s3_url, tmp_path):
    cache = NodeCache(tmp_path, 10**8)
    first = ShardedDataset(_access(s3_server, s3_url), cache)
    list(first[i] for i in range(N))
    fetched = first.take_reads()[FROM_STORE]
    second = ShardedDataset(_access(s3_server, s3_url), cache)
    list(second[i] for i in range(N))
    assert fetched >= first.index.size_bytes
    assert second.take_reads()[FROM_STORE] < 10_000  # its index only: every shard was cached
    assert cache.used_bytes() == first.index.size_bytes


def test_the_node_cache_stays_within_its_bound_and_evicts_the_oldest(s3_server, s3_url, tmp_path):
    shards = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path / "probe", 10**8)).index.shards
    bound = shards[0].bytes * 3 + 10
    cache = NodeCache(tmp_path / "small", bound)
    ds = ShardedDataset(_access(s3_server, s3_url), cache)
    for j in range(len(shards)):
        ds.shard_samples(j)
        assert cache.used_bytes() <= bound
    assert not cache.path(shards[0].sha256).exists()
    assert cache.path(shards[-1].sha256).exists()


def test_a_cache_smaller_than_a_shard_is_refused_with_the_reason(s3_server, s3_url, tmp_path):
    ds = ShardedDataset(_access(s3_server, s3_url), NodeCache(tmp_path, 100))
    with pytest.raises(DatasetError, match="cannot hold shard"):
        ds[0]


def test_the_site_cache_fetches_each_shard_over_the_wan_once_per_site(s3_server, s3_url, tmp_path):
    site = SiteCache(NodeCache(tmp_path / "site", 10**8))
    server = site.serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reads = []
        for node in ("a", "b"):
            ds = ShardedDataset(_access(s3_server, s3_url, cache_url=url), NodeCache(tmp_path / node, 10**8))
            list(ds[i] for i in range(N))
            reads.append(ds.take_reads())
        size = ds.index.size_bytes
        assert site.fetched_bytes == size
        # Node a's misses crossed the WAN (plus the index); node b read every shard from the site.
        assert reads[0][FROM_STORE] - size < 10_000 and reads[0][FROM_SITE] == 0
        assert reads[1][FROM_SITE] == size and reads[1][FROM_STORE] < 10_000
    finally:
        server.shutdown()


def test_the_site_cache_reports_each_shard_fetched_once_and_served_to_each_node(s3_server, s3_url, tmp_path):
    import httpx

    server = SiteCache(NodeCache(tmp_path / "site", 10**8)).serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for node in ("a", "b"):
            ds = ShardedDataset(_access(s3_server, s3_url, cache_url=url), NodeCache(tmp_path / node, 10**8))
            list(ds[i] for i in range(N))
        stats = httpx.get(f"{url}/stats").json()
    finally:
        server.shutdown()
    index = ds.index
    assert (stats["fetched_bytes"], stats["served_bytes"]) == (index.size_bytes, 2 * index.size_bytes)
    assert stats["shards"] == {s.sha256: {"name": s.name, "fetched": 1, "served": 2} for s in index.shards}


def test_a_node_behind_a_site_cache_reads_the_index_through_it(s3_server, s3_url, folder, tmp_path):
    site = SiteCache(NodeCache(tmp_path / "site", 10**8))
    server = site.serve("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        ds = ShardedDataset(_access(s3_server, s3_url, cache_url=url), NodeCache(tmp_path / "node", 10**8))
    finally:
        server.shutdown()
    index_bytes = (folder / "index.json").stat().st_size
    assert site.stats()["index_bytes"] == index_bytes
    assert ds.take_reads()[FROM_STORE] == index_bytes  # it crossed the WAN all the same, by way of the cache


def test_a_corrupt_shard_is_named(s3_server, folder, tmp_path):
    index = read_index(folder)
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    shard = broken / index.shards[1].name
    shard.write_bytes(shard.read_bytes()[:-700])
    url = s3_server.put_folder(broken, "datasets-test", "broken")
    ds = ShardedDataset(_access(s3_server, url), NodeCache(tmp_path / "c", 10**8))
    with pytest.raises(DatasetError, match=f"shard {index.shards[1].name} is truncated or corrupt"):
        ds[ds.starts[1]]


def test_a_missing_credential_is_named(s3_server, s3_url, tmp_path):
    with pytest.raises(DatasetError, match="no credential for the store"):
        ShardedDataset(_access(s3_server, s3_url, secret_access_key=None), NodeCache(tmp_path, 10**8))


def test_an_unreadable_url_is_named(s3_server, tmp_path):
    with pytest.raises(DatasetError, match="cannot read s3://datasets-test/nothing-here/index.json: the store answered NoSuchKey"):
        ShardedDataset(_access(s3_server, "s3://datasets-test/nothing-here"), NodeCache(tmp_path, 10**8))


def test_an_index_the_site_cache_cannot_read_is_named_with_the_stores_reason(s3_server, tmp_path):
    server = SiteCache(NodeCache(tmp_path / "site", 10**8)).serve("127.0.0.1", 0)
    try:
        cache_url = f"http://127.0.0.1:{server.server_address[1]}"
        access = _access(s3_server, "s3://datasets-test/nothing-here", cache_url=cache_url)
        with pytest.raises(DatasetError, match="could not read the index .*the store answered NoSuchKey"):
            ShardedDataset(access, NodeCache(tmp_path / "node", 10**8))
    finally:
        server.shutdown()


def test_a_folder_of_files_becomes_samples_by_key(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"{i:03d}.txt").write_text(f"sample {i}")
        (src / f"{i:03d}.cls").write_text(str(i % 2))
    index = pack_dir(src, tmp_path / "out")
    ds = ShardedDataset(DatasetAccess(id=1, name="files", url=str(tmp_path / "out")), None)
    assert index.samples == 5
    assert ds[3] == {"txt": "sample 3", "cls": 1}
