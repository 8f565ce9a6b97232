"""The live stream's pure parts: the id cursor, the chart appends, and the egress arithmetic."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from app.billing import BYTES_PER_GB, EgressKey, Provider, Site, StaticPriceTable, TrafficClass
from app.billing.traffic import Continent
from app.web.egress import LinkBucket, cumulative_by_class, link_rates
from app.web.live import IdCursor, LinkRate, LiveState, MetricRow


def test_cursor_passes_each_row_on_once_even_when_a_lower_id_commits_late() -> None:
    cursor = IdCursor(10, settle_s=2.0)
    assert cursor.fresh([(12, "b")], now=0.0) == ["b"]  # 11 is still uncommitted
    assert cursor.floor == 10
    assert cursor.fresh([(11, "a"), (12, "b")], now=0.5) == ["a"]
    assert cursor.fresh([(11, "a"), (12, "b"), (13, "c")], now=3.0) == ["c"]
    assert cursor.floor == 12  # 11 and 12 have settled; 13 has not


def test_live_state_appends_points_and_totals_throughput_once_every_worker_reported() -> None:
    state = LiveState(t0=100.0, worker_ranks=[1, 2], server_ranks={0})
    appends = state.apply([
        MetricRow(1, "samples_per_s", 1, -1, 5, 110.0, 300.0),
        MetricRow(2, "samples_per_s", 0, -1, 5, 110.0, 999.0),  # the server's: left out
        MetricRow(3, "loss", 0, -1, 5, 110.0, 1.5),
    ])
    assert {a["uid"] for a in appends} == {"sps:1", "loss:0"}
    assert next(a for a in appends if a["uid"] == "loss:0")["name"] == "loss, server"
    appends = state.apply([MetricRow(4, "samples_per_s", 2, -1, 5, 110.5, 200.0)])
    total = next(a for a in appends if a["uid"] == "sps:total")
    assert total["y"] == [500.0] and total["x"] == [10.5] and total["customdata"] == [5]


def test_live_egress_accumulates_exactly_per_class() -> None:
    rate = LinkRate("internet", Decimal("0.01"))
    state = LiveState(t0=0.0, worker_ranks=[1], link_rates={(0, 1): rate}, egress_usd_by_class={"internet": Decimal("0.5")})
    appends = state.apply([MetricRow(9, "bytes_sent", 0, 1, 3, 1.0, float(BYTES_PER_GB))])
    assert appends[0]["uid"] == "egress:internet" and appends[0]["y"] == [0.51]
    assert state.egress_usd_by_class["internet"] == Decimal("0.51")


def test_egress_chart_ends_at_the_bills_figure() -> None:
    lab = Site("lab", "onprem", "onprem", Continent.europe)
    gcp = Site("gcp", "cloud", "gcp", Continent.north_america, "us-west1", "b")
    at = datetime(2026, 1, 1, tzinfo=UTC)
    prices = StaticPriceTable(egress=[(EgressKey(Provider.gcp, TrafficClass.internet), datetime(2023, 4, 1, tzinfo=UTC), Decimal("0.01"))])
    rates, unpriced = link_rates({0: lab, 1: gcp}, prices, at)
    assert rates[(0, 1)].usd_per_gb == 0 and rates[(1, 0)] == LinkRate("internet", Decimal("0.01")) and unpriced == []
    # docs/costs.md's worked example: 6 GiB each way; only GCP -> on-prem is charged, $0.06.
    buckets = [LinkBucket(1, 0, b, b, float(b), 2 * BYTES_PER_GB) for b in range(3)]
    buckets += [LinkBucket(0, 1, b, b, float(b), 2 * BYTES_PER_GB) for b in range(3)]
    series, totals = cumulative_by_class(buckets, rates)
    assert [p[2] for p in series[0].points] == [0.02, 0.04, 0.06]
    assert totals == {"internet": Decimal("0.06")}


def test_live_state_sends_every_task_metric_to_the_evaluation_chart() -> None:
    state = LiveState(t0=0.0, worker_ranks=[1], eval_names=["accuracy"])
    appends = state.apply([
        MetricRow(1, "r2", 1, -1, 50, 5.0, 0.8),
        MetricRow(2, "accuracy", 1, -1, 50, 5.0, 0.9),
        MetricRow(3, "time_to_target_s", 0, -1, 50, 5.0, 4.0),  # a system metric: no chart
    ])
    assert {(a["chart"], a["uid"], a["name"]) for a in appends} == {
        ("evaluation", "eval:r2:1", "r2"), ("evaluation", "eval:accuracy:1", "accuracy")}
    assert state.eval_names == ["accuracy", "r2"]


def test_live_outer_staleness_goes_to_the_batch_charts_right_axis_per_worker() -> None:
    state = LiveState(t0=100.0, worker_ranks=[1, 2], server_ranks={0})
    appends = state.apply([MetricRow(1, "outer_staleness", 1, -1, 20, 120.0, 2),
                           MetricRow(2, "outer_staleness", 2, -1, 20, 121.0, 4)])
    assert [(a["chart"], a["uid"], a["yaxis"], a["mode"], a["y"]) for a in appends] == [
        ("batch", "staleness:1", "y2", "markers", [2.0]), ("batch", "staleness:2", "y2", "markers", [4.0])]


def test_live_outer_steps_go_to_the_compression_charts_right_axis_once() -> None:
    state = LiveState(t0=100.0, worker_ranks=[1, 2], server_ranks={0})
    appends = state.apply([MetricRow(1, "outer_norm", 1, -1, 20, 120.0, 0.5),
                           MetricRow(2, "outer_norm", 2, -1, 20, 120.0, 0.5)])
    (outer,) = appends
    assert (outer["chart"], outer["uid"], outer["yaxis"], outer["y"]) == ("compression", "outer_norm:1", "y2", [0.5])


def test_live_late_change_counts_go_to_the_batch_charts_band_from_the_server_only() -> None:
    state = LiveState(t0=100.0, worker_ranks=[1, 2], server_ranks={0})
    appends = state.apply([MetricRow(1, "outer_folded", 0, -1, 20, 120.0, 2),
                           MetricRow(2, "outer_folded", 1, -1, 20, 120.0, 2)])
    (folded,) = appends
    assert (folded["chart"], folded["uid"], folded["name"], folded["yaxis"], folded["mode"], folded["y"],
            folded["customdata"]) == ("batch", "outer_folded:0", "late changes folded", "y3", "markers", [2.0], [20])
    assert folded["hovertemplate"] == "outer step %{customdata}: %{y} late changes folded"
