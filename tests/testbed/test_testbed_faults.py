"""The fault benchmark's figures, from records written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

from testbed.fault_figures import FaultSettings, Injection, check_targets, logged_points, steps_lost, summarise_fault, throughput
from testbed.faults import FAULTS

S = FaultSettings(max_steps=10, fault_step=4, eval_every=100, window=3, global_batch=60)
KILL_WORKER = next(f for f in FAULTS if f.name == "kill-worker")
KILL_SERVER = next(f for f in FAULTS if f.name == "kill-server")


def test_throughput_is_the_batch_over_the_mean_step_gap_in_the_window():
    steps = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 4.0)]
    assert throughput(steps, 60, 1, 4, skip=set()) == 45.0  # gaps 1, 1, 2


def test_throughput_leaves_out_the_step_after_an_evaluation():
    steps = [(1, 0.0), (2, 1.0), (3, 9.0), (4, 10.0)]
    assert throughput(steps, 60, 1, 4, skip={2}) == 60.0


def test_a_resumed_run_counts_the_steps_it_trained_twice():
    steps = [(1, 0.0), (2, 1.0), (3, 2.0), (4, 3.0), (3, 10.0), (4, 11.0), (5, 12.0)]
    assert steps_lost(steps) == 2


def test_logged_points_skip_events_and_lines_cut_short(tmp_path: Path):
    f = tmp_path / "metrics.jsonl"
    records = [
        {"rank": 1, "name": "loss", "step": 1, "t": 1.0, "value": 2.0},
        {"rank": 0, "name": "bytes_sent", "step": 1, "t": 1.0, "value": 10, "peer": 1},
        {"rank": 0, "step": 1, "t": 1.0, "event": "worker_lost", "subject": 2, "detail": ""},
    ]
    f.write_text("\n".join(json.dumps(r) for r in records) + '\n{"rank": 1, "na')
    assert logged_points([f]) == {(1, "loss", 1, -1): 1, (0, "bytes_sent", 1, 1): 1}


def _row(fault, events, steps, **kw):
    base = dict(
        fault=fault, injection=Injection(t=100.0, victim="b", members_after=["a"]),
        run={"id": 7, "status": "succeeded"}, events=events, steps=steps, accuracy=0.9,
        reference_accuracy=0.905, standalone={"a": 30.0, "b": 30.0}, settings=S,
        lost_or_doubled=(0, 0), left_behind=[],
    )
    return summarise_fault(**(base | kw))


def test_detection_is_the_first_matching_event_after_the_fault():
    events = [
        {"t": 50.0, "kind": "worker_lost", "subject": 1},  # an earlier loss is not this fault's
        {"t": 101.5, "kind": "checkpoint"},
        {"t": 102.25, "kind": "worker_lost", "subject": 2},
    ]
    row = _row(KILL_WORKER, events, [(k, float(k)) for k in range(1, 11)])
    assert row["detected_after_s"] == 2.25
    assert row["mode"] == "continued"


def test_event_times_may_come_as_iso_text():
    events = [{"t": "1970-01-01T00:01:43+00:00", "kind": "worker_lost"}]
    assert _row(KILL_WORKER, events, [(1, 0.0)])["detected_after_s"] == 3.0


def test_a_resume_event_makes_the_run_resumed():
    events = [{"t": 101.0, "kind": "restart"}, {"t": 130.0, "kind": "resumed", "step": 5}]
    row = _row(KILL_SERVER, events, [(1, 0.0), (2, 1.0), (1, 40.0), (2, 41.0)])
    assert (row["mode"], row["steps_lost"], row["detected_after_s"]) == ("resumed", 2, 1.0)


def test_after_throughput_is_measured_against_the_survivors_ideal():
    steps = [(k, float(k) * 2.0) for k in range(1, 11)]  # 30 samples/s
    row = _row(KILL_WORKER, [], steps)
    assert (row["survivors_ideal"], row["after_of_ideal"]) == (30.0, 1.0)


def test_a_lost_node_back_before_the_after_window_counts_in_the_ideal():
    steps = [(k, float(k) * 2.0) for k in range(1, 41)]
    events = [{"t": 101.0, "kind": "worker_lost"}, {"t": 110.0, "kind": "worker_joined", "step": 25}]
    row = _row(KILL_WORKER, events, steps, settings=FaultSettings())
    assert (row["after_steps"], row["after_members"], row["survivors_ideal"]) == ([33, 40], ["a", "b"], 60.0)


def test_a_lost_node_back_inside_the_after_window_ends_it_where_it_joins():
    steps = [(k, float(k) * 2.0) for k in range(1, 41)]
    events = [{"t": 101.0, "kind": "worker_lost"}, {"t": 130.0, "kind": "worker_joined", "step": 36}]
    row = _row(KILL_WORKER, events, steps, settings=FaultSettings())
    assert (row["after_steps"], row["after_members"], row["survivors_ideal"]) == ([29, 36], ["a"], 30.0)


def test_targets_flag_a_late_detection_and_doubled_points():
    events = [{"t": 110.0, "kind": "worker_lost"}]
    row = _row(KILL_WORKER, events, [(k, float(k)) for k in range(1, 11)], lost_or_doubled=(0, 3))
    misses = check_targets(row, step_s=1.0)
    assert any("detected after 10.0 s" in m for m in misses)
    assert any("3 doubled" in m for m in misses)


def test_a_clean_fault_run_meets_every_target():
    events = [{"t": 101.0, "kind": "worker_lost"}]
    row = _row(KILL_WORKER, events, [(k, float(k) * 2.0) for k in range(1, 11)])
    assert check_targets(row, step_s=1.0) == []


def test_the_aggregated_variant_asks_for_per_site_aggregation_in_every_runs_compression():
    from dataclasses import replace

    from testbed.faults import _body

    plain, aggregated = (_body(replace(S, aggregate_at_sites=flag), [1, 2, 3], None, "f") for flag in (False, True))
    assert "aggregate_at_sites" not in plain["compression"]
    assert aggregated["compression"] == {**plain["compression"], "aggregate_at_sites": True}
