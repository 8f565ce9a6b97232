"""The data sets' reads a plan predicts, on hand-computed cases: each node without a site cache
fetches the data set, a site cache fetches it once for its site, a cache smaller than the data
set fetches every epoch, and a run without data sets reads nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from app.billing import BYTES_PER_GB, EgressKey, NodeUsage, Provider, Site, StaticPriceTable, TrafficClass
from app.perfmodel.data import NO_READS, DataCache, DataSetSpec, predict_reads
from app.perfmodel.predict import NodeSpec, TaskSpec, predict, predict_costs

T0 = datetime(2024, 1, 1, tzinfo=UTC)
LAB = Site("lab", "onprem", "onprem", "europe")
STORE = Site("store of images", "cloud", "aws", "north_america", "us-east-1", "use1-az1")
PRICES = StaticPriceTable(egress=[(EgressKey(Provider.aws, TrafficClass.internet), T0, Decimal("0.09"))])
# 10 GiB of 100,000 samples; a run of 5,000 steps of 64 passes over it 3.2 times.
IMAGES = DataSetSpec("images", STORE, 10 * BYTES_PER_GB, 100_000, shards=160)


def lab_node(name: str) -> NodeUsage:
    return NodeUsage(name, LAB, 0, amortised_usd_per_hour=Decimal("0.5"))


def reads(nodes, **kw):
    kw = {"global_batch": 64, "max_steps": 5000, "epochs": None, "prices": PRICES, "at": T0} | kw
    return predict_reads([IMAGES], nodes, **kw)


def test_each_node_without_a_site_cache_fetches_the_first_epoch_from_the_store():
    got = reads([(lab_node("a"), DataCache()), (lab_node("b"), DataCache(bytes=20 * BYTES_PER_GB))])
    assert [(r.node_names, r.via, r.epochs_fetched, r.bytes) for r in got.reads] == [
        (("a",), "node cache", 1.0, 10 * BYTES_PER_GB), (("b",), "node cache", 1.0, 10 * BYTES_PER_GB)]
    assert {r.traffic_class for r in got.reads} == {"internet"}
    # 2 nodes x 10 GiB of AWS internet egress at $0.09/GiB.
    assert got.usd == pytest.approx(1.80)
    assert got.epochs == {"images": pytest.approx(3.2)}


def test_a_site_cache_fetches_the_data_set_once_for_its_site():
    got = reads([(lab_node("a"), DataCache(site_cache=True)), (lab_node("b"), DataCache(site_cache=True))])
    [read] = got.reads
    assert (read.site, read.node_names, read.via, read.bytes) == ("lab", ("a", "b"), "site cache", 10 * BYTES_PER_GB)
    assert got.usd == pytest.approx(0.90)


def test_a_node_cache_smaller_than_the_data_set_fetches_every_epoch():
    got = reads([(lab_node("a"), DataCache(bytes=5 * BYTES_PER_GB))])
    [read] = got.reads
    assert read.epochs_fetched == pytest.approx(3.2)
    assert read.bytes == 32 * BYTES_PER_GB
    assert got.usd == pytest.approx(32 * 0.09)


def test_a_run_shorter_than_an_epoch_fetches_only_the_part_it_reads():
    got = reads([(lab_node("a"), DataCache())], max_steps=390)  # 24,960 samples: 0.2496 epochs
    assert got.reads[0].bytes == round(0.2496 * 10 * BYTES_PER_GB)


def test_a_run_of_unknown_length_is_taken_as_one_epoch():
    got = reads([(lab_node("a"), DataCache(bytes=BYTES_PER_GB))], max_steps=None)
    assert got.run_samples == 100_000 and got.reads[0].bytes == 10 * BYTES_PER_GB
    assert any("one epoch" in a for a in got.assumptions)


def test_a_run_without_data_sets_reads_nothing_and_costs_nothing_more():
    assert predict_reads([], [(lab_node("a"), DataCache())], global_batch=64, max_steps=100, epochs=None,
                         prices=PRICES, at=T0) is NO_READS
    assert NO_READS.usd == 0 and NO_READS.bytes == 0 and NO_READS.usd_per_sample == 0


def test_the_hour_carries_the_reads_spread_over_the_runs_samples():
    node = NodeSpec(1, "a", 1, 100.0)
    prediction = predict("allreduce", workers=[(node, 64)], server=None, links={},
                         task=TaskSpec(params=1000, dense_params=10), max_steps=5000)
    data = reads([(lab_node("a"), DataCache())])
    without = predict_costs(prediction, nodes=[lab_node("a")], prices=PRICES, at=T0)
    costs = predict_costs(prediction, nodes=[lab_node("a")], prices=PRICES, at=T0, reads=data)
    # $0.90 over 320,000 samples, at 360,000 samples/h.
    assert costs.data_usd == pytest.approx(0.90) and costs.data_bytes == 10 * BYTES_PER_GB
    assert costs.data_usd_per_h == pytest.approx(0.90 / 320_000 * 360_000)
    assert costs.total_usd_per_h == pytest.approx(0.5 + costs.data_usd_per_h)
    assert costs.usd_per_million_samples - without.usd_per_million_samples == pytest.approx(0.90 / 320_000 * 1e6)
    assert without.data_usd == 0 and without.data_usd_per_h == 0
