"""A run's workers, real trainer processes, read a data set from moto's S3 server through the
node cache and a site cache, and report the bytes they fetched from the store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch
from trainer_testing import read_metrics, run_cli

from hybridtrain.datasets import NodeCache, SiteCache, sample_digest, write_dataset
from tests.object_store import ACCESS_KEY, REGION, SECRET_KEY, S3Server

TASK = '''
import hybridtrain, torch, torch.nn.functional as F

def task():
    return hybridtrain.Task(
        model=lambda: torch.nn.Linear(12, 2),
        train_data=hybridtrain.dataset("blobs"),
        loss=F.cross_entropy,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
    )
'''


def train_two_workers(s3_server: S3Server, url: str, tmp_path: Path,
                      cache_url: str | None = None) -> subprocess.CompletedProcess:
    """Two allreduce workers (batches 24 and 8) train TASK 16 steps on the data set at `url` in
    `s3_server`, through the site cache at `cache_url` if given; metrics in tmp_path/m.jsonl."""
    dataset = {"id": 4, "name": "blobs", "url": url, "endpoint_url": s3_server.endpoint, "region": REGION,
               "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY}
    if cache_url is not None:
        dataset["cache_url"] = cache_url
    handed = {"datasets": [dataset], "cache_dir": str(tmp_path / "node"), "cache_bytes": 10**8}
    (tmp_path / "datasets.json").write_text(json.dumps(handed))
    (tmp_path / "blobtask.py").write_text(TASK)
    return run_cli("--task", "blobtask:task", "--strategy", "allreduce", "--workers", "2",
                   "--batch-sizes", "24,8", "--max-steps", "16", "--datasets-file", str(tmp_path / "datasets.json"),
                   "--metrics-out", str(tmp_path / "m.jsonl"), cwd=tmp_path, timeout=300)


def test_two_workers_read_a_data_set_in_s3_through_the_site_cache(s3_server, tmp_path):
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randn(12, generator=gen) + 2 * (i % 2), torch.tensor(i % 2)) for i in range(256)]
    index = write_dataset(samples, tmp_path / "shards", shard_bytes=16_000)
    url = s3_server.put_folder(tmp_path / "shards", "datasets-e2e", "blobs")
    site = SiteCache(NodeCache(tmp_path / "site", 10**8))
    server = site.serve("127.0.0.1", 0)
    try:
        proc = train_two_workers(s3_server, url, tmp_path, cache_url=f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "m.jsonl")
    fetched = {r["rank"]: 0 for r in records}
    for r in records:
        if r.get("name") == "data_bytes":
            assert r["peer"] == 4
            fetched[r["rank"]] += r["value"]
    index_bytes = len((tmp_path / "shards" / "index.json").read_bytes())
    # Each shard crossed the WAN once (the site cache's misses); each rank read the index itself.
    assert site.fetched_bytes == index.size_bytes
    assert sum(fetched.values()) == index.size_bytes + 2 * index_bytes
    assert "16 steps in" in proc.stderr  # two epochs of 256 samples at 32 a step


def test_the_workers_report_every_sample_read_once_per_epoch(s3_server, tmp_path):
    samples = [(torch.randn(12), torch.tensor(i % 2)) for i in range(256)]
    write_dataset(samples, tmp_path / "shards", shard_bytes=16_000)
    url = s3_server.put_folder(tmp_path / "shards", "datasets-e2e", "counted")
    proc = train_two_workers(s3_server, url, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_epoch = {epoch: {"data_samples": 0, "data_sample_digest": 0} for epoch in (0, 1)}
    for r in read_metrics(tmp_path / "m.jsonl"):
        if r.get("name") in ("data_samples", "data_sample_digest"):
            by_epoch[(r["step"] - 1) // 8][r["name"]] += int(r["value"])  # 8 steps of 32: one epoch
    expected = {"data_samples": 256, "data_sample_digest": sample_digest(range(256))}
    assert by_epoch == {0: expected, 1: expected}


def test_a_corrupt_shard_fails_the_run_with_its_name(tmp_path):
    samples = [(torch.randn(12), torch.tensor(i % 2)) for i in range(64)]
    index = write_dataset(samples, tmp_path / "shards", shard_bytes=4000)
    shard = tmp_path / "shards" / index.shards[0].name
    shard.write_bytes(shard.read_bytes()[:-512])
    handed = {"datasets": [{"id": 4, "name": "blobs", "url": str(tmp_path / "shards")}]}
    (tmp_path / "datasets.json").write_text(json.dumps(handed))
    (tmp_path / "blobtask.py").write_text(TASK)
    proc = run_cli("--task", "blobtask:task", "--strategy", "allreduce", "--workers", "2", "--global-batch", "64",
                   "--max-steps", "2", "--datasets-file", str(tmp_path / "datasets.json"), cwd=tmp_path, timeout=300)
    assert proc.returncode != 0
    assert f"DatasetError: shard {index.shards[0].name} is truncated or corrupt" in proc.stderr
