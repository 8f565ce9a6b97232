"""bench/predict.py compares the prediction of the steps it measures: the phases of the
prediction (warm-up, the densities' path, the settled state) reduced over the measured window
as the run's steps are (median step time, median cross-site bytes)."""

from __future__ import annotations

import pytest

from bench.predict import compare, window_figures

PREDICTED = {
    "global_batch": 100, "samples_per_s": 10.0, "step_s": 10.0, "bytes_per_step": [],
    "phases": [
        {"first_step": 1, "last_step": 2, "step_s": 10.0, "cross_site_bytes_per_step": 1000},
        {"first_step": 3, "last_step": 3, "step_s": 2.0, "cross_site_bytes_per_step": 300},
        {"first_step": 4, "last_step": 4, "step_s": 1.5, "cross_site_bytes_per_step": 200},
        {"first_step": 5, "last_step": None, "step_s": 1.0, "cross_site_bytes_per_step": 100},
    ],
}


def test_window_figures_take_the_median_step_of_the_measured_steps() -> None:
    # Steps 3..7: 2.0, 1.5, 1.0, 1.0, 1.0 s -> median 1.0 s; bytes 300, 200, 100, 100, 100.
    assert window_figures(PREDICTED, 3, 7) == {"samples_per_s": 100.0, "step_s": 1.0, "egress_bytes_per_step": 100}


def test_window_figures_see_the_transient_of_a_short_window() -> None:
    assert window_figures(PREDICTED, 2, 4) == {"samples_per_s": 50.0, "step_s": 2.0, "egress_bytes_per_step": 300}


def test_window_figures_are_none_without_phases() -> None:
    assert window_figures({"global_batch": 100, "samples_per_s": 5.0}, 3, 7) is None


def test_compare_uses_the_window_when_given() -> None:
    measured = {"samples_per_s": 80.0, "egress_bytes_per_step": 100}
    cell = compare(PREDICTED, measured, {}, window=(3, 7))
    assert cell["predicted_samples_per_s"] == 100.0 and cell["error_samples_pct"] == pytest.approx(25.0)
    assert cell["predicted_egress_bytes_per_step"] == 100 and cell["predicted_over"] == "steps 3-7"
