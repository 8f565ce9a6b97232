"""The benchmark's reductions: figures from metric records, targets, the docs section."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from bench.paper.api_runs import run_body
from bench.paper.ideal import measure_calibrated, profile_argv, samples_per_s
from bench.paper.paper_figures import check_targets, combine_seeds, ideal_of_the_runs, link_prices, summarise
from bench.paper.paper_workloads import (
    FULL,
    QUICK,
    RESNET18,
    WORKLOADS,
    calibrate,
    calibrated_batch,
    configs_of,
    seeds_of,
    strategy_variant,
    variant_body,
    with_overrides,
    workloads_of,
)
from bench.paper.paperbench import at_bandwidth, check_strategies, placer_pause_file, sweep_testbeds, write_results
from bench.paper.report import (
    SECTION,
    figures,
    markdown_table,
    part_title,
    replace_section,
    section,
    strategy_label,
    sweep_groups,
    sweep_table,
    sweep_winners,
    workload,
    write_charts,
)
from hybridtrain.contract import STRATEGIES
from testbed.errors import TestbedError
from testbed.topology import load_config


def _records(
    step_s: float, steps: int, *, ps: bool, tta_name: str = "time_to_target_s"
) -> list[dict[str, Any]]:
    recs: list[dict[str, Any]] = []
    workers = [1, 2] if ps else [0, 1]
    for k in range(1, steps + 1):
        t = 1000.0 + k * step_s
        recs.append({"rank": 0, "peer": None, "name": "loss", "step": k, "t": t, "value": 1.0 / k})
        for w in workers:
            recs.append({"rank": w, "peer": None, "name": "compute_s", "step": k, "t": t, "value": step_s / 2})
            recs.append({"rank": w, "peer": None, "name": "comm_s", "step": k, "t": t, "value": step_s / 4})
            # Rank 2 (cloud-a) is in the cloud: what it sends to rank 0 (on-prem) is egress.
            recs.append({"rank": w, "peer": 0 if ps else 1 - w, "name": "bytes_sent", "step": k, "t": t,
                         "value": 1000.0})
    recs.append({"rank": 0, "peer": None, "name": "accuracy", "step": steps, "t": t, "value": 0.9})
    recs.append({"rank": 0, "peer": None, "name": tta_name, "step": steps, "t": t, "value": 42.0})
    return recs  # fmt: skip


def test_summarise_turns_step_times_into_throughput_and_granularity() -> None:
    out = summarise(
        _records(2.0, 12, ps=True), strategy="ps-bz-gc", global_batch=512, skip_steps=6,
        rank_node={0: "lab-ps", 1: "lab-a", 2: "cloud-a"},
        egress_usd_per_gb=lambda src, dst: 0.12 if src == "cloud-a" else 0.0,
    )  # fmt: skip
    assert out["samples_per_s"] == pytest.approx(256.0)
    # Each worker computes 1 s and communicates 0.5 s of each 2 s step: the bill's ratio.
    assert out["granularity"] == pytest.approx(2.0)
    assert out["bytes_per_step"] == 2000
    assert out["tta_s"] == 42.0 and out["final_accuracy"] == 0.9
    assert out["egress_usd"] == pytest.approx(12 * 1000 / 2**30 * 0.12, abs=1e-8)


def test_granularity_is_unknown_for_a_run_that_reported_no_communication() -> None:
    records = [r for r in _records(2.0, 12, ps=False) if r["name"] != "comm_s"]
    out = summarise(records, strategy="allreduce", global_batch=512, skip_steps=6,
                    rank_node={0: "a", 1: "b"}, egress_usd_per_gb=None)
    assert out["granularity"] is None


def test_granularity_counts_the_workers_not_the_parameter_server() -> None:
    records = _records(2.0, 12, ps=True) + [
        {"rank": 0, "peer": None, "name": name, "step": k, "t": 0.0, "value": 9.0}
        for k in range(1, 13) for name in ("compute_s", "comm_s")]  # fmt: skip
    out = summarise(records, strategy="ps", global_batch=512, skip_steps=6,
                    rank_node={0: "ps", 1: "a", 2: "b"}, egress_usd_per_gb=None)
    assert out["granularity"] == pytest.approx(2.0)


def test_summarise_reads_the_time_to_accuracy_of_runs_from_before_task_metrics() -> None:
    out = summarise(_records(2.0, 12, ps=True, tta_name="time_to_accuracy_s"), strategy="ps",
                    global_batch=512, skip_steps=6, rank_node={}, egress_usd_per_gb=None)  # fmt: skip
    assert out["tta_s"] == 42.0


def test_time_to_target_leaves_out_the_evaluations_up_to_the_targets() -> None:
    # Evaluations at steps 4, 8 and 12 (the target's) took 1.5 s each; one after it does not count.
    records = _records(2.0, 12, ps=True) + [
        {"rank": 0, "peer": None, "name": "eval_s", "step": k, "t": 0.0, "value": 1.5} for k in (4, 8, 12, 16)]
    out = summarise(records, strategy="ps", global_batch=512, skip_steps=6, rank_node={},
                    egress_usd_per_gb=None)  # fmt: skip
    assert out["tta_s"] == pytest.approx(42.0 - 4.5)
    assert out["tta_with_eval_s"] == 42.0 and out["eval_s"] == 6.0


def test_throughput_counts_a_step_that_held_an_evaluation_less_the_evaluations_own_seconds() -> None:
    # 2 s steps; the evaluation after step 8 scored for 1.5 s and waited 3 s more for an
    # outer step it drained: step 9 took 6.5 s, of which the 3 s wait is the run's.
    records = _records(2.0, 12, ps=True)
    for r in records:
        if r["name"] == "loss" and r["step"] >= 9:
            r["t"] += 4.5
    records.append({"rank": 0, "peer": None, "name": "eval_s", "step": 8, "t": 0.0, "value": 1.5})
    out = summarise(records, strategy="ps", global_batch=512, skip_steps=6, rank_node={},
                    egress_usd_per_gb=None)  # fmt: skip
    # Steps 7-12: five of 2 s and one of 2 + 3 s.
    assert out["step_s"] == pytest.approx(15.0 / 6)


def test_summarise_leaves_egress_unknown_without_the_bills_prices() -> None:
    out = summarise(_records(2.0, 12, ps=True), strategy="ps", global_batch=512, skip_steps=6,
                    rank_node={0: "lab-ps", 1: "lab-a", 2: "cloud-a"}, egress_usd_per_gb=None)  # fmt: skip
    assert out["egress_usd"] is None


def test_link_prices_are_the_bills_own_per_link_rates() -> None:
    bill = {"egress_by_link": [
        {"src": "cloud-a", "dst": "lab-ps", "bytes": 10, "traffic_class": "internet",
         "continent": "north_america", "payer": "gcp", "usd_per_gb": 0.12, "usd": 1e-9},
    ]}  # fmt: skip
    price = link_prices(bill)
    assert price("cloud-a", "lab-ps") == 0.12
    # A link the bill did not see costs nothing here, so the cross-check shows the difference.
    assert price("lab-ps", "cloud-a") == 0.0


def test_targets_compare_ps_bz_gc_with_each_baseline() -> None:
    results = {
        "ps-bz-gc": {"samples_per_s": 250.0, "tta_s": 40.0, "final_accuracy": 0.955},
        "ps": {"samples_per_s": 80.0, "tta_s": 100.0, "final_accuracy": 0.96},
        "allreduce": {"samples_per_s": 130.0},
        "allreduce-powersgd": {"samples_per_s": 140.0},
    }
    targets = check_targets(results, ideal=300.0)
    assert targets["throughput vs ps"]["met"] and targets["tta reduction vs ps"]["met"]  # 3.12x, 60 %
    assert not targets["throughput vs allreduce"]["met"]  # 1.92x against 2.2x
    assert targets["throughput vs allreduce-powersgd"]["met"]  # 1.79x
    assert targets["accuracy vs ps (points)"]["value"] == pytest.approx(-0.5)
    assert targets["accuracy vs ps (points)"]["met"]  # within half a point
    assert targets["share of ideal"]["value"] == pytest.approx(0.833) and not targets["share of ideal"]["met"]


def test_every_strategy_gets_the_same_hyperparameters() -> None:
    bodies = [run_body(s, FULL, [1, 2, 3, 4], 5, "x") for s in ("ps", "ps-bz-gc", "allreduce")]
    shared = ("task", "task_args", "global_batch_size", "max_steps", "target", "stop_at_target",
              "eval_every", "seed")
    assert len({json.dumps([b[k] for k in shared]) for b in bodies}) == 1
    assert "ps_node_id" not in bodies[2] and bodies[0]["ps_node_id"] == 5


def test_the_run_body_names_a_task_and_a_target_instead_of_model_and_accuracy() -> None:
    body = run_body("ps-bz-gc", FULL, [1, 2], 3, "x")
    assert body["task"] == "hybridtrain.tasks.digits:widecnn" and body["task_args"] == {"lr": 0.1, "holdout": 0.6}
    assert body["target"] == "accuracy>=0.95"
    assert not {"model", "dataset", "lr", "target_accuracy"} & body.keys()


def test_docs_section_is_replaced_and_the_rest_kept() -> None:
    doc = f"# Benchmarks\n\n## Other\nkeep me\n\n{SECTION}\nold\n\n## After\nkeep too\n"
    out = replace_section(doc, f"{SECTION}\nnew\n")
    assert "old" not in out and "new" in out and "keep me" in out and "keep too" in out
    assert replace_section("# Benchmarks\n", f"{SECTION}\nnew\n").endswith(f"{SECTION}\nnew\n")


def test_the_share_of_the_ideal_is_read_against_the_ideals_measured_after_the_ps_bz_gc_runs() -> None:
    results = {"ps-bz-gc": {"per_seed": [{"ideal_after_samples_per_s": 300.0}, {"ideal_after_samples_per_s": 320.0}]},
               "ps": {"per_seed": [{}]}}
    assert ideal_of_the_runs(results, at_start=350.0) == 310.0
    assert ideal_of_the_runs({"ps": {"per_seed": [{}]}}, at_start=350.0) == 350.0
    table = markdown_table({"results": {}, "ideal_samples_per_s": 310.0, "ideal_at_start_samples_per_s": 350.0})
    assert "| ideal (sum of standalone workers after the ps-bz-gc runs) | 310.0 |" in table


def test_markdown_table_has_a_row_per_strategy_and_the_ideal() -> None:
    doc = {"results": {"ps": {"samples_per_s": 80.0, "steps": 10, "status": "succeeded"},
                       "ps-bz-gc": {"samples_per_s": 240.0, "steps": 10, "status": "succeeded"}},
           "ideal_samples_per_s": 300.0}  # fmt: skip
    table = markdown_table(doc)
    assert "| PS | 80.0 | 3.00 |" in table and "ideal" in table


def test_the_calibrated_batch_computes_for_the_asked_time_at_the_measured_speed() -> None:
    assert calibrated_batch(91.8, 2.0, workers=4) == 184  # 183.6 samples, to a multiple of 8
    assert calibrated_batch(300.0, 2.0, workers=4) == 600


def test_the_calibrated_batch_stays_within_its_bounds() -> None:
    assert calibrated_batch(1.0, 2.0, workers=4) == 32  # 8 samples per worker at least
    assert calibrated_batch(10_000.0, 2.0, workers=4) == 1024
    with pytest.raises(ValueError):
        calibrated_batch(0.0, 2.0, workers=4)


def test_a_slow_workload_is_calibrated_to_a_batch_it_can_learn_from_not_to_the_step_time() -> None:
    # 16 samples/s for 1.5 s would be 24 samples over four workers (the shapes run at chance).
    assert calibrated_batch(16.0, 1.5, workers=4, smallest=FULL.min_global_batch) == 128


def test_calibration_records_the_probe_and_says_when_the_floor_lengthens_the_step() -> None:
    record, lines = calibrate({"a": 150.0, "b": 84.23}, 1.5, 240, 4, smallest=128, largest=1024)
    assert record == {"probe_batch": 240, "probe_ideal_samples_per_s": 234.23, "balanced_step_s": 1.5,
                      "global_batch": 352}
    assert lines == ["  calibrated: 234.23 samples/s at batch 240 -> global batch 352 for 1.5 s of compute a step"]
    record, lines = calibrate({"a": 16.0}, 1.5, 240, 4, smallest=128, largest=1024)
    assert record["global_batch"] == 128 and "would give a batch under 128" in lines[0]


def test_a_calibrated_benchmark_measures_its_ideal_again_at_the_batch_it_chose() -> None:
    measured_at = []

    def ideal_at(s):  # 100 samples/s at batch 240, a little faster per sample at larger batches
        measured_at.append(s.global_batch)
        return {"a": 100.0 + (s.global_batch - 240) / 10}

    s, standalone, record = measure_calibrated(replace(FULL, global_batch=240, balanced_step_s=2.0), ideal_at, 2,
                                               lambda line: None, smallest=128, largest=1024)  # fmt: skip
    assert measured_at == [240, 200] and s.global_batch == 200
    assert standalone == {"a": 96.0} and record["probe_ideal_samples_per_s"] == 100.0


def test_an_uncalibrated_benchmark_measures_its_ideal_once_at_its_batch() -> None:
    measured_at = []
    s, _, record = measure_calibrated(replace(FULL, balanced_step_s=None), lambda s: measured_at.append(1) or {"a": 1.0},
                                      2, print, smallest=128, largest=1024)  # fmt: skip
    assert (measured_at, record, s.global_batch) == ([1], None, FULL.global_batch)


def test_a_batch_given_on_the_command_line_is_not_calibrated() -> None:
    given = with_overrides(FULL, argparse.Namespace(global_batch=128))
    assert given.global_batch == 128 and given.balanced_step_s is None
    assert with_overrides(FULL, argparse.Namespace()).balanced_step_s == FULL.balanced_step_s


def test_the_balanced_compute_time_can_be_overridden_and_is_still_calibrated() -> None:
    s = with_overrides(FULL, argparse.Namespace(balanced_step_s=2.6))
    assert s.balanced_step_s == 2.6 and s.global_batch == FULL.global_batch


def test_pipeline_and_server_k_can_be_overridden_for_an_a_b_comparison() -> None:
    s = with_overrides(RESNET18, argparse.Namespace(pipeline_chunks=1, server_k_fraction=0.5))
    assert s.pipeline_chunks == 1 and s.compression["server_k_fraction"] == 0.5
    assert s.compression["density"] == RESNET18.compression["density"]


def test_every_parameter_server_strategy_gets_the_same_pipeline() -> None:
    settings = replace(FULL, pipeline_chunks=4)
    bodies = {s: run_body(s, settings, [1, 2], 3, "x") for s in ("ps", "ps-gc", "ps-bz-gc", "allreduce")}
    assert all(bodies[s]["compression"]["pipeline_chunks"] == 4 for s in ("ps", "ps-gc", "ps-bz-gc"))
    assert "compression" not in bodies["allreduce"]


def test_the_workload_can_be_overridden_with_a_task_its_args_and_a_target() -> None:
    task = "hybridtrain.tasks.shapes:resnet18"
    s = with_overrides(FULL, argparse.Namespace(task=task, task_args={"lr": 0.05}, target="val_loss<=0.3"))
    assert (s.task, s.task_args, s.target) == (task, {"lr": 0.05}, "val_loss<=0.3")


def test_the_ideal_is_measured_by_the_trainers_profiler_on_the_task() -> None:
    argv = profile_argv(FULL, 96)
    assert argv[1:3] == ["-m", "trainer.profile"]
    assert argv[argv.index("--task") + 1] == FULL.task
    assert json.loads(argv[argv.index("--task-args") + 1]) == FULL.task_args
    assert argv[argv.index("--batch") + 1] == "96" and argv[argv.index("--device") + 1] == "cpu"


def test_a_workload_of_the_users_own_code_is_measured_and_run_from_its_directory() -> None:
    from bench.paper.api_runs import run_body
    from bench.paper.paper_workloads import CHARLM, workdir_of

    argv = profile_argv(CHARLM, 64)
    assert argv[argv.index("--code-dir") + 1] == str(workdir_of(CHARLM))
    assert (workdir_of(CHARLM) / "charlm.py").is_file()
    body = run_body("diloco", CHARLM, [1, 2], 3, "t", "ab" * 32)
    assert body["bundle_sha256"] == "ab" * 32 and body["task"] == "charlm:task"
    # Its 1.1 MB gradient is sent in one piece, not the default's four.
    assert body["local_sgd"] == {"sync_every": 20} and body["compression"] == {"pipeline_chunks": 1}


def test_the_docs_section_has_a_subsection_per_workload_and_testbed_naming_task_and_target() -> None:
    parts = [{"workload": name, "results": {}, "settings": asdict(s), "testbed": {"name": tb, "description": "d"}}
             for tb in ("paper", "interc") for name, s in WORKLOADS.items()]
    doc = {"parts": parts, "machine": {"cpus": 2, "load_avg_at_end": [1.0]}}
    text = section(doc, [])
    heads = [line for line in text.splitlines() if line.startswith("### ")]
    assert heads == [f"### {w} on {tb}" for tb in ("paper", "interc") for w in ("widecnn", "resnet18", "charlm")]
    assert "`hybridtrain.tasks.digits:widecnn` with args `{\"lr\": 0.1, \"holdout\": 0.6}`" in text
    assert "target `accuracy>=0.95`" in text and "target `accuracy>=0.93`" in text


def test_a_results_document_from_before_workloads_is_its_own_single_part() -> None:
    doc = {"results": {}, "settings": asdict(FULL), "testbed": {"name": "paper", "description": "d"},
           "machine": {"cpus": 2, "load_avg_at_end": [1.0]}}  # fmt: skip
    assert "### hybridtrain.tasks.digits:widecnn on paper" in section(doc, [])


def test_a_full_run_covers_every_workload_on_both_testbeds_and_a_quick_one_the_first_on_the_first() -> None:
    full = argparse.Namespace(quick=False, workloads=None, config=None)
    assert [n for n, _ in workloads_of(full)] == ["widecnn", "resnet18", "charlm"]
    assert configs_of(full) == ["bench/testbeds/paper.yaml", "bench/testbeds/intercontinental.yaml"]
    quick_run = argparse.Namespace(quick=True, workloads=None, config=None)
    assert [(n, s) for n, s in workloads_of(quick_run)] == [("widecnn", QUICK)]
    assert configs_of(quick_run) == ["bench/testbeds/paper.yaml"]


def test_workloads_and_testbeds_can_be_chosen_and_overrides_apply_to_each() -> None:
    args = argparse.Namespace(quick=False, workloads="resnet18,widecnn", config="a.yaml,b.yaml", max_steps=7)
    assert [(n, s.max_steps) for n, s in workloads_of(args)] == [("resnet18", 7), ("widecnn", 7)]
    assert configs_of(args) == ["a.yaml", "b.yaml"]


def test_an_unknown_workload_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TestbedError, match="unknown workload vgg .*widecnn, resnet18"):
        workloads_of(argparse.Namespace(quick=False, workloads="vgg", config=None))


def test_settings_of_results_from_before_tasks_read_as_a_task_and_a_target() -> None:
    old = {"model": "widecnn", "dataset": "digits", "lr": 0.1, "target_accuracy": 0.95}
    assert workload(old) == ("hybridtrain.tasks.digits:widecnn", {"lr": 0.1}, "accuracy>=0.95")


def test_the_measured_rate_is_read_past_warnings_after_the_json_line() -> None:
    line = json.dumps({"params": 10, "batch": 96, "samples_per_s": 123.5, "step_s": 0.7})
    assert samples_per_s(f"starting\n{line}\nUserWarning: something at exit\n") == 123.5


def test_a_measurement_without_a_json_line_has_no_rate() -> None:
    assert samples_per_s("Traceback (most recent call last):\nValueError: bad task\n") is None


def test_a_strategy_with_plus_plain_runs_over_unencrypted_links() -> None:
    assert strategy_variant("ps-bz-gc") == ("ps-bz-gc", "")
    assert strategy_variant("ps-bz-gc+plain") == ("ps-bz-gc", "plain")
    body = variant_body({"name": "bench-ps-bz-gc", "encrypt_links": True}, "plain")
    assert body == {"name": "bench-ps-bz-gc-plain", "encrypt_links": False}


# A numbered variant `{prefix}N`: (entry, its strategy's body, the body it makes, its label, entries refused).
_NUMBERED_CASES = {
    "chunks": ("ps-bz-gc+chunks8", {"compression": {"pipeline_chunks": 4}}, {"compression": {"pipeline_chunks": 8}},
               "PS-bz-gc + 8 chunks", ("allreduce+chunks8", "ps-bz-gc+chunks0", "ps-bz-gc+chunksx")),
    "h": ("diloco-gc+h100", {"local_sgd": {"sync_every": 20, "outer_density": 0.05}},
          {"local_sgd": {"sync_every": 100, "outer_density": 0.05}}, "DiLoCo-gc, H = 100",
          ("ps-bz-gc+h100", "diloco+h0", "diloco+hx")),
    "density": ("diloco-gc+density5", {"local_sgd": {"sync_every": 20}},
                {"local_sgd": {"sync_every": 20, "outer_density": 0.05}}, "DiLoCo-gc, density 5 %",
                ("diloco+density5", "ps-bz-gc+density5", "diloco-gc+density0", "diloco-gc+density101")),
    "olr": ("diloco+olr150", {"local_sgd": {"sync_every": 20}}, {"local_sgd": {"sync_every": 20, "outer_lr": 1.5}},
            "DiLoCo, outer lr 1.5", ("ps-bz-gc+olr100", "allreduce+olr100", "diloco+olr0", "diloco+olr1001")),
    "mom": ("diloco-gc+mom50", {"local_sgd": {"sync_every": 20}},
            {"local_sgd": {"sync_every": 20, "outer_momentum": 0.5}}, "DiLoCo-gc, outer momentum 0.5",
            ("ps-bz-gc+mom50", "diloco+mom100", "diloco+momx")),
}  # fmt: skip


@pytest.mark.parametrize("prefix", list(_NUMBERED_CASES))
def test_a_numbered_variant_sets_its_one_setting_from_n(prefix: str) -> None:
    entry, body, expected, label, bad_entries = _NUMBERED_CASES[prefix]
    strategy, variant = strategy_variant(entry)
    assert variant_body({"name": f"bench-{strategy}"} | body, variant) == {"name": f"bench-{strategy}-{variant}"} | expected
    assert strategy_label(entry) == label
    for bad in bad_entries:
        with pytest.raises(TestbedError):
            strategy_variant(bad)


def test_variants_chain_each_applied_in_order() -> None:
    assert strategy_variant("diloco-gc+h100+density5") == ("diloco-gc", "h100+density5")
    body = variant_body({"name": "bench-diloco-gc", "local_sgd": {"sync_every": 20}}, "h100+density5")
    assert body == {"name": "bench-diloco-gc-h100-density5", "local_sgd": {"sync_every": 100, "outer_density": 0.05}}
    assert strategy_label("diloco-gc+h100+density5") == "DiLoCo-gc, H = 100, density 5 %"
    assert strategy_label("ps-bz-gc+sites+fp8") == "PS-bz-gc + per-site aggregation + fp8 values"
    # Each part is checked on its own: one refused part refuses the entry.
    with pytest.raises(TestbedError, match=r"\+h100 is for the local SGD"):
        strategy_variant("ps-bz-gc+fp8+h100")


def test_a_ps_strategy_with_plus_sites_combines_each_remote_sites_gradients_at_its_relay() -> None:
    assert strategy_variant("ps-gc+sites") == ("ps-gc", "sites")
    body = variant_body({"name": "bench-ps-gc", "compression": {"density": 0.05}}, "sites")
    assert body == {"name": "bench-ps-gc-sites", "compression": {"density": 0.05, "aggregate_at_sites": True}}


def test_the_removed_overlap_variant_is_refused() -> None:
    with pytest.raises(TestbedError, match="the variants are"):
        strategy_variant("ps-bz-gc+overlap")


def test_a_compressing_ps_strategy_with_plus_fp8_sends_its_values_as_fp8() -> None:
    assert strategy_variant("ps-bz-gc+fp8") == ("ps-bz-gc", "fp8")
    body = variant_body({"name": "bench-ps-bz-gc", "compression": {"density": 0.05}}, "fp8")
    assert body == {"name": "bench-ps-bz-gc-fp8", "compression": {"density": 0.05, "value_dtype": "fp8"}}
    assert strategy_label("ps-bz-gc+fp8") == "PS-bz-gc + fp8 values"


def test_fp8_for_a_strategy_that_sends_dense_gradients_is_refused() -> None:
    from testbed.errors import TestbedError

    with pytest.raises(TestbedError, match="PS strategies that compress"):
        strategy_variant("ps+fp8")


def test_a_local_sgd_strategy_with_plus_fp32_sends_exact_values_and_a_dense_ps_is_refused() -> None:
    from testbed.errors import TestbedError

    body = variant_body({"name": "bench-diloco", "local_sgd": {"site_replicas": True}}, "replicas+fp32")
    assert body["compression"] == {"value_dtype": "fp32"} and body["name"].endswith("-fp32")
    assert strategy_label("diloco+replicas+fp32") == "DiLoCo + replicas + fp32 values"
    with pytest.raises(TestbedError, match=r"\+fp32 is for the local SGD strategies"):
        strategy_variant("ps+fp32")


def test_a_variant_is_named_after_its_strategy_in_the_tables() -> None:
    assert strategy_label("ps-bz-gc") == "PS-bz-gc"
    assert strategy_label("ps-bz-gc+sites") == "PS-bz-gc + per-site aggregation"
    assert strategy_label("allreduce+plain") == "All-Reduce + unencrypted"


def test_a_ps_strategy_with_plus_inforward_applies_its_update_during_the_next_forward_pass() -> None:
    assert strategy_variant("ps-bz-gc+inforward") == ("ps-bz-gc", "inforward")
    body = variant_body({"name": "bench-ps-bz-gc", "compression": {"density": 0.05}}, "inforward")
    assert body == {"name": "bench-ps-bz-gc-inforward", "compression": {"density": 0.05, "apply_in_forward": True}}
    assert strategy_label("ps-bz-gc+inforward") == "PS-bz-gc + apply-in-forward"


def test_any_strategy_with_plus_quotaio_runs_with_the_thread_placer_paused() -> None:
    from pathlib import Path

    from testbed.state import TestbedState

    assert strategy_variant("allreduce+quotaio") == ("allreduce", "quotaio")
    assert variant_body({"name": "bench-allreduce"}, "quotaio") == {"name": "bench-allreduce-quotaio"}
    assert strategy_label("ps-bz-gc+quotaio") == "PS-bz-gc + threads on the quota"
    state = TestbedState(name="t", prefix="ht-t-", config_path="t.yaml", cgroup="/sys/fs/cgroup/cpu/ht-t",
                         services={"threads_on_quota_file": "/var/t/threads_on_quota"})
    assert placer_pause_file(state, "quotaio") == Path("/var/t/threads_on_quota")
    assert placer_pause_file(state, "sites") is None


def test_quotaio_on_a_testbed_without_the_thread_placer_is_refused_before_anything_is_built() -> None:
    from testbed.topology import load_config

    paper = load_config("bench/testbeds/paper.yaml")
    unplaced = paper.model_copy(update={"cpu": paper.cpu.model_copy(update={"threads_on_host": False})})
    check_strategies(("ps-bz-gc+quotaio", "ps-bz-gc"), [paper])
    check_strategies(("ps-bz-gc",), [unplaced])
    with pytest.raises(TestbedError, match="without the thread placer"):
        check_strategies(("ps-bz-gc", "allreduce+quotaio"), [paper, unplaced])


def test_an_unknown_strategy_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(TestbedError, match="unknown strategy 'dp'"):
        check_strategies(("dp",), [])


def test_an_unknown_variant_and_sites_or_inforward_for_all_reduce_are_refused() -> None:
    from testbed.errors import TestbedError

    with pytest.raises(TestbedError, match="the variants are"):
        strategy_variant("ps+fast")
    with pytest.raises(TestbedError, match="for the PS strategies"):
        strategy_variant("allreduce+sites")
    with pytest.raises(TestbedError, match="for the PS strategies"):
        strategy_variant("allreduce-powersgd+inforward")


# -- seeds -----------------------------------------------------------------------------------------


def _seed_summary(seed: int, sps: float, tta: float | None, status: str = "succeeded") -> dict[str, Any]:
    return {"seed": seed, "samples_per_s": sps, "tta_s": tta, "final_accuracy": 0.97, "step_s": 384 / sps,
            "status": status, "reason": None if status == "succeeded" else "lost", "steps": 50,
            "profile": {"worker_comm_s": 0.2 + seed / 10, "server_wait_s": None},
            "loss_curve": [(0.0, 1.0)], "accuracy_curve": [[5, 0.5]]}


def test_the_full_benchmark_runs_three_seeds_and_the_quick_one_one() -> None:
    assert seeds_of(FULL) == [0, 1, 2] and seeds_of(QUICK) == [0]
    assert seeds_of(with_overrides(FULL, argparse.Namespace(seeds=5))) == [0, 1, 2, 3, 4]


def test_each_seed_is_its_own_run() -> None:
    bodies = [run_body("ps", replace(FULL, seed=seed), [1, 2], 5, "x") for seed in seeds_of(FULL)]
    assert [b["seed"] for b in bodies] == [0, 1, 2]
    assert len({b["name"] for b in bodies}) == 3  # names are the runs' idempotency keys


def test_seeds_combine_into_means_with_their_spread() -> None:
    out = combine_seeds([_seed_summary(0, 220.0, 40.0), _seed_summary(1, 230.0, 50.0), _seed_summary(2, 240.0, 45.0)])
    assert out["samples_per_s"] == pytest.approx(230.0) and out["tta_s"] == pytest.approx(45.0)
    assert out["spread"]["samples_per_s"] == {"sd": pytest.approx(10.0), "min": 220.0, "max": 240.0}
    assert out["profile"] == {"worker_comm_s": pytest.approx(0.3), "server_wait_s": None}
    assert out["seeds"] == [0, 1, 2] and out["status"] == "succeeded"
    assert [r["seed"] for r in out["per_seed"]] == [0, 1, 2] and "loss_curve" not in out["per_seed"][0]


def test_a_seed_that_missed_the_target_leaves_the_mean_time_to_target_unknown() -> None:
    out = combine_seeds([_seed_summary(0, 220.0, 40.0), _seed_summary(1, 230.0, None)])
    assert out["tta_s"] is None and out["spread"]["tta_s"] is None
    assert out["samples_per_s"] == pytest.approx(225.0)


def test_a_failed_seed_fails_the_strategy_saying_how_many() -> None:
    out = combine_seeds([_seed_summary(0, 220.0, 40.0), _seed_summary(1, 230.0, 41.0, status="failed")])
    assert out["status"] == "failed (1 of 2 seeds)" and out["reason"] == "lost"


def test_the_table_shows_means_and_spread_over_several_seeds() -> None:
    bz = combine_seeds([_seed_summary(0, 220.0, 40.0), _seed_summary(1, 240.0, 50.0)])
    doc = {"results": {"ps-bz-gc": bz}, "ideal_samples_per_s": 300.0}
    assert "| 230.0 ± 14.1 | 1.00 | 45.0 ± 7.1 |" in markdown_table(doc)
    single = {"results": {"ps-bz-gc": combine_seeds([_seed_summary(0, 220.0, 40.0)])}, "ideal_samples_per_s": 300.0}
    assert "| 220.0 | 1.00 | 40.0 |" in markdown_table(single)


def test_off_the_paper_testbed_ps_bz_gc_must_reach_80_percent_of_ideal_and_beat_every_baseline() -> None:
    results = {"ps-bz-gc": {"samples_per_s": 90.0}, "ps": {"samples_per_s": 30.0},
               "allreduce": {"samples_per_s": 85.0}}  # fmt: skip
    targets = check_targets(results, 100.0, testbed="interc")
    assert set(targets) == {"share of ideal", "throughput vs the fastest baseline"}
    assert targets["share of ideal"] == {"value": 0.9, "goal": ">= 80%", "met": True}
    assert targets["throughput vs the fastest baseline"]["value"] == pytest.approx(90 / 85, abs=1e-3)
    slower = check_targets(results | {"allreduce": {"samples_per_s": 95.0}}, 100.0, testbed="interc")
    assert not slower["throughput vs the fastest baseline"]["met"]


def test_ps_bz_gcs_own_variants_are_not_baselines_off_the_paper_testbed() -> None:
    results = {"ps-bz-gc": {"samples_per_s": 90.0}, "ps-bz-gc+inforward": {"samples_per_s": 95.0},
               "allreduce-powersgd": {"samples_per_s": 85.0}, "allreduce+quotaio": {"samples_per_s": 80.0}}  # fmt: skip
    targets = check_targets(results, 100.0, testbed="interc")
    assert targets["throughput vs the fastest baseline"]["value"] == pytest.approx(90 / 85, abs=1e-3)


def test_results_are_written_into_a_folder_that_does_not_exist_yet_without_the_curves(tmp_path) -> None:
    doc = {"parts": [{"results": {"ps": {"samples_per_s": 1.0, "loss_curve": [[0.0, 1.0]]}}}]}
    out = tmp_path / "var" / "bench" / "results.json"
    write_results(doc, out)
    assert json.loads(out.read_text()) == {"parts": [{"results": {"ps": {"samples_per_s": 1.0}}}]}


@pytest.mark.parametrize("strategy", ["ps-bz-gc", "diloco"])
def test_the_run_configs_in_bench_hold_what_the_benchmark_runs(strategy) -> None:
    # `runs create --config bench/configs/widecnn-STRATEGY.yaml` is the benchmarked run, nothing hidden
    # (the global batch aside: the benchmark calibrates it to the host).
    import yaml

    from app.schemas.runs import RunCreate
    from bench.paper.api_runs import run_body

    path = Path(__file__).resolve().parents[2] / "bench" / "configs" / f"widecnn-{strategy}.yaml"
    config = yaml.safe_load(path.read_text())
    bench = run_body(strategy, FULL, [1], 9, "t")
    fields = {k: v for k, v in bench.items() if k not in ("name", "node_ids", "ps_node_id", "global_batch_size",
                                                           "seed", "device")}
    assert config == fields
    RunCreate.model_validate({**config, "name": "r", "node_ids": [1]})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_paper_workload_runs_each_strategys_defaults(strategy) -> None:
    # The benchmarked configuration is what a run launched with the defaults gets: the workload
    # sets none of what hybridtrain.strategy_defaults sets, but H (its runs are 50 steps long).
    from hybridtrain.strategy_defaults import defaults

    body = run_body(strategy, FULL, [1], 9, "t")
    given = {f"{section}.{name}" for section in ("compression", "local_sgd") for name in body.get(section, {})}
    given |= {"rebalance_every"} & body.keys()
    assert given & defaults(strategy).keys() <= {"local_sgd.sync_every"}


@pytest.mark.parametrize("workload", [*WORKLOADS, "quick"])
def test_every_workloads_run_is_a_valid_request_for_every_strategy(workload) -> None:
    from app.schemas.runs import RunCreate

    settings = QUICK if workload == "quick" else WORKLOADS[workload]
    for strategy in STRATEGIES:
        RunCreate.model_validate(run_body(strategy, settings, [1, 2], 3, "t") | {"name": "r"})


def test_local_sgd_targets_compare_with_the_ideal_ps_bz_gc_and_allreduce() -> None:
    results = {"ps-bz-gc": {"samples_per_s": 270.0, "tta_s": 40.0, "wan_bytes_per_sample": 4e4},
               "allreduce": {"samples_per_s": 130.0, "tta_s": 80.0, "wan_bytes_per_sample": 5e6},
               "diloco": {"samples_per_s": 298.0, "tta_s": 18.0, "wan_bytes_per_sample": 4e4},
               "diloco-gc": {"samples_per_s": 300.0, "tta_s": 25.0, "wan_bytes_per_sample": 1e4}}
    targets = check_targets(results, 310.0)
    assert targets["diloco share of ideal"] == {"value": 0.961, "goal": ">= 95%", "met": True}
    assert targets["diloco tta reduction vs ps-bz-gc"]["value"] == 0.55
    assert targets["diloco tta reduction vs allreduce"] == {"value": 0.775, "goal": ">= 60%", "met": True}
    assert targets["diloco WAN bytes a sample, allreduce's over its"] == {"value": 125.0, "goal": ">= 100x",
                                                                           "met": True}
    assert targets["diloco-gc WAN bytes a sample, allreduce's over its"]["met"] is False
    with_variant = check_targets({**results, "diloco+delay3": {"samples_per_s": 345.0}}, 359.0)
    assert with_variant["diloco+delay3 share of ideal"] == {"value": 0.961, "goal": ">= 95%", "met": True}
    replicas = check_targets({**results, "diloco+replicas": {"samples_per_s": 280.0, "tta_s": 15.0}}, 310.0)
    assert replicas["diloco+replicas tta over diloco's"] == {"value": 0.833, "goal": "< 1x", "met": True}
    assert "diloco+delay3 tta over diloco's" not in with_variant


def test_wan_bytes_count_only_what_crosses_between_sites_per_sample() -> None:
    records = [{"name": "loss", "rank": 1, "step": k, "t": float(k), "value": 1.0} for k in range(1, 5)]
    records += [{"name": "bytes_sent", "rank": r, "step": k, "t": float(k), "value": n, "peer": p}
                for k in range(1, 5) for r, p, n in ((1, 0, 1000.0), (2, 0, 5000.0), (0, 2, 3000.0))]
    figures = summarise(records, strategy="diloco", global_batch=10, skip_steps=1,
                        rank_node={0: "ps", 1: "a", 2: "b"}, egress_usd_per_gb=None,
                        site_of={"ps": "onprem", "a": "onprem", "b": "cloud"})
    # Steps 2-4: b's 5000 up and the server's 3000 down cross; a's 1000 stays on-prem.
    assert figures["wan_bytes_per_sample"] == 800.0


def test_a_delay_variant_overlaps_a_local_sgd_strategys_outer_exchange() -> None:
    from bench.paper.api_runs import run_body
    from testbed.errors import TestbedError
    from bench.paper.paper_workloads import strategy_variant, variant_body

    assert strategy_variant("diloco+delay3") == ("diloco", "delay3")
    body = variant_body(run_body("diloco", FULL, [1], 9, "t"), "delay0")
    assert "compression" not in body
    assert body["local_sgd"] == {"sync_every": 10, "outer_delay": 0}
    assert variant_body(run_body("diloco", FULL, [1], 9, "t"), "delay5")["local_sgd"]["outer_delay"] == 5
    with pytest.raises(TestbedError, match="local SGD"):
        strategy_variant("ps-bz-gc+delay3")


def test_an_async_variant_applies_a_local_sgd_strategys_outer_steps_as_they_arrive() -> None:
    from bench.paper.api_runs import run_body
    from bench.paper.paper_workloads import strategy_variant, variant_body
    from testbed.errors import TestbedError

    assert strategy_variant("diloco+async") == ("diloco", "async")
    body = variant_body(run_body("diloco", FULL, [1], 9, "t") | {"local_sgd": {"sync_every": 10, "outer_delay": 3}},
                        "async")
    assert body["local_sgd"] == {"sync_every": 10, "asynchronous": True} and body["name"].endswith("-async")
    with pytest.raises(TestbedError, match="local SGD"):
        strategy_variant("ps-bz-gc+async")


# ---------------------------------------------------------------------------------------------
# The bandwidth sweep (--wan-mbit).


def test_a_sweeps_testbed_has_every_wan_link_at_the_bandwidth_and_the_rest_unchanged() -> None:
    config = load_config("bench/testbeds/intercontinental.yaml")
    derived = at_bandwidth(config, 10)
    assert len(derived.wan) == 6 and {w.mbit for w in derived.wan} == {10}
    assert [w.between for w in derived.wan] == [w.between for w in config.wan]
    assert derived.description.endswith("; every WAN link at 10 Mbit/s (--wan-mbit)")
    assert derived.model_dump(exclude={"name", "wan", "description"}) == config.model_dump(
        exclude={"name", "wan", "description"})


def test_a_sweeps_testbed_is_named_after_its_bandwidth_within_ten_characters() -> None:
    paper, interc = load_config("bench/testbeds/paper.yaml"), load_config("bench/testbeds/intercontinental.yaml")
    assert [at_bandwidth(paper, m).name for m in (10, 1000, 2.5)] == ["paperw10", "paperw1000", "paperw2p5"]
    assert at_bandwidth(interc, 1000).name == "interw1000"


def test_a_sweep_writes_each_testbed_at_each_bandwidth_outside_the_checkout(tmp_path: Path) -> None:
    paths = ["bench/testbeds/paper.yaml", "bench/testbeds/intercontinental.yaml"]
    beds = sweep_testbeds(paths, [load_config(p) for p in paths], (10.0, 1000.0), tmp_path / "wan-sweep")
    assert [(b.config.name, b.base, b.wan_mbit) for b in beds] == [
        ("paperw10", "paper", 10.0), ("paperw1000", "paper", 1000.0),
        ("intercw10", "interc", 10.0), ("interw1000", "interc", 1000.0)]  # fmt: skip
    for bed in beds:
        assert Path(bed.path).parent == tmp_path / "wan-sweep" and load_config(bed.path) == bed.config


def test_without_a_sweep_the_testbeds_are_the_configs_as_written(tmp_path: Path) -> None:
    config = load_config("bench/testbeds/paper.yaml")
    beds = sweep_testbeds(["bench/testbeds/paper.yaml"], [config], None, tmp_path / "wan-sweep")
    assert [(b.path, b.config, b.base, b.wan_mbit) for b in beds] == [
        ("bench/testbeds/paper.yaml", config, "paper", None)]
    assert not (tmp_path / "wan-sweep").exists()


def test_testbeds_whose_sweep_names_collide_are_refused(tmp_path: Path) -> None:
    config = load_config("bench/testbeds/paper.yaml")
    twin = config.model_copy(update={"name": "paperx"})
    with pytest.raises(TestbedError, match="same derived names"):
        sweep_testbeds(["a.yaml", "b.yaml"], [config, twin], (1000.0,), tmp_path)


def _sweep_part(mbit: float, ideal: float, rates: dict[str, tuple[float, float | None]]) -> dict[str, Any]:
    return {"workload": "widecnn", "base_testbed": "paper", "wan_mbit": mbit, "ideal_samples_per_s": ideal,
            "testbed": {"name": f"paperw{mbit:g}", "description": "d"}, "settings": asdict(FULL),
            "results": {s: {"samples_per_s": sps, "tta_s": tta} for s, (sps, tta) in rates.items()}}  # fmt: skip


def _sweep_doc() -> dict[str, Any]:
    # At 10 Mbit/s diloco-gc wins both; at 1000, ps-bz-gc has the higher share and allreduce,
    # which no longer waits on the WAN, the faster target.
    return {"parts": [
        _sweep_part(1000, 300.0, {"ps-bz-gc": (285.0, 20.0), "diloco-gc": (270.0, 22.0), "allreduce": (240.0, 18.0)}),
        _sweep_part(10, 300.0, {"ps-bz-gc": (60.0, 90.0), "diloco-gc": (240.0, 30.0), "allreduce": (6.0, None)}),
    ], "machine": {"cpus": 2, "load_avg_at_end": [1.0]}}  # fmt: skip


def test_a_sweeps_part_is_titled_with_its_testbed_and_bandwidth() -> None:
    assert part_title(_sweep_part(10, 300.0, {})) == "widecnn on paper, WAN at 10 Mbit/s"


def test_the_sweep_table_has_a_row_per_strategy_with_share_and_time_to_target_by_rising_bandwidth() -> None:
    table = sweep_table(sweep_groups(_sweep_doc())[("widecnn", "paper")]).splitlines()
    assert table[0] == ("| strategy | share of ideal, 10 Mbit/s | time to target (s), 10 Mbit/s "
                        "| share of ideal, 1000 Mbit/s | time to target (s), 1000 Mbit/s |")
    assert table[2:] == ["| PS-bz-gc | 0.200 | 90.0 | 0.950 | 20.0 |", "| DiLoCo-gc | 0.800 | 30.0 | 0.900 | 22.0 |",
                         "| All-Reduce | 0.020 | n/a | 0.800 | 18.0 |"]  # fmt: skip


def test_the_winner_line_names_the_best_share_and_the_fastest_to_target_at_each_bandwidth() -> None:
    line = sweep_winners(sweep_groups(_sweep_doc())[("widecnn", "paper")])
    assert line == ("Best: at 10 Mbit/s, highest share of the ideal DiLoCo-gc (0.800), fastest to target "
                    "DiLoCo-gc (30.0 s); at 1000 Mbit/s, highest share of the ideal PS-bz-gc (0.950), "
                    "fastest to target All-Reduce (18.0 s).")


def test_the_docs_section_ends_with_the_sweep_and_a_run_without_one_has_none() -> None:
    text = section(_sweep_doc(), [])
    heads = [line for line in text.splitlines() if line.startswith("### ")]
    assert heads == ["### widecnn on paper, WAN at 1000 Mbit/s", "### widecnn on paper, WAN at 10 Mbit/s",
                     "### Bandwidth sweep: widecnn on paper"]  # fmt: skip
    assert "Best: at 10 Mbit/s" in text
    plain = {"parts": [{**_sweep_part(10, 300.0, {}), "wan_mbit": None}],
             "machine": {"cpus": 2, "load_avg_at_end": [1.0]}}
    assert "Bandwidth sweep" not in section(plain, []) and sweep_groups(plain) == {}


def test_the_sweep_chart_plots_share_of_ideal_and_time_to_target_on_a_log_bandwidth_axis_a_line_per_strategy() -> None:
    chart = figures(_sweep_doc())[-1]
    assert chart.layout.xaxis.type == chart.layout.xaxis2.type == "log"
    assert [(t.name, t.xaxis, list(t.x), list(t.y)) for t in chart.data] == [
        ("PS-bz-gc", "x", [10, 1000], [0.2, 0.95]), ("PS-bz-gc", "x2", [10, 1000], [90.0, 20.0]),
        ("DiLoCo-gc", "x", [10, 1000], [0.8, 0.9]), ("DiLoCo-gc", "x2", [10, 1000], [30.0, 22.0]),
        ("All-Reduce", "x", [10, 1000], [0.02, 0.8]), ("All-Reduce", "x2", [10, 1000], [None, 18.0])]  # fmt: skip


def test_a_strategy_keeps_its_colour_and_one_legend_entry_across_the_sweep_charts_panels() -> None:
    chart = figures(_sweep_doc())[-1]
    by_name: dict[str, set[str]] = {}
    for t in chart.data:
        by_name.setdefault(t.name, set()).add(t.line.color)
    assert all(len(colours) == 1 for colours in by_name.values()) and len(by_name) == 3
    assert [t.name for t in chart.data if t.showlegend] == ["PS-bz-gc", "DiLoCo-gc", "All-Reduce"]


def test_charts_go_to_the_named_folder_as_one_html_file_and_a_png_a_chart(tmp_path: Path) -> None:
    doc = _sweep_doc()
    written = write_charts(doc, tmp_path / "charts")
    names = [p.name for p in written]
    assert names[0] == "paper-bench.html" and "paper-sweep-widecnn-paper.png" in names
    assert len(names) == 1 + 2 * 3 + 1  # the HTML, three charts a part, the sweep's
    assert all(p.parent == tmp_path / "charts" and p.stat().st_size > 0 for p in written)
    assert (tmp_path / "charts" / "paper-sweep-widecnn-paper.png").read_bytes()[:4] == b"\x89PNG"


def test_every_local_sgd_run_of_the_quick_smoke_is_one_the_api_takes() -> None:
    from app.schemas.runs import RunCreate

    for entry in ("diloco", "diloco-gc", "diloco+replicas", "diloco+streaming"):
        strategy, variant = entry.partition("+")[::2]
        body = variant_body(run_body(strategy, QUICK, [1, 2, 3, 4], 9, "t"), variant)
        RunCreate.model_validate(body)
        assert body["local_sgd"].get("outer_delay", 0) < body["local_sgd"]["sync_every"] == 2


def test_a_replicas_variant_makes_each_site_one_replica_of_a_local_sgd_strategy() -> None:
    from hybridtrain.train_options import TrainOptions

    assert strategy_variant("diloco+replicas") == ("diloco", "replicas")
    body = variant_body(run_body("diloco", FULL, [1], 9, "t"), "replicas")
    assert body["name"].endswith("-replicas")
    # The workload's own local SGD settings stay: the variant differs from plain diloco in this only.
    assert body["local_sgd"] == {"sync_every": 10, "site_replicas": True}
    TrainOptions.model_validate({k: body[k] for k in ("strategy", "local_sgd", "compression") if k in body})
    with pytest.raises(TestbedError, match="local SGD"):
        strategy_variant("ps-bz-gc+replicas")


def test_a_streaming_variant_syncs_a_local_sgd_strategy_in_four_fragments() -> None:
    from hybridtrain.train_options import TrainOptions

    assert strategy_variant("diloco-gc+streaming") == ("diloco-gc", "streaming")
    body = variant_body(run_body("diloco", FULL, [1], 9, "t"), "streaming")
    assert body["name"].endswith("-streaming") and body["local_sgd"] == {"sync_every": 10, "fragments": 4}
    TrainOptions.model_validate({k: body[k] for k in ("strategy", "local_sgd", "compression") if k in body})
    with pytest.raises(TestbedError, match="local SGD"):
        strategy_variant("ps-bz-gc+streaming")
