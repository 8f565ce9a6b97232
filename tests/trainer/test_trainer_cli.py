"""End to end: real processes on 127.0.0.1 (the parameter server's TCP transport, gloo for
all-reduce), launched by the CLI."""

from __future__ import annotations

import json
import time

import pytest
from trainer_testing import DIGITS, read_metrics, replica_hashes, run_cli, series, with_replica_script

from hybridtrain.contract import STRATEGIES
from hybridtrain.option_flags import option_flags
from hybridtrain.strategy_defaults import defaults
from trainer.cli import UsageError, build_parser, config_from_args
from trainer.launch import free_port
from trainer_testing import ROOT

pytestmark = pytest.mark.e2e

FAST = DIGITS


@pytest.fixture(scope="module")
def gc_run(tmp_path_factory) -> tuple:
    """One 3-worker ps-bz-gc run whose workers print their final weights' hash, shared by several tests."""
    out = tmp_path_factory.mktemp("gc")
    proc = run_cli(*FAST, "--strategy", "ps-bz-gc", "--workers", "3", "--speeds", "1,0.6,0.3",
                   "--max-steps", "150", "--eval-every", "75", *with_replica_script(out),
                   "--metrics-out", str(out / "run.jsonl"))
    return proc, out


def test_cli_exits_zero_and_writes_wire_format_metrics(gc_run):
    proc, out = gc_run
    assert proc.returncode == 0, proc.stderr
    assert "done." in proc.stderr and "final accuracy" in proc.stderr
    records = read_metrics(out / "run.jsonl")
    assert {r["rank"] for r in records} == {0, 1, 2, 3}
    for r in records:
        # stream and seq make delivery exactly-once (trainer.metrics).
        assert set(r) - {"peer"} == {"rank", "role", "step", "t", "name", "value", "stream", "seq"}
        assert ("peer" in r) == r["name"].startswith("bytes_")
        assert r["role"] == ("ps" if r["rank"] == 0 else "worker")
    # The run starts from the split of --speeds (the default then re-splits it from measured times).
    assert series(records, "batch_size", 1)[1] == 25 and series(records, "batch_size", 3)[1] == 8
    # Every byte a worker sent to the server was received by it, step by step.
    sent = {(r["step"], r["rank"]): r["value"] for r in records if r["name"] == "bytes_sent" and r["rank"] > 0}
    recv = {(r["step"], r["peer"]): r["value"] for r in records if r["name"] == "bytes_recv" and r["rank"] == 0}
    assert sent == recv


def test_replicas_stay_identical_after_compressed_steps(gc_run):
    proc, out = gc_run
    assert proc.returncode == 0, proc.stderr
    hashes = replica_hashes(proc.stdout)
    assert sorted(hashes) == [1, 2, 3], proc.stdout + proc.stderr[-3000:]
    assert len({weights for weights, _ in hashes.values()}) == 1
    # The residuals differ per worker: identical replicas are not a trivial consequence.
    assert len({residual for _, residual in hashes.values()}) == 3


def test_ps_bz_gc_reaches_within_one_point_of_ps_accuracy(gc_run, tmp_path):
    proc, out = gc_run
    ps = run_cli(*FAST, "--strategy", "ps", "--workers", "3", "--max-steps", "150",
                 "--eval-every", "75", "--metrics-out", str(tmp_path / "ps.jsonl"))
    assert ps.returncode == 0, ps.stderr
    acc_ps = series(read_metrics(tmp_path / "ps.jsonl"), "accuracy")[150]
    acc_gc = series(read_metrics(out / "run.jsonl"), "accuracy")[150]
    assert acc_ps > 0.9
    assert acc_gc >= acc_ps - 0.01, (acc_gc, acc_ps)


def test_resume_from_a_checkpoint_continues_the_loss_curve(tmp_path):
    # A fixed density (min = max) makes the run deterministic, so the curves must coincide.
    args = [*FAST, "--strategy", "ps-gc", "--workers", "2", "--max-steps", "30", "--eval-every", "30",
            "--density", "0.01", "--density-min", "0.01", "--density-max", "0.01", "--checkpoint-every", "15",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    full = run_cli(*args, "--metrics-out", str(tmp_path / "full.jsonl"))
    assert full.returncode == 0, full.stderr
    (tmp_path / "ckpt" / "run-step-00000030.pt").unlink()
    resumed = run_cli(*args, "--resume", "--metrics-out", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 15" in resumed.stderr
    a = series(read_metrics(tmp_path / "full.jsonl"), "loss")
    b = series(read_metrics(tmp_path / "resumed.jsonl"), "loss")
    assert min(b) == 16 and max(b) == 30
    # The first resumed step sees the same weights and batch as the uninterrupted run's (the
    # loss is computed before any update); later steps differ a little, since the workers'
    # error-feedback residuals and velocities start empty (docs/elastic.md).
    assert b[16] == pytest.approx(a[16], rel=1e-5, abs=1e-6)
    assert b[16] < a[1] - 0.5  # continued from step 15, not restarted


def test_cli_exits_nonzero_promptly_when_an_allreduce_role_fails(tmp_path):
    t0 = time.monotonic()
    proc = run_cli(*FAST, "--strategy", "allreduce", "--workers", "2", "--max-steps", "50",
                   "--inject-failure", "1:5", "--timeout-s", "60")
    assert proc.returncode == 1
    # Whichever rank ends first (the failed one, or its peer aborted by gloo) stops the others.
    assert "exited with status" in proc.stderr and "stopping the other roles" in proc.stderr
    assert "injected failure at step 5" in proc.stderr
    assert time.monotonic() - t0 < 45  # not the 60 s peer timeout


def test_a_parameter_server_run_trains_on_when_a_worker_fails(tmp_path):
    proc = run_cli(*FAST, "--strategy", "ps-gc", "--workers", "2", "--max-steps", "30",
                   "--inject-failure", "2:5", "--timeout-s", "60", "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert "worker rank 2 exited with status 1; the others train on" in proc.stderr
    assert max(series(read_metrics(tmp_path / "m.jsonl"), "batch_size", rank=1)) == 30


def test_a_role_whose_peers_never_come_times_out_with_a_message():
    proc = run_cli("--strategy", "ps", "--role", "worker", "--rank", "1", "--world-size", "2",
                   "--master-port", str(free_port()), "--timeout-s", "3", timeout=60)
    assert proc.returncode == 1
    assert "[worker rank 1] failed" in proc.stderr and "cannot reach the parameter server" in proc.stderr


def test_usage_errors_exit_two_with_the_offending_option():
    proc = run_cli("--workers", "3", "--batch-sizes", "10,20")
    assert proc.returncode == 2 and "--batch-sizes" in proc.stderr


def test_a_negative_density_time_floor_is_a_usage_error():
    proc = run_cli("--density-time-floor", "-1")
    assert proc.returncode == 2 and "--density-time-floor" in proc.stderr


@pytest.mark.parametrize(("strategy", "chunks"), [("ps-bz-gc", "0"), ("ps-bz-gc", "65"), ("allreduce", "2")])
def test_pipeline_chunks_out_of_range_or_without_a_server_are_a_usage_error(strategy, chunks):
    proc = run_cli("--strategy", strategy, "--workers", "2", "--pipeline-chunks", chunks)
    assert proc.returncode == 2 and "--pipeline-chunks" in proc.stderr


def test_the_removed_overlap_flag_is_refused():
    proc = run_cli("--strategy", "ps-bz-gc", "--workers", "2", "--pipeline-chunks", "2", "--overlap")
    assert proc.returncode == 2 and "--overlap" in proc.stderr


# -- the training options as one JSON object (what an agent passes) -----------------------------------


def _config(*argv: str):
    parser = build_parser()
    return config_from_args(parser.parse_args(list(argv)), parser)


def test_every_training_option_is_one_flag_of_the_trainer():
    parser = build_parser()
    for path, flag in option_flags().items():
        actions = [a for a in parser._actions if flag.flag in a.option_strings]  # noqa: SLF001
        assert [a.dest for a in actions] == [flag.dest], path


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_run_that_names_no_option_gets_its_strategys_defaults(strategy):
    cfg = _config("--strategy", strategy)
    fields = {path.rpartition(".")[2]: value for path, value in defaults(strategy).items()}
    assert {name: getattr(cfg, name) for name in fields} == fields


def test_a_flag_given_at_the_trainers_own_default_is_kept_over_the_strategys():
    cfg = _config("--strategy", "ps-bz-gc", "--pipeline-chunks", "1", "--density", "0.01", "--warmup-steps", "5")
    assert (cfg.pipeline_chunks, cfg.density, cfg.warmup_steps) == (1, 0.01, 5)
    # A density given alone brings its band with it, not the default's bounds.
    assert cfg.densities[1:3] == pytest.approx((0.004, 0.02))


def test_a_strategy_that_re_splits_by_default_starts_from_the_given_split_and_refines_it():
    assert (_config("--strategy", "ps-bz-gc").allocation, _config("--strategy", "ps").allocation) == ("measured", "equal")
    assert _config("--strategy", "ps", "--rebalance-every", "3").allocation == "measured"
    assert _config("--strategy", "ps-bz-gc", "--allocation", "flops").allocation == "flops"


def test_options_json_makes_the_same_config_as_the_flags_it_stands_for():
    flags = _config("--strategy", "diloco-gc", "--global-batch", "48", "--max-steps", "77", "--seed", "5",
                    "--task-args", '{"lr": 0.1}', "--target", "accuracy>=0.8", "--no-stop-at-target",
                    "--eval-every", "7", "--device", "cpu", "--value-dtype", "fp8", "--pipeline-chunks", "2",
                    "--sync-every", "6", "--outer-lr", "0.8", "--outer-momentum", "0.5", "--outer-density", "0.2",
                    "--outer-delay", "2")
    options = {"strategy": "diloco-gc", "global_batch_size": 48, "max_steps": 77, "seed": 5,
               "task_args": {"lr": 0.1}, "target": "accuracy>=0.8", "stop_at_target": False, "eval_every": 7,
               "device": "cpu", "compression": {"value_dtype": "fp8", "pipeline_chunks": 2},
               "local_sgd": {"sync_every": 6, "outer_lr": 0.8, "outer_momentum": 0.5, "outer_density": 0.2,
                             "outer_delay": 2}}
    assert _config("--options-json", json.dumps(options)) == flags


def test_a_training_flag_beside_options_json_is_a_usage_error_naming_it():
    with pytest.raises(UsageError, match="--sync-every: --options-json carries"):
        _config("--options-json", '{"strategy": "diloco"}', "--sync-every", "4")


@pytest.mark.parametrize(("options", "says"), [
    ('{"strategy": "allreduce", "compression": {"pipeline_chunks": 2}}', "--options-json: compression.pipeline_chunks"),
    ('{"strategy": "diloco", "local_sgd": {"sync_every": 0}}', "--options-json: local_sgd.sync_every"),
    ('{"strategy": "ps", "compression": {"overlap": true}}', "--options-json: compression.overlap"),
    ("{not json", "--options-json"),
])
def test_options_json_that_names_an_impossible_run_is_a_usage_error_naming_the_field(options, says):
    with pytest.raises(UsageError, match=says):
        _config("--options-json", options)


def test_a_local_sgd_flag_out_of_range_is_a_usage_error_naming_the_flag():
    with pytest.raises(UsageError, match="--outer-lr"):
        _config("--strategy", "diloco", "--outer-lr", "11")


def test_a_run_applying_its_updates_in_the_forward_pass_keeps_the_replicas_identical_and_learns(tmp_path):
    # Relayed (the cloud site's second worker hears its relay), evaluated every 10 steps.
    proc = run_cli(*FAST, "--strategy", "ps-bz-gc", "--workers", "3", "--max-steps", "30", "--eval-every", "10",
                   "--pipeline-chunks", "3", "--apply-in-forward", "--dense-numel", "256",
                   "--sites", "onprem,onprem,cloud,cloud", *with_replica_script(tmp_path),
                   "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert "apply-in-forward needs" not in proc.stderr  # no worker fell back to applying at step()
    hashes = replica_hashes(proc.stdout)
    assert sorted(hashes) == [1, 2, 3] and len({w for w, _ in hashes.values()}) == 1
    assert series(read_metrics(tmp_path / "m.jsonl"), "accuracy")[30] > 0.5


def test_a_site_aggregated_run_sends_each_cloud_step_across_once_and_learns(tmp_path):
    proc = run_cli(*FAST, "--strategy", "ps-bz-gc", "--workers", "3", "--max-steps", "30",
                   "--eval-every", "30", "--sites", "onprem,onprem,cloud,cloud", "--aggregate-at-sites",
                   "--pipeline-chunks", "2", "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    links = {(r["rank"], r["peer"]) for r in records if r["name"] == "bytes_sent" and r["step"] == 10}
    # Worker 3 hands its gradient to worker 2, its site's relay, which sends the site's one
    # frame to the server and hands the server's update back to worker 3.
    assert links == {(0, 1), (0, 2), (1, 0), (2, 0), (2, 3), (3, 2)}
    assert series(records, "accuracy")[30] > 0.5
    assert series(records, "batch_size", 0)[10] == 48  # the server counts the whole batch


def test_site_aggregation_needs_sites():
    proc = run_cli("--strategy", "ps-bz-gc", "--workers", "2", "--aggregate-at-sites")
    assert proc.returncode == 2 and "--aggregate-at-sites" in proc.stderr


def test_sites_for_a_strategy_without_a_server_are_a_usage_error():
    proc = run_cli("--strategy", "allreduce", "--workers", "2", "--sites", "a,a")
    assert proc.returncode == 2 and "--sites" in proc.stderr


def test_a_relayed_run_forwards_each_update_inside_the_remote_site(tmp_path):
    proc = run_cli(*FAST, "--strategy", "ps-bz-gc", "--workers", "3", "--max-steps", "30",
                   "--eval-every", "30", "--sites", "onprem,onprem,cloud,cloud",
                   "--link-mbps", "1000,100,100", "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    links = {(r["rank"], r["peer"]) for r in records if r["name"] == "bytes_sent" and r["step"] == 10}
    # The server's update of step 10 went to ranks 1 and 2; rank 2 handed it on to rank 3.
    assert links == {(0, 1), (0, 2), (1, 0), (2, 0), (2, 3), (3, 0)}
    assert series(records, "accuracy")[30] > 0.5


def test_a_pipelined_relayed_run_sends_each_chunk_and_keeps_the_replicas_identical(tmp_path):
    proc = run_cli(*FAST, "--strategy", "ps-bz-gc", "--workers", "3", "--max-steps", "30",
                   "--eval-every", "30", "--sites", "onprem,onprem,cloud,cloud", "--pipeline-chunks", "4",
                   *with_replica_script(tmp_path), "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    sent = {(r["rank"], r["peer"]): r["value"] for r in records if r["name"] == "bytes_sent" and r["step"] == 10}
    recv = {(r["peer"], r["rank"]): r["value"] for r in records if r["name"] == "bytes_recv" and r["step"] == 10}
    assert set(sent) == {(0, 1), (0, 2), (1, 0), (2, 0), (2, 3), (3, 0)} and sent == recv
    # The relay forwarded exactly what it received from the server: four chunk frames.
    assert sent[(2, 3)] == sent[(0, 2)]
    hashes = replica_hashes(proc.stdout)
    assert sorted(hashes) == [1, 2, 3] and len({w for w, _ in hashes.values()}) == 1
    assert series(records, "accuracy")[30] > 0.5


def _target_run(out, strategy: str, *, stop: bool) -> list[dict]:
    """The records of a 2-worker run of `strategy`, evaluated every 5 of its 30 steps, given a
    target it reaches early, told to stop there or not."""
    proc = run_cli(*FAST, "--strategy", strategy, "--workers", "2", "--max-steps", "30", "--eval-every", "5",
                   "--target-accuracy", "0.3", "--stop-at-target" if stop else "--no-stop-at-target",
                   "--metrics-out", str(out / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    return read_metrics(out / "m.jsonl")


@pytest.fixture(scope="module")
def trained_on(tmp_path_factory):
    """strategy -> the records of its run not told to stop at its target (`_target_run`),
    each made once for the tests that read it."""
    made: dict[str, list[dict]] = {}

    def records(strategy: str) -> list[dict]:
        if strategy not in made:
            made[strategy] = _target_run(tmp_path_factory.mktemp(strategy), strategy, stop=False)
        return made[strategy]

    return records


@pytest.mark.parametrize("strategy", ["ps-gc", "allreduce"])
def test_a_run_records_its_time_to_target_and_stops_there_if_asked(strategy, tmp_path):
    records = _target_run(tmp_path, strategy, stop=True)
    reached = series(records, "time_to_target_s")
    assert len(reached) == 1
    (step,) = reached
    assert max(series(records, "loss", 1)) == step < 30


@pytest.mark.parametrize("strategy", ["ps-gc", "allreduce"])
def test_a_run_records_its_time_to_target_and_trains_on_if_not_asked_to_stop(strategy, trained_on):
    records = trained_on(strategy)
    assert len(series(records, "time_to_target_s")) == 1
    assert max(series(records, "loss", 1)) == 30


@pytest.mark.parametrize("strategy", ["ps-gc", "allreduce"])
def test_each_evaluation_records_how_long_it_held_the_run_up(strategy, trained_on):
    records = trained_on(strategy)
    spans = series(records, "eval_s")
    assert sorted(spans) == sorted(series(records, "accuracy")) == [5, 10, 15, 20, 25, 30]
    # Scoring 360 digits takes a moment, far less than the run.
    assert all(0 < v < 30 for v in spans.values())


@pytest.mark.parametrize("strategy", ["allreduce", "allreduce-powersgd"])
def test_peer_baselines_train_and_count_bytes(strategy, tmp_path):
    proc = run_cli(*FAST, "--strategy", strategy, "--workers", "2", "--max-steps", "40",
                   "--eval-every", "40", "--powersgd-start", "10", "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    assert series(records, "accuracy")[40] > 0.8
    sent = series(records, "bytes_sent")
    if strategy == "allreduce-powersgd":
        assert sent[20] < sent[5] / 3  # PowerSGD took over from plain all-reduce at step 10
    else:
        assert sent[20] == sent[5]
    # The all-reduces' span is the communication the bill's granularity divides by.
    comm = series(records, "comm_s")
    assert len(comm) == 40 and all(v > 0 for v in comm.values())


def test_a_ps_workers_communication_is_the_step_it_did_not_spend_computing_or_compressing(gc_run):
    proc, out = gc_run
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(out / "run.jsonl")
    for rank in (1, 2, 3):
        comm, wait = series(records, "comm_s", rank), series(records, "wait_s", rank)
        compute, rate, size = (series(records, n, rank) for n in ("compute_s", "samples_per_s", "batch_size"))
        compress = series(records, "compress_s", rank)
        for step in (20, 100):
            assert comm[step] >= wait[step]
            step_s = size[step] / rate[step]
            assert compute[step] + compress[step] + comm[step] == pytest.approx(step_s, rel=0.02)


def test_epochs_become_steps_from_the_tasks_training_set(tmp_path):
    proc = run_cli(*FAST, "--strategy", "ps", "--workers", "2", "--epochs", "1", "--eval-every", "100",
                   "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(tmp_path / "m.jsonl")
    # 1,438 training digits at a global batch of 48: 30 steps, the last one straddling the epoch.
    assert series(records, "max_steps") == {0: 30.0}
    assert max(series(records, "loss")) == 30
    assert series(records, "params")[0] > 20_000


def test_a_task_that_cannot_be_imported_fails_within_seconds_naming_the_module(tmp_path):
    t0 = time.monotonic()
    proc = run_cli("--task", "nowhere.to_be_found:task", "--workers", "2", "--max-steps", "5")
    assert proc.returncode == 1
    assert "no module named 'nowhere'" in proc.stderr
    assert time.monotonic() - t0 < 60


def _module(tmp_path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)


def test_a_task_that_raises_fails_with_its_traceback(tmp_path):
    _module(tmp_path, "boom", "def task():\n    return 1 / 0\n")
    proc = run_cli("--task", "boom:task", "--workers", "2", "--max-steps", "5", cwd=tmp_path)
    assert proc.returncode == 1
    assert "task boom:task raised ZeroDivisionError" in proc.stderr and 'boom.py", line 2' in proc.stderr


def test_a_task_returning_something_else_fails_saying_what_it_returned(tmp_path):
    _module(tmp_path, "wrong", "def task():\n    return {'model': None}\n")
    proc = run_cli("--task", "wrong:task", "--workers", "2", "--max-steps", "5", cwd=tmp_path)
    assert proc.returncode == 1 and "returned dict, not a hybridtrain.Task" in proc.stderr


def test_a_target_on_a_metric_the_task_does_not_report_fails_listing_its_metrics():
    proc = run_cli(*FAST, "--workers", "2", "--max-steps", "5", "--target", "f1>=0.5")
    assert proc.returncode == 1 and "reports no metric 'f1'" in proc.stderr and "accuracy" in proc.stderr


@pytest.mark.parametrize(("flag", "value"), [("--task-args", "{not json"), ("--task", "no_colon"),
                                             ("--target", "accuracy=0.9")])
def test_bad_task_options_are_usage_errors(flag, value):
    proc = run_cli(flag, value)
    assert proc.returncode == 2 and flag in proc.stderr


OWN_LOOP = """
import hybridtrain as ht
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

ctx = ht.init(global_batch=32)
g = torch.Generator().manual_seed(0)
x = torch.randn(512, 8, generator=g)
y = (x @ torch.randn(8, 3, generator=g)).argmax(1)
train, test = TensorDataset(x[:400], y[:400]), TensorDataset(x[400:], y[400:])
model = ht.prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3)))
opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), model)
for epoch in range(int(__import__("sys").argv[1])):
    for xb, yb in ht.data_loader(train):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step(loss=loss)
    ht.evaluate(model, test, metrics=[ht.accuracy()], loss=F.cross_entropy)
    if ctx.should_stop:
        break
print(f"worker {ctx.worker} of {ctx.workers} done at step {ctx.step}", flush=True)
"""


@pytest.mark.parametrize("strategy", ["ps-bz-gc", "allreduce"])
def test_launch_runs_a_plain_loop_script_on_every_worker_to_its_target(strategy, tmp_path):
    (tmp_path / "train.py").write_text(OWN_LOOP)
    proc = run_cli("--strategy", strategy, "--workers", "2", "--target", "accuracy>=0.8",
                   "--metrics-out", str(tmp_path / "m.jsonl"), "train.py", "20", command="launch", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "worker 0 of 2 done" in proc.stdout and "worker 1 of 2 done" in proc.stdout
    records = read_metrics(tmp_path / "m.jsonl")
    assert len(series(records, "time_to_target_s")) == 1
    assert max(series(records, "accuracy").values()) >= 0.8


UNTIL_STOP = """
import hybridtrain as ht
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

ctx = ht.init(global_batch=32)
g = torch.Generator().manual_seed(0)
x = torch.randn(256, 8, generator=g)
train = TensorDataset(x, (x @ torch.randn(8, 3, generator=g)).argmax(1))
model = ht.prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 3)))
opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2), model)
while not ctx.should_stop:
    for xb, yb in ht.data_loader(train):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
print(f"worker {ctx.worker} stopped at step {ctx.step}", flush=True)
"""


def test_a_loop_until_should_stop_ends_at_max_steps(tmp_path):
    (tmp_path / "train.py").write_text(UNTIL_STOP)
    proc = run_cli("--strategy", "ps-gc", "--workers", "2", "--max-steps", "6", "train.py", command="launch",
                   cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "worker 0 stopped at step 6" in proc.stdout and "worker 1 stopped at step 6" in proc.stdout


def test_a_checkpoint_due_at_the_last_step_of_a_script_without_evaluation_is_written(tmp_path):
    # No evaluation between the last step and the goodbye: the donor's BYE comes before its state.
    (tmp_path / "train.py").write_text(UNTIL_STOP)
    proc = run_cli("--strategy", "ps-gc", "--workers", "2", "--max-steps", "6", "--checkpoint-every", "3",
                   "--checkpoint-dir", str(tmp_path / "ck"), "train.py", command="launch", cwd=tmp_path, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["run-step-00000003.pt", "run-step-00000006.pt"]


def test_the_same_script_run_plainly_trains_as_one_worker(tmp_path):
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(OWN_LOOP)
    proc = subprocess.run([sys.executable, "train.py", "2"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "worker 0 of 1 done at step 24" in proc.stdout  # 2 epochs of 400 // 32 steps


def test_a_users_own_trainer_and_hybridtrain_packages_do_not_replace_the_trainers(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    for name in ("trainer", "hybridtrain"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user\\'s own {name}')\n")
    _module(tmp_path, "mytask", "from hybridtrain.tasks.digits import smallcnn as task\n")
    command = Path(sys.executable).parent / "hybridtrain"
    proc = subprocess.run([str(command), "train", "--task", "mytask:task", "--workers", "2", "--max-steps", "3",
                           "--threads", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "3 steps" in proc.stderr


def test_the_role_a_command_line_runs_is_read_from_its_own_flags_only():
    from trainer.cli import role_in

    assert role_in(["--strategy", "ps", "--role", "ps", "--rank", "0"]) == "ps"
    assert role_in(["--role=worker"]) == "worker"
    assert role_in(["--strategy", "ps", "--workers", "2"]) is None
    # A user's script arguments are theirs, whatever they say.
    assert role_in(["--role", "worker", "--", "--role", "ps"]) == "worker"


EXITS = OWN_LOOP + """
import atexit, pathlib, threading, time

def late_write():
    time.sleep(0.5)
    pathlib.Path(f"thread-{ctx.worker}").write_text("done")

threading.Thread(target=late_write).start()
atexit.register(lambda: pathlib.Path(f"atexit-{ctx.worker}").write_text("done"))
"""


def test_a_workers_exit_still_waits_for_the_scripts_threads_and_runs_its_atexit_handlers(tmp_path):
    (tmp_path / "train.py").write_text(EXITS)
    proc = run_cli("--strategy", "ps", "--workers", "2", "train.py", "1", command="launch", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.glob("thread-*")) == ["thread-0", "thread-1"]
    assert sorted(p.name for p in tmp_path.glob("atexit-*")) == ["atexit-0", "atexit-1"]


def test_the_report_token_can_come_from_a_file_not_the_command_line(tmp_path):
    token = tmp_path / "report-token"
    token.write_text("run-secret\n")
    args = build_parser().parse_args(["--report-token-file", str(token)])
    assert config_from_args(args).report_token == "run-secret"


def test_a_missing_report_token_file_is_a_usage_error_naming_it(tmp_path):
    args = build_parser().parse_args(["--report-token-file", str(tmp_path / "nope")])
    with pytest.raises(UsageError, match="--report-token-file .*nope"):
        config_from_args(args)


@pytest.mark.parametrize("argv", [["--strategy", "ps", "--workers", "2", "--expect-ranks", "1,3"],
                                  ["--strategy", "ps", "--workers", "2", "--expect-ranks", "0"],
                                  ["--strategy", "allreduce", "--workers", "2", "--expect-ranks", "1"]])
def test_expected_ranks_must_be_worker_ranks_of_a_parameter_server_run(argv):
    with pytest.raises(UsageError, match="--expect-ranks"):
        config_from_args(build_parser().parse_args(argv))


def test_the_expected_ranks_are_kept_sorted_once_each():
    args = build_parser().parse_args(["--strategy", "ps", "--workers", "4", "--expect-ranks", "4,1,4"])
    assert config_from_args(args).expect_ranks == (1, 4)
