"""bench/predict.py's pure parts: errors, verdicts, settings, reducing runs, the table."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from bench import predict as bp


def test_error_pct_is_signed_share_of_the_measurement() -> None:
    assert bp.error_pct(110.0, 100.0) == 10.0
    assert bp.error_pct(85.0, 100.0) == -15.0


def test_error_pct_is_none_without_a_measurement() -> None:
    assert bp.error_pct(1.0, None) is None
    assert bp.error_pct(None, 1.0) is None
    assert bp.error_pct(1.0, 0.0) is None


@pytest.mark.parametrize(("err", "expected"), [(None, "-"), (0.0, "goal"), (-10.0, "goal"), (12.5, "bar"),
                                                (-15.0, "bar"), (15.1, "off")])  # fmt: skip
def test_verdict_classifies_against_goal_and_bar(err: float | None, expected: str) -> None:
    assert bp.verdict(err) == expected


def test_powersgd_runs_wait_for_the_start_step() -> None:
    assert bp.steps_for(bp.WIDECNN, "ps") == (bp.WIDECNN.max_steps, bp.WIDECNN.skip_steps)
    max_steps, skip = bp.steps_for(bp.WIDECNN, "allreduce-powersgd")
    assert skip == bp.WIDECNN.skip_steps + bp.POWERSGD_START
    assert max_steps - skip == bp.WIDECNN.max_steps - bp.WIDECNN.skip_steps


def test_local_sgd_runs_leave_out_their_first_round_and_measure_three_more() -> None:
    every = bp.WIDECNN.local_sgd["sync_every"]
    assert bp.steps_for(bp.WIDECNN, "diloco-gc") == ((bp.LOCAL_SGD_ROUNDS + 1) * every, every)
    assert bp.steps_for(bp.WIDECNN, "diloco+replicas") == bp.steps_for(bp.WIDECNN, "diloco")
    assert bp.run_body("diloco+replicas", bp.WIDECNN, [1, 2], 3, "x")["local_sgd"] == \
        {"sync_every": every, "site_replicas": True}


def test_run_body_compresses_only_the_compressing_strategies() -> None:
    settings = replace(bp.WIDECNN, compression={"density": 0.03}, pipeline_chunks=2, rebalance_every=3)
    ps = bp.run_body("ps", settings, [1, 2], 3, "x")
    gc = bp.run_body("ps-bz-gc", settings, [1, 2], 3, "x")
    ar = bp.run_body("allreduce", settings, [1, 2], 3, "x")
    assert ps["compression"] == {"pipeline_chunks": 2} and ps["ps_node_id"] == 3
    assert gc["compression"]["density"] == 0.03 and gc["rebalance_every"] == 3
    assert "compression" not in ar and "ps_node_id" not in ar
    # The widecnn workload leaves them to the strategies' defaults, as the paper benchmark does.
    assert "compression" not in bp.run_body("ps-bz-gc", bp.WIDECNN, [1, 2], 3, "x")


def test_plan_body_asks_for_the_steady_state() -> None:
    body = bp.run_body("ps-gc", bp.RESNET18, [1], 2, "r")
    plan = bp.plan_body(body)
    assert plan["max_steps"] > 1000 and plan["name"] != body["name"]
    assert {k: v for k, v in plan.items() if k not in ("max_steps", "name")} == \
        {k: v for k, v in body.items() if k not in ("max_steps", "name")}


def test_extract_predictions_reads_one_plan() -> None:
    assert bp.extract_predictions({"strategy": "ps", "prediction": {"samples_per_s": 3.0}}) == \
        {"ps": {"samples_per_s": 3.0}}


def test_extract_predictions_reads_every_strategys_plan() -> None:
    resp = {"plans": [{"strategy": "ps", "prediction": {"strategy": "ps", "samples_per_s": 1.0}},
                      {"strategy": "allreduce", "prediction": {"strategy": "allreduce", "samples_per_s": 2.0}}]}
    assert set(bp.extract_predictions(resp)) == {"ps", "allreduce"}
    assert bp.extract_predictions(resp["plans"])["allreduce"]["samples_per_s"] == 2.0


def test_extract_predictions_is_empty_without_a_prediction() -> None:
    assert bp.extract_predictions({"strategy": "ps", "workers": []}) == {}


def test_cross_site_bytes_counts_only_links_between_sites() -> None:
    site_of = {1: "onprem", 2: "onprem", 3: "cloud"}
    entries = [{"src_node_id": 1, "dst_node_id": 2, "bytes": 100},
               {"src_node_id": 3, "dst_node_id": 1, "bytes": 40}, (1, 3, 2), (9, 1, 1000)]
    assert bp.cross_site_bytes(entries, site_of) == 42


def _rec(name: str, rank: int, step: int, value: float, t: float = 0.0, peer: int | None = None) -> dict:
    return {"name": name, "rank": rank, "step": step, "value": value, "t": t, "peer": peer}


def _ps_run() -> list[dict]:
    """A PS run: rank 0 the server (site a), rank 1 in site a, rank 2 in site b; steps 2 s apart
    except step 2 (4 s) and step 4 (3 s)."""
    times = {1: 0.0, 2: 4.0, 3: 6.0, 4: 9.0, 5: 11.0, 6: 13.0}
    recs = [_rec("loss", 0, k, 1.0, t) for k, t in times.items()]
    for k in times:
        recs += [_rec("compute_s", r, k, 1.0) for r in (1, 2)]
        recs += [_rec("comm_s", r, k, 0.5) for r in (1, 2)]
        recs += [_rec("bytes_sent", 1, k, 10.0, peer=0), _rec("bytes_sent", 2, k, 30.0, peer=0),
                 _rec("bytes_sent", 0, k, 5.0, peer=1), _rec("bytes_sent", 0, k, 7.0, peer=2)]
    return recs


def test_measure_run_takes_the_median_of_the_steady_steps() -> None:
    m = bp.measure_run(_ps_run(), strategy="ps", global_batch=10, skip_steps=2, rank_site={0: "a", 1: "a", 2: "b"})
    # Steps 3..6 took 2, 3, 2, 2 s: median 2 s.
    assert m["steady_steps"] == 4 and m["step_s"] == 2.0 and m["samples_per_s"] == 5.0


def test_measure_run_counts_bytes_between_sites_per_step() -> None:
    m = bp.measure_run(_ps_run(), strategy="ps", global_batch=10, skip_steps=2, rank_site={0: "a", 1: "a", 2: "b"})
    assert m["egress_bytes_per_step"] == 37 and m["bytes_per_step"] == 52


def test_measure_run_reports_granularity_both_ways() -> None:
    m = bp.measure_run(_ps_run(), strategy="ps", global_batch=10, skip_steps=2, rank_site={})
    assert m["granularity_trainer"] == 2.0  # compute 1 s over the send's 0.5 s
    assert m["granularity_step"] == 1.0  # compute 1 s over the rest of a 2 s step


def test_measure_run_leaves_out_steps_after_an_evaluation() -> None:
    recs = _ps_run() + [_rec("accuracy", 0, 4, 0.5)]
    m = bp.measure_run(recs, strategy="ps", global_batch=10, skip_steps=2, rank_site={})
    assert m["steady_steps"] == 3


def _local_sgd_run() -> list[dict]:
    """A diloco run, H = 10: the server (rank 0, site a) records its outer steps only, 15, 12 and
    12 s apart after the first; rank 2 (site b) sends 3000 bytes across at each outer step and
    the server 600 back, rank 1 (site a) 100 bytes to rank 2 every inner step."""
    times = {10: 20.0, 20: 35.0, 30: 47.0, 40: 59.0}
    recs = [_rec("loss", 0, k, 1.0, t) for k, t in times.items()]
    for k in range(1, 41):
        recs += [_rec("compute_s", r, k, 1.0) for r in (1, 2)] + [_rec("bytes_sent", 1, k, 100.0, peer=2)]
    for k in times:
        recs += [_rec("bytes_sent", 2, k, 3000.0, peer=0), _rec("bytes_sent", 0, k, 600.0, peer=2)]
    return recs


def test_measure_run_times_local_sgd_by_whole_rounds_after_the_first() -> None:
    m = bp.measure_run(_local_sgd_run(), strategy="diloco", global_batch=12, skip_steps=10,
                       rank_site={0: "a", 1: "a", 2: "b"})
    # Rounds 11-20, 21-30, 31-40 took 1.5, 1.2 and 1.2 s a step: the median 1.2 s.
    assert m["steady_steps"] == 30 and m["step_s"] == 1.2 and m["samples_per_s"] == 10.0


def test_measure_run_spreads_local_sgds_outer_bytes_over_its_rounds_steps() -> None:
    m = bp.measure_run(_local_sgd_run(), strategy="diloco", global_batch=12, skip_steps=10,
                       rank_site={0: "a", 1: "a", 2: "b"})
    # Three outer steps of 3600 bytes across, and 100 every step, over 30 steps.
    assert m["egress_bytes_per_step"] == 460 and m["bytes_per_step"] == 460


def test_compare_gives_both_errors_and_the_worse_verdict() -> None:
    pred = {"samples_per_s": 5.5, "bytes_per_step": [{"src_node_id": 1, "dst_node_id": 2, "bytes": 120}]}
    meas = {"samples_per_s": 5.0, "egress_bytes_per_step": 100}
    cell = bp.compare(pred, meas, {1: "a", 2: "b"})
    assert cell["error_samples_pct"] == 10.0 and cell["error_egress_pct"] == 20.0 and cell["verdict"] == "off"


def test_tables_have_one_row_per_cell() -> None:
    cell = {"testbed": "paper", "task": "widecnn", "strategy": "ps", "predicted_samples_per_s": 10.0,
            "measured_samples_per_s": 9.0, "error_samples_pct": 11.1, "predicted_egress_bytes_per_step": 2e6,
            "measured_egress_bytes_per_step": 2e6, "error_egress_pct": 0.0, "verdict": "bar"}
    md = bp.markdown_table([cell]).splitlines()
    assert len(md) == 3 and "| paper | widecnn | ps | 10.0 | 9.0 | +11.1 | 2.00 | 2.00 | +0.0 | bar | - | - |" == md[2]
    assert len(bp.text_table([cell]).splitlines()) == 2


def test_summary_counts_each_error_apart() -> None:
    cells = [{"error_samples_pct": 3.0, "error_egress_pct": 20.0}, {"error_samples_pct": -12.0, "error_egress_pct": None}]
    assert bp.summary_counts(cells) == {"goal": 1, "bar": 1, "off": 1, "-": 1}


def test_replace_section_replaces_only_its_own_section() -> None:
    text = "# B\n\n## One\n\nold\n\n## Two\n\nkeep\n"
    out = bp.replace_section(text, "## One", "## One\n\nnew\n")
    assert out == "# B\n\n## One\n\nnew\n\n## Two\n\nkeep\n"


def test_replace_section_appends_a_missing_section() -> None:
    assert bp.replace_section("# B\n", "## New", "## New\n\nx\n") == "# B\n\n## New\n\nx\n"


def test_progress_estimates_time_left_from_the_runs_done() -> None:
    lines: list[str] = []
    p = bp.Progress(4, lines.append, per_run_s=60.0)
    assert p.left_s() == pytest.approx(240.0)
    p.say("paper widecnn ps", "running")
    assert "run 1/4" in lines[0] and "~4 min left" in lines[0] and "paper widecnn ps: running" in lines[0]


def test_progress_leaves_the_set_up_before_the_first_run_out_of_the_mean_run(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr(bp, "time", SimpleNamespace(monotonic=lambda: now[0]))
    p = bp.Progress(5, lambda _: None)
    now[0] = 300.0  # the testbed's start and link probes
    p.runs_begin()
    now[0], p.done = 400.0, 1  # one run of 100 s
    assert p.left_s() == pytest.approx(400.0)


def test_docs_section_holds_command_counts_and_table() -> None:
    cell = {"testbed": "paper", "task": "widecnn", "strategy": "ps", "error_samples_pct": 4.0, "error_egress_pct": 0.0}
    doc = {"cells": [cell], "command": "sudo .venv/bin/python bench/predict.py", "date": "2026-11-24T02:00Z",
           "machine": {"cpus": 2}, "duration_s": 600.0, "testbeds": {"paper": {"fallbacks": []}}}
    text = bp.docs_section(doc)
    assert text.startswith(bp.SECTION) and doc["command"] in text
    assert "within 10 %: 2 of 2" in text and "| paper | widecnn | ps |" in text


def _run(measured: float, err: float, egress_err: float = 0.0) -> dict:
    return {"testbed": "paper", "task": "widecnn", "strategy": "ps", "status": "succeeded",
            "predicted_samples_per_s": 100.0, "measured_samples_per_s": measured, "error_samples_pct": err,
            "predicted_egress_bytes_per_step": 1e6, "measured_egress_bytes_per_step": 1e6,
            "error_egress_pct": egress_err, "on_probe_links": {"error_samples_pct": err}}


def test_merge_repeats_takes_the_median_of_the_runs_own_errors() -> None:
    cell = bp.merge_repeats([_run(80.0, 25.0), _run(95.0, 5.3), _run(105.0, -4.8)])
    assert cell["error_samples_pct"] == 5.3 and cell["measured_samples_per_s"] == 95.0
    assert cell["verdict"] == "goal" and cell["on_probe_links"]["error_samples_pct"] == 5.3


def test_merge_repeats_keeps_every_run_and_lists_their_errors() -> None:
    cell = bp.merge_repeats([_run(80.0, 25.0), _run(95.0, 5.3), _run(105.0, -4.8)])
    assert [r["measured_samples_per_s"] for r in cell["runs"]] == [80.0, 95.0, 105.0]
    assert bp.run_errors(cell) == "+25.0 +5.3 -4.8"


def test_merge_repeats_names_a_failed_run_in_the_status() -> None:
    failed = _run(80.0, 25.0) | {"status": "failed", "measured_samples_per_s": None, "error_samples_pct": None}
    cell = bp.merge_repeats([failed, _run(95.0, 5.0)])
    assert cell["status"] == "failed,succeeded" and cell["error_samples_pct"] == 5.0


def test_a_single_run_is_its_own_cell() -> None:
    cell = bp.merge_repeats([_run(95.0, 5.0)])
    assert cell["error_samples_pct"] == 5.0 and bp.run_errors(cell) == "-"


def test_write_doc_makes_the_folder_and_stamps_the_counts(tmp_path):
    out = tmp_path / "var" / "bench" / "predict.json"
    doc = {"cells": [{"error_samples_pct": 3.0, "error_egress_pct": 12.0}]}
    bp.write_doc(doc, out, started=0.0)
    written = __import__("json").loads(out.read_text())
    assert written["counts"] == {"goal": 1, "bar": 1, "off": 0, "-": 0} and "date" in written


def _recorded_run(**cell) -> dict:
    """An --out JSON with one PS run of 16 samples on `w` (server `s`, one site each) that
    recorded its inputs."""
    profile = {"params": 1_000_000, "dense_params": 1000, "samples_per_s": 32.0, "worker_compress_s": 0.01,
               "server_compress_s": 0.01, "aggregate_s": 0.01}
    inputs = {"profiles": {"w": profile, "s": profile}, "batch_sizes": {"w": 16}, "server": "s",
              "sites": {"w": "cloud", "s": "onprem"}, "compression": {"pipeline_chunks": 2},
              "eval_every": 100_000, "window": [3, 12]}
    links = [{"src": "w", "dst": "s", "mbps": 100.0, "rtt_ms": 1.0}, {"src": "s", "dst": "w", "mbps": 100.0, "rtt_ms": 1.0}]
    base = {"testbed": "paper", "task": "widecnn", "strategy": "ps", "inputs": inputs, "prediction_source": "api",
            "predicted_samples_per_s": 1.0, "measured_samples_per_s": 4.0, "measured_step_s": 4.0,
            "measured_egress_bytes_per_step": 8_000_000}
    return {"cells": [base | cell], "testbeds": {"paper": {"links": links}}}


def test_repredict_predicts_each_recorded_run_again_with_the_model_as_it_is() -> None:
    from app.perfmodel.predict import CompressionSpec, LinkSpec, NodeSpec, TaskSpec, predict

    doc = bp.repredict(_recorded_run())
    cell = doc["cells"][0]
    profile = doc["cells"][0]["inputs"]["profiles"]["w"]
    s, w = NodeSpec.from_profile(1, "s", 2, profile), NodeSpec.from_profile(2, "w", 1, profile)
    link = LinkSpec(100.0, 1.0, "measured")
    expected = predict("ps", workers=[(w, 16)], server=s, links={(1, 2): link, (2, 1): link},
                       task=TaskSpec(1_000_000, 1000), compression=CompressionSpec(pipeline_chunks=2))
    assert cell["prediction_source"].startswith("repredicted")
    assert cell["predicted_samples_per_s"] == pytest.approx(16 / expected.step_s, rel=1e-3)
    assert cell["error_samples_pct"] == bp.error_pct(cell["predicted_samples_per_s"], 4.0)
    assert doc["counts"] == bp.summary_counts(doc["cells"])


def test_repredict_leaves_a_run_without_recorded_inputs_as_it_was() -> None:
    doc = bp.repredict(_recorded_run(inputs=None))
    assert doc["cells"][0]["predicted_samples_per_s"] == 1.0
    assert doc["cells"][0]["prediction_source"].startswith("not repredicted")


def test_repredict_predicts_each_of_a_cells_runs_and_merges_them_again() -> None:
    one = _recorded_run()["cells"][0]
    runs = [dict(one, measured_samples_per_s=m) for m in (2.0, 4.0, 8.0)]
    doc = _recorded_run() | {"cells": [bp.merge_repeats(runs)]}
    cell = bp.repredict(doc)["cells"][0]
    predicted = bp.repredict(_recorded_run())["cells"][0]["predicted_samples_per_s"]
    assert [r["error_samples_pct"] for r in cell["runs"]] == [bp.error_pct(predicted, m) for m in (2.0, 4.0, 8.0)]
    assert cell["error_samples_pct"] == round(bp.error_pct(predicted, 4.0), 1)


def test_run_body_of_a_variant_runs_its_strategy_with_the_variants_options() -> None:
    body = bp.run_body("diloco+replicas", bp.WIDECNN, [1, 2], 3, "x")
    assert body["strategy"] == "diloco" and body["ps_node_id"] == 3
    assert body["local_sgd"]["site_replicas"] is True
    assert "site_replicas" not in (bp.run_body("diloco", bp.WIDECNN, [1, 2], 3, "x").get("local_sgd") or {})


def test_repredict_of_diloco_with_sites_as_replicas_predicts_one_replica_per_site() -> None:
    from app.perfmodel.predict import LinkSpec, NodeSpec, TaskSpec, predict
    from app.queries.predictions import compression_spec
    from app.schemas.runs import LocalSgdOptions

    doc = _recorded_run(strategy="diloco+replicas")
    inputs = doc["cells"][0]["inputs"]
    profile = inputs["profiles"]["w"]
    inputs |= {"profiles": {"w": profile, "v": profile, "s": profile}, "batch_sizes": {"w": 16, "v": 16},
               "sites": {"w": "cloud", "v": "cloud", "s": "onprem"},
               "compression": {"sync_every": 10, "site_replicas": True}}
    doc["testbeds"]["paper"]["links"] = [{"src": a, "dst": b, "mbps": 100.0, "rtt_ms": 1.0}
                                         for a in "wvs" for b in "wvs" if a != b]
    cell = bp.repredict(doc)["cells"][0]
    s, v, w = (NodeSpec.from_profile(i, n, 1 if n == "s" else 2, profile) for i, n in ((1, "s"), (2, "v"), (3, "w")))
    link = LinkSpec(100.0, 1.0, "measured")
    spec = compression_spec("diloco", None, eval_every=100_000,
                            local_sgd=LocalSgdOptions(sync_every=10, site_replicas=True))
    expected = predict("diloco", workers=[(w, 16), (v, 16)], server=s, links=dict.fromkeys(
        [(a, b) for a in (1, 2, 3) for b in (1, 2, 3) if a != b], link), task=TaskSpec(1_000_000, 1000),
        compression=spec, max_steps=bp.STEADY_MAX_STEPS)
    assert cell["predicted_samples_per_s"] == pytest.approx(expected.samples_per_s, rel=1e-3)
    assert "site_exchange_s" in cell["prediction"]["breakdown"]
