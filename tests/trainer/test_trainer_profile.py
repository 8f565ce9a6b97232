"""`python -m trainer.profile` prints one JSON line describing a task on this node, or exits 1
with the reason on stderr and nothing on stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
KEYS = {"params", "dense_params", "buffer_numel", "matrix_shapes", "train_samples", "eval_samples", "batch", "samples_per_s",
        "step_s", "worker_compress_s", "server_compress_s", "aggregate_s", "dense_aggregate_s_per_element",
        "dense_encode_s_per_element", "powersgd_s", "powersgd_rank", "metrics", "worker_compress_s_per_kept",
        "server_compress_s_per_kept", "aggregate_s_per_kept", "aggregate_fixed_s", "worker_compress_density",
        "server_compress_k_fraction"}


def run_profile(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "trainer.profile", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def digits() -> subprocess.CompletedProcess:
    """One profile of the default task, shared by the tests that read it (each costs seconds)."""
    return run_profile("--task", "hybridtrain.tasks.digits:smallcnn", "--batch", "8", "--seconds", "0.3")


@pytest.fixture(scope="module")
def digits_result(digits) -> dict:
    assert digits.returncode == 0, digits.stderr
    return json.loads(digits.stdout)


def test_profile_prints_exactly_one_json_line(digits):
    assert digits.returncode == 0, digits.stderr
    lines = digits.stdout.splitlines()
    assert len(lines) == 1
    assert isinstance(json.loads(lines[0]), dict)


def test_profile_reports_the_documented_keys(digits_result):
    assert set(digits_result) == KEYS


def test_profile_counts_the_models_parameters(digits_result):
    assert isinstance(digits_result["params"], int) and digits_result["params"] > 0


def test_profile_reports_the_dense_part_and_the_compression_costs_on_this_node(digits_result):
    # smallcnn: its 1-D tensors and its small first convolution travel dense.
    assert 0 < digits_result["dense_params"] < digits_result["params"]
    assert digits_result["buffer_numel"] > 0  # BatchNorm statistics
    for key in ("worker_compress_s", "server_compress_s", "aggregate_s"):
        assert 0 < digits_result[key] < 5, key


def test_profile_reports_where_compression_was_timed_and_its_growth_per_element_kept(digits_result):
    assert digits_result["worker_compress_density"] == TrainConfig.density
    assert digits_result["server_compress_k_fraction"] == TrainConfig.server_k_fraction
    for key in ("worker_compress_s_per_kept", "server_compress_s_per_kept", "aggregate_s_per_kept"):
        assert 0 <= digits_result[key] < 1e-3, key
    assert 0 < digits_result["aggregate_fixed_s"] <= digits_result["aggregate_s"]


def test_profile_reports_dense_frame_costs_per_element(digits_result):
    # A full-size fp32 frame: well under a microsecond per element on any CPU, but not free.
    for key in ("dense_aggregate_s_per_element", "dense_encode_s_per_element"):
        assert 0 < digits_result[key] < 1e-6, key


def test_profile_reports_powersgd_work_at_the_trainers_default_rank(digits_result):
    from trainer.config import TrainConfig

    assert digits_result["powersgd_rank"] == TrainConfig.powersgd_rank
    assert 0 < digits_result["powersgd_s"] < 5
    # smallcnn's three convolutions and its head, as PowerSGD sees them (rows x the rest).
    assert digits_result["matrix_shapes"] == [[16, 9], [32, 144], [64, 288], [10, 256]]


def test_profile_reports_the_data_set_sizes_of_digits(digits_result):
    assert digits_result["train_samples"] == 1438
    assert digits_result["eval_samples"] == 1797 - 1438


def test_profile_measures_throughput_at_the_given_batch(digits_result):
    assert digits_result["batch"] == 8
    assert digits_result["samples_per_s"] > 0 and digits_result["step_s"] > 0
    assert digits_result["samples_per_s"] == pytest.approx(8 / digits_result["step_s"])


def test_profile_reports_the_metrics_and_their_directions(digits_result):
    assert digits_result["metrics"] == {"accuracy": True, "val_loss": False}


def test_a_missing_task_module_exits_1_with_the_reason_on_stderr():
    proc = run_profile("--task", "no_such_profile_module:task", "--seconds", "0")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "no module named 'no_such_profile_module'" in proc.stderr


def test_task_args_that_are_not_json_exit_1_with_the_reason_on_stderr():
    proc = run_profile("--task", "hybridtrain.tasks.digits:smallcnn", "--task-args", "{lr: 1}", "--seconds", "0")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert "task arguments are not valid JSON" in proc.stderr


def test_a_task_that_rejects_its_arguments_exits_1_with_its_message_on_stderr():
    proc = run_profile("--task", "hybridtrain.tasks.digits:smallcnn", "--task-args", '{"lr": -1}',
                       "--seconds", "0")
    assert (proc.returncode, proc.stdout) == (1, "")
    assert "ValueError: lr must be a number > 0, got -1" in proc.stderr


def test_a_batch_below_one_is_a_usage_error():
    proc = run_profile("--task", "hybridtrain.tasks.digits:smallcnn", "--batch", "0")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "--batch must be >= 1" in proc.stderr


def test_a_short_stream_is_profiled_without_a_sample_count(tmp_path):
    # 16 items are two batches of 8: profiling must read the stream again rather than fail
    # when it runs out before the measuring time is up.
    (tmp_path / "profstream.py").write_text(textwrap.dedent("""
        import torch
        import hybridtrain

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return ((torch.zeros(2), 0) for _ in range(16))

        def task():
            return hybridtrain.Task(model=lambda: torch.nn.Linear(2, 2), train_data=Stream(),
                                    loss=torch.nn.functional.cross_entropy,
                                    optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    """))
    proc = run_profile("--task", "profstream:task", "--batch", "8", "--seconds", "0.2", pythonpath=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (result["train_samples"], result["eval_samples"], result["params"]) == (None, None, 6)
