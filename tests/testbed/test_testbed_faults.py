"""The fault benchmark's figures, from records written out by hand."""

from __future__ import annotations

import json
from pathlib import Path

from bench.paper.fault_figures import (
    FaultSettings,
    Injection,
    after_profile,
    check_targets,
    logged_points,
    steps_lost,
    summarise_fault,
    throughput,
)
from bench.paper.fault_report import markdown
from bench.paper.faults import FAULTS

S = FaultSettings(max_steps=10, fault_step=4, eval_every=100, window=3, global_batch=60)
KILL_WORKER = next(f for f in FAULTS if f.name == "kill-worker")
KILL_SERVER = next(f for f in FAULTS if f.name == "kill-server")
CUT_LINK = next(f for f in FAULTS if f.name == "cut-link")


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


def test_a_lost_node_back_too_soon_for_a_window_of_survivors_counts_in_the_ideal_of_the_last_steps():
    steps = [(k, float(k) * 2.0) for k in range(1, 41)]
    events = [{"t": 101.0, "kind": "worker_lost"}, {"t": 110.0, "kind": "worker_joined", "step": 20}]
    row = _row(KILL_WORKER, events, steps, settings=FaultSettings())
    assert (row["after_steps"], row["after_members"], row["survivors_ideal"]) == ([33, 40], ["a", "b"], 60.0)


def test_a_lost_node_back_before_the_last_steps_leaves_the_window_of_survivors_before_its_return():
    steps = [(k, float(k) * 2.0) for k in range(1, 41)]
    events = [{"t": 101.0, "kind": "worker_lost"}, {"t": 110.0, "kind": "worker_joined", "step": 30}]
    row = _row(KILL_WORKER, events, steps, settings=FaultSettings())
    assert (row["after_steps"], row["after_members"], row["survivors_ideal"]) == ([23, 30], ["a"], 30.0)


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


def test_a_silent_worker_noticed_after_more_than_three_step_times_misses_its_target():
    # A cut link is a worker loss too, not only a killed process.
    events = [{"t": 106.42, "kind": "worker_lost"}]
    row = _row(CUT_LINK, events, [(k, float(k) * 2.0) for k in range(1, 11)])
    assert check_targets(row, step_s=2.11) == ["detected after 6.42 s (3 steps: 6.3 s)"]
    assert check_targets(row, step_s=2.2) == []


def test_a_clean_fault_run_meets_every_target():
    events = [{"t": 101.0, "kind": "worker_lost"}]
    row = _row(KILL_WORKER, events, [(k, float(k) * 2.0) for k in range(1, 11)])
    assert check_targets(row, step_s=1.0) == []


def test_the_aggregated_variant_asks_for_per_site_aggregation_in_every_runs_compression():
    from dataclasses import replace

    from bench.paper.faults import _body

    plain, aggregated = (_body(replace(S, aggregate_at_sites=flag), [1, 2, 3], None, "f") for flag in (False, True))
    assert "aggregate_at_sites" not in plain.get("compression", {})
    assert aggregated["compression"] == {**plain.get("compression", {}), "aggregate_at_sites": True}


def _records(steps: range, step_s: float, workers: dict[int, tuple[int, float]]) -> list[dict]:
    """The server's loss every `step_s` and each worker rank's (batch, compute) at every step."""
    out = [{"rank": 0, "peer": None, "name": "loss", "step": k, "t": k * step_s, "value": 1.0} for k in steps]
    for rank, (batch, compute) in workers.items():
        for k in steps:
            out += [{"rank": rank, "peer": None, "name": "batch_size", "step": k, "t": k * step_s, "value": batch},
                    {"rank": rank, "peer": None, "name": "compute_s", "step": k, "t": k * step_s, "value": compute}]
    return out


def test_the_after_profile_splits_the_share_of_the_ideal_into_compute_and_overhead():
    # Survivors a (standalone 40/s) and c (20/s): 60 samples a step is 1 s at the ideal. a gets
    # 40 and computes them in 1.25 s (0.8 of its speed), c 20 in 1.0 s; steps take 2 s.
    records = _records(range(1, 11), 2.0, {1: (40, 1.25), 3: (20, 1.0)})
    p = after_profile(records, lo=4, hi=10, skip=set(), rank_node={1: "a", 2: "b", 3: "c"}, members=["a", "c"],
                      standalone={"a": 40.0, "b": 30.0, "c": 20.0}, global_batch=60)
    assert (p["step_s"], p["ideal_step_s"], p["slowest_compute_s"]) == (2.0, 1.0, 1.25)
    assert (p["compute_share"], p["overhead_share"], p["overhead_s"]) == (0.8, 0.625, 0.75)
    assert p["compute_share"] * p["overhead_share"] == 0.5  # the row's after / survivors' ideal
    assert {n: v["rate_vs_standalone"] for n, v in p["nodes"].items()} == {"a": 0.8, "c": 1.0}


def test_the_after_profile_reads_a_resumed_steps_last_records():
    first = _records(range(1, 6), 1.0, {1: (60, 0.5)})
    again = [dict(r, t=r["t"] + 100.0, value=(1.5 if r["name"] == "compute_s" else r["value"]))
             for r in _records(range(3, 6), 1.0, {1: (60, 0.5)})]
    p = after_profile(first + again, lo=3, hi=5, skip=set(), rank_node={1: "a"}, members=["a"],
                      standalone={"a": 60.0}, global_batch=60)
    assert p["slowest_compute_s"] == 1.5


def test_a_missed_share_after_a_loss_names_its_compute_and_overhead_parts():
    steps = [(k, float(k) * 4.0) for k in range(1, 11)]  # 15 samples/s of a 30 ideal
    records = _records(range(1, 11), 4.0, {1: (60, 2.5)})
    row = _row(KILL_WORKER, [{"t": 101.0, "kind": "worker_lost"}], steps, records=records, rank_node={1: "a", 2: "b"})
    assert check_targets(row, step_s=1.0) == ["after the loss 50% of the survivors' ideal (compute 0.80 x overhead 0.62)"]
    doc = {"reference": {"samples_per_s": 20.0, "final_accuracy": 0.9}, "rows": [row | {"misses": []}],
           "command": "hybridtrain bench faults", "date": "d", "machine": {"cpus": 2}, "duration_s": 60.0,
           "settings": {"fault_step": 4, "max_steps": 10, "checkpoint_every": 5, "window": 3, "global_batch": 60},
           "victim": "b"}
    assert "| kill-worker | 4 | 2 | 2.5 | 0.8 | 1.5 | 0.625 |" in markdown(doc)


def test_the_fault_runs_batch_is_calibrated_to_the_paper_benchmarks_compute_time_and_says_so():
    from bench.paper.fault_figures import QUICK
    from bench.paper.paper_workloads import FULL

    assert FaultSettings().balanced_step_s == FULL.balanced_step_s
    assert QUICK.balanced_step_s is None  # the smoke run keeps its batch
    doc = {"reference": {"samples_per_s": 20.0, "final_accuracy": 0.9}, "rows": [], "command": "hybridtrain bench faults",
           "date": "d", "machine": {"cpus": 2}, "duration_s": 60.0, "victim": "b",
           "settings": {"fault_step": 4, "max_steps": 10, "checkpoint_every": 5, "window": 3, "global_batch": 360},
           "calibration": {"probe_batch": 240, "probe_ideal_samples_per_s": 239.0, "balanced_step_s": 1.5,
                           "global_batch": 360}}
    assert ("global batch 360 (calibrated for 1.5 s of balanced compute from 239.0 samples/s at batch 240)"
            in markdown(doc))


def test_the_reference_run_is_shown_against_the_ideal_measured_right_after_it():
    doc = {"reference": {"samples_per_s": 270.0, "ideal_samples_per_s": 300.0, "final_accuracy": 0.9},
           "rows": [], "command": "hybridtrain bench faults", "date": "d", "machine": {"cpus": 2},
           "duration_s": 60.0, "victim": "b",
           "settings": {"fault_step": 4, "max_steps": 10, "checkpoint_every": 5, "window": 3, "global_batch": 360}}
    text = markdown(doc)
    assert "270 samples/s (0.900 of the 300 ideal measured after it)" in text
    assert "standalone speeds measured right after the run" in text


def test_every_fault_run_re_balances_from_measured_times_as_the_paper_benchmarks_ps_bz_gc_does():
    from bench.paper.faults import _body
    from hybridtrain.strategy_defaults import default, effective

    # Left to ps-bz-gc's default, which re-splits, as the paper benchmark leaves it.
    body = _body(S, [1, 2, 3], None, "f")
    assert "rebalance_every" not in body and body["strategy"] == "ps-bz-gc"
    assert effective("ps-bz-gc", {"rebalance_every": None})["rebalance_every"] == default("ps-bz-gc", "rebalance_every")


def test_processes_are_counted_once_they_have_had_the_time_to_go():
    from bench.paper.fault_figures import wait_until_none_left

    found = iter([[11, 12], [12], []])
    left, waited = wait_until_none_left(lambda: next(found), timeout_s=5.0, poll_s=0.01)
    assert left == [] and waited < 1.0


def test_a_process_still_there_after_the_bound_is_left_behind():
    from bench.paper.fault_figures import wait_until_none_left

    left, waited = wait_until_none_left(lambda: [11], timeout_s=0.05, poll_s=0.01)
    assert left == [11] and waited >= 0.05
