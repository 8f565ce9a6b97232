"""The chart builders: pure functions from series to Plotly figure dicts."""

from __future__ import annotations

from app.web import compare_figures, figures
from app.web.figures import Series


def _series(name: str, rank: int, values: list[float], t0: float = 0.0) -> Series:
    return Series(name, rank, [(step, t0 + step, v) for step, v in enumerate(values)])


def test_total_throughput_sums_the_workers_latest_values_once_all_reported() -> None:
    late = Series("samples_per_s", 2, [(0, 0.5, 4.0), (2, 2.0, 6.0)])  # no report of step 1 yet
    total = figures.total_throughput([_series("samples_per_s", 1, [10, 11, 12]), late])
    assert total == [(0, 0.5, 14.0), (1, 1.0, 15.0), (2, 2.0, 18.0)]


def test_total_throughput_counts_a_joiner_from_its_first_step_and_a_leaver_until_its_last() -> None:
    steady = _series("samples_per_s", 1, [10.0] * 12)
    joiner = Series("samples_per_s", 2, [(step, float(step), 5.0) for step in range(3, 12)])
    leaver = Series("samples_per_s", 3, [(step, float(step), 7.0) for step in range(0, 4)])
    total = {step: value for step, _, value in figures.total_throughput([steady, joiner, leaver])}
    assert [total[s] for s in (0, 2, 3, 4, 11)] == [17.0, 17.0, 22.0, 15.0, 15.0]


def test_mean_by_bucket_averages_the_ranks_that_reported_in_each_bucket() -> None:
    steady = Series("loss", 1, [(1, 1.0, 4.0), (3, 3.0, 2.0), (5, 5.0, 1.0)])
    joiner = Series("loss", 2, [(3, 3.5, 6.0), (5, 5.5, 3.0)])  # joined in the second bucket
    leaver = Series("loss", 3, [(0, 0.5, 8.0)])  # left in the first: its bucket's last step is 0
    assert figures.mean_by_bucket([steady, joiner, leaver], width=2) == [
        (1, 1.0, 6.0), (3, 3.5, 4.0), (5, 5.5, 2.0)]


def test_throughput_figure_labels_and_leaves_out_the_server() -> None:
    fig = figures.throughput_figure([_series("samples_per_s", 0, [99]), _series("samples_per_s", 1, [10])], t0=0.0, servers={0})
    assert [t["uid"] for t in fig["data"]] == ["sps:total", "sps:1"]
    assert "Throughput" in fig["layout"]["title"]["text"]


def test_loss_figure_goes_log_over_decades() -> None:
    fig = figures.loss_figure([_series("loss", 1, [100.0, 1.0, 0.1]), _series("accuracy", 1, [0.5])], t0=0.0)
    assert [t["uid"] for t in fig["data"]] == ["loss:1"] and fig["layout"]["yaxis"]["type"] == "log"
    assert "Loss" in fig["layout"]["title"]["text"]


def test_evaluation_figure_draws_one_trace_per_task_metric() -> None:
    series = [_series("accuracy", 1, [0.5, 0.7]), _series("val_loss", 1, [1.2, 0.9]), _series("loss", 1, [2.0])]
    fig = figures.evaluation_figure(series, t0=0.0, names=["accuracy", "val_loss"])
    assert [(t["uid"], t["name"]) for t in fig["data"]] == [("eval:accuracy:1", "accuracy"), ("eval:val_loss:1", "val_loss")]
    assert "Evaluation" in fig["layout"]["title"]["text"]


def test_evaluation_figure_says_when_nothing_was_evaluated() -> None:
    assert figures.evaluation_figure([], t0=0.0, names=[])["layout"]["annotations"]


def test_compression_and_egress_figures_say_when_there_is_nothing_to_draw() -> None:
    compression = figures.compression_figure([], t0=0.0)
    egress = figures.egress_figure([], t0=0.0, unpriced=["aws internet egress"])
    assert "Compression" in compression["layout"]["title"]["text"] and compression["layout"]["annotations"]
    assert "Egress" in egress["layout"]["title"]["text"]
    assert any("aws internet egress" in a["text"] for a in egress["layout"]["annotations"])


def test_batch_figure_shows_the_plan_until_a_worker_reports() -> None:
    fig = figures.batch_figure([_series("batch_size", 1, [32, 30])], t0=0.0, planned={1: 32, 2: 32})
    assert [t["name"] for t in fig["data"]] == ["worker 1", "worker 2 (planned)"]


def test_elapsed_rounds_and_keeps_missing_values() -> None:
    assert figures.elapsed([(3, 101.23456, None), (4, 102.0, 1.23456789)], 100.0) == ([1.235, 2.0], [None, 1.23457], [3, 4])


def test_comparison_figures_one_trace_or_bar_per_run() -> None:
    runs = [
        compare_figures.RunSummary(1, "#1 a", 0.0, [(0, 1.0, 2.0)], [(0, 1.0, 100.0)], 42.0, 0.5, 1.0),
        compare_figures.RunSummary(2, "#2 b", 0.0, [(0, 1.0, 3.0)], [(0, 1.0, 90.0)], None, 0.1, 2.0),
    ]
    assert len(compare_figures.compare_loss_figure(runs)["data"]) == 2
    assert len(compare_figures.compare_throughput_figure(runs)["data"]) == 2
    assert compare_figures.time_to_target_figure(runs)["data"][0]["text"] == ["42 s", "not reached"]
    spend = compare_figures.spend_figure(runs)
    assert [t["name"] for t in spend["data"]] == ["compute", "egress"] and spend["layout"]["barmode"] == "stack"


def test_a_local_sgd_runs_compression_chart_draws_the_outer_steps_norm_on_its_own_axis() -> None:
    norms = [Series("outer_norm", r, [(10, 10.0, 0.5), (20, 20.0, 0.25)]) for r in (1, 2)]
    figure = figures.compression_figure(norms, t0=0.0, servers={0})
    (trace,) = figure["data"]  # every worker logs the same norm: one trace
    assert trace["uid"] == "outer_norm:1" and trace["yaxis"] == "y2" and trace["y"] == [0.5, 0.25]
    assert figure["layout"]["yaxis2"]["overlaying"] == "y"
    # Before the first outer step the axis is there already, for the live points to join.
    assert "yaxis2" in figures.compression_figure([], t0=0.0, outer_steps=True)["layout"]


def test_a_local_sgd_runs_batch_chart_marks_each_workers_outer_steps_by_how_late_they_landed() -> None:
    stale = [Series("outer_staleness", r, [(10, 10.0, 3), (20, 20.0, 1)]) for r in (1, 2)]
    figure = figures.batch_figure(stale, 0.0, {1: 32, 2: 32}, servers={0})
    marks = [t for t in figure["data"] if t["uid"].startswith("staleness:")]
    assert [(t["uid"], t["yaxis"], t["mode"], t["y"]) for t in marks] == [
        ("staleness:1", "y2", "markers", [3.0, 1.0]), ("staleness:2", "y2", "markers", [3.0, 1.0])]
    # Before the first outer step the axis is there already; a run without outer steps has none.
    assert "yaxis2" in figures.batch_figure([], t0=0.0, outer_steps=True)["layout"]
    assert "yaxis2" not in figures.batch_figure([], t0=0.0)["layout"]


def test_a_chart_with_a_right_axis_leaves_room_for_its_labels() -> None:
    assert figures.batch_figure([], t0=0.0, outer_steps=True)["layout"]["margin"]["r"] >= 60
    assert figures.compression_figure([], t0=0.0, outer_steps=True)["layout"]["margin"]["r"] >= 60
    assert figures.batch_figure([], t0=0.0)["layout"]["margin"]["r"] < 60


def test_an_asynchronous_runs_batch_chart_draws_the_servers_late_change_counts_in_a_band_of_their_own() -> None:
    counts = [Series(name, 0, [(10, 10.0, 1), (20, 20.0, 0)]) for name in ("outer_deferred", "outer_folded", "outer_dropped")]
    worker_echo = Series("outer_folded", 1, [(10, 10.0, 1)])  # only the server's rank counts
    figure = figures.batch_figure([*counts, worker_echo], 0.0, {1: 32, 2: 32}, servers={0})
    marks = [t for t in figure["data"] if t.get("yaxis") == "y3"]
    assert [(t["uid"], t["name"], t["mode"], t["y"], t["customdata"]) for t in marks] == [
        ("outer_deferred:0", "outer step: workers deferred", "markers", [1.0, 0.0], [10, 20]),
        ("outer_folded:0", "late changes folded", "markers", [1.0, 0.0], [10, 20]),
        ("outer_dropped:0", "late changes dropped", "markers", [1.0, 0.0], [10, 20])]
    assert marks[1]["hovertemplate"] == "outer step %{customdata}: %{y} late changes folded"
    assert figure["layout"]["yaxis3"]["domain"][1] == 1.0 > figure["layout"]["yaxis"]["domain"][1]


def test_an_asynchronous_runs_batch_chart_has_the_late_change_band_before_the_first_outer_step() -> None:
    assert "yaxis3" in figures.batch_figure([], t0=0.0, outer_steps=True, late_changes=True)["layout"]


def test_a_run_without_asynchronous_outer_steps_has_no_late_change_band() -> None:
    stale = [Series("outer_staleness", 1, [(10, 10.0, 3)])]
    layout = figures.batch_figure(stale, 0.0, {1: 32}, servers={0}, outer_steps=True)["layout"]
    assert "yaxis3" not in layout and "domain" not in layout["yaxis"]
