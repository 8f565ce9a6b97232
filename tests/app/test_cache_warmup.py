"""A run's first epoch through cold caches, computed from its step and its workers' byte
metrics: the shards read, the bytes per site, and the states warming, warm and stopped."""

from __future__ import annotations

import pytest

from app.cache_warmup import WarmupDataset, WarmupFeed, warmup

# 40 shards of 100 samples each; global batch 60: step t has read 60 t samples of 4,000.
IMAGES = WarmupDataset(id=7, name="images", shards=40, samples=4000)
# Ranks 1-2 on two nodes of the lab (behind a site cache), rank 3 alone in the cloud.
SITES = {1: ("lab", 11), 2: ("lab", 12), 3: ("gcp-eu", 13)}
MB = 10**6


def reads(**by_rank):
    """{rank_N: (from the store, from the site cache)} as the metrics' totals for data set 7."""
    out = {}
    for key, (store, cache) in by_rank.items():
        rank = int(key.removeprefix("rank_"))
        out[("data_bytes", rank, 7)] = store
        out[("data_cache_bytes", rank, 7)] = cache
    return out


def test_twenty_steps_of_sixty_read_thirty_percent_of_the_epoch_and_twelve_shards():
    [w] = warmup([IMAGES], step=20, global_batch=60, active=True, rank_sites=SITES,
                 reads=reads(rank_1=(90 * MB, 30 * MB), rank_2=(30 * MB, 90 * MB), rank_3=(60 * MB, 0)))
    assert (w.state, w.shards_read, w.shards, w.fraction) == ("warming", 12, 40, pytest.approx(0.3))
    assert w.store_bytes == 180 * MB
    lab, cloud = w.sites
    assert (lab.site, lab.node_ids, lab.store_bytes, lab.site_cache_bytes) == ("lab", (11, 12), 120 * MB, 120 * MB)
    assert (cloud.site, cloud.node_ids, cloud.store_bytes, cloud.site_cache_bytes) == ("gcp-eu", (13,), 60 * MB, 0)
    assert w.summary == "warming caches: 12 / 40 shards (30%), 171.7 MiB from the store"
    assert lab.summary == "lab (nodes 11, 12): 114.4 MiB from the store, 114.4 MiB from the site cache"


def test_the_caches_read_warm_once_the_first_epoch_is_done():
    [w] = warmup([IMAGES], step=67, global_batch=60, active=True, rank_sites=SITES, reads={})  # 4,020 samples
    assert (w.state, w.shards_read, w.fraction) == ("warm", 40, 1.0)
    assert w.summary.startswith("caches warm: the first epoch read its 40 shards")


def test_a_run_that_ended_within_its_first_epoch_says_so():
    [w] = warmup([IMAGES], step=10, global_batch=60, active=False, rank_sites=SITES, reads={})
    assert w.state == "stopped" and w.summary.startswith("the run stopped in its first epoch: 6 / 40 shards (15%)")


def test_before_the_first_step_nothing_is_read_yet():
    [w] = warmup([IMAGES], step=None, global_batch=60, active=True, rank_sites=SITES, reads={})
    assert (w.state, w.shards_read, w.fraction, w.store_bytes) == ("warming", 0, 0.0, 0)


def test_the_feed_adds_new_rows_to_the_stored_totals_and_hands_out_a_changed_view_once():
    feed = WarmupFeed([IMAGES], 60, SITES, step=20, reads=reads(rank_1=(90 * MB, 0)))
    assert feed.take(active=True)[0]["shards_read"] == 12  # the page's view
    assert feed.take(active=True) is None
    feed.add([("loss", 1, None, 21, 0.5), ("data_bytes", 1, 7, 21, 10 * MB), ("data_bytes", 3, 7, 21, 5 * MB),
              ("bytes_sent", 1, 0, 21, 999.0), ("data_cache_bytes", 2, 7, 21, 2 * MB)])
    [view] = feed.take(active=True)
    assert view["shards_read"] == 12 and view["store_bytes"] == 105 * MB  # 21 steps: 31.5 %
    assert [s["store_bytes"] for s in view["sites"]] == [100 * MB, 5 * MB]
    assert view["sites"][0]["site_cache_bytes"] == 2 * MB
    assert feed.take(active=False)[0]["state"] == "stopped"
