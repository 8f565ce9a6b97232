"""The control plane's launch orders against the real trainer command line and the agent's
spec: every flag the agent will pass is one the trainer accepts, with the planned batch sizes,
the task (or script) and its target; the run's training options go from the request to the
trainer's TrainConfig as one typed JSON object, every option with its value."""

from __future__ import annotations

import pytest

from agents.spec import RoleSpec, trainer_argv
from app.models import Run, RunWorker
from app.lifecycle.orders import launch_orders
from app.schemas.runs import RunCreate
from hybridtrain.contract import is_ps
from trainer import cli as trainer_cli

SHA = "ab" * 32


def _token(rank: int) -> str:
    """Each rank's report token, as the control plane derives them."""
    return f"htr_{rank}.secret"


def _config(order):
    args = trainer_cli.build_parser().parse_args(trainer_argv(RoleSpec.model_validate(order.spec), command=[]))
    return args, trainer_cli.config_from_args(args)


def _run(strategy: str, compression: dict, local_sgd: dict | None = None) -> Run:
    ps = is_ps(strategy)
    workers = ([RunWorker(rank=0, role="ps", node_id=1, node_name="a")] if ps else []) + [
        RunWorker(rank=i + int(ps), role="worker", node_id=1 + i, node_name=f"n{i}", batch_size=b, gpu_index=0)
        for i, b in enumerate([30, 20, 14])
    ]
    return Run(
        id=7, name="r", strategy=strategy, task="hybridtrain.tasks.digits:smallcnn", task_args={"lr": 0.05},
        global_batch_size=64, max_steps=40, target="accuracy>=0.9", seed=3, allocation="flops",
        device="auto", compression=compression, local_sgd=local_sgd or {}, master_addr="10.0.0.1", master_port=29507, workers=workers,
    )


@pytest.mark.parametrize(
    ("strategy", "compression", "local_sgd"),
    [
        ("ps-bz-gc", {"compressor": "topk", "density": 0.02, "density_min": 0.01, "density_max": 0.05,
                      "value_dtype": "fp16", "server_k_fraction": 0.05, "error_feedback": False,
                      "warmup_steps": 2, "select": "threshold", "pipeline_chunks": 4,
                      "momentum_correction": False}, {}),
        ("ps", {}, {}),
        ("allreduce-powersgd", {"powersgd_rank": 4}, {}),
        ("diloco-gc", {}, {"sync_every": 10, "outer_lr": 0.5, "outer_momentum": 0.3, "outer_density": 0.05,
                           "outer_delay": 2}),
    ],
)
def test_every_launch_order_is_a_valid_trainer_command_line(strategy, compression, local_sgd):
    run = _run(strategy, compression, local_sgd)
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp:8000"):
        args, cfg = _config(order)
        role = trainer_cli._role_spec(args, cfg)

        assert (role.role, role.rank, role.world_size) == (order.spec["role"], order.rank, len(run.workers))
        assert cfg.batch_sizes == (30, 20, 14) and cfg.global_batch == 64
        assert cfg.strategy == strategy and cfg.max_steps == 40 and cfg.target == "accuracy>=0.9"
        assert cfg.task == "hybridtrain.tasks.digits:smallcnn" and cfg.task_args == '{"lr": 0.05}'
        assert cfg.report_url == "http://cp:8000/api/v1/runs/7/metrics"
        # The rank's own token travels in the order; the agent hands it to the trainer in a file.
        assert order.spec["report_token"] == _token(order.rank) and cfg.report_token is None
        if strategy == "ps-bz-gc":
            assert (cfg.density, cfg.error_feedback, cfg.server_k_fraction) == (0.02, False, 0.05)
            assert cfg.pipeline_chunks == 4 and cfg.momentum_correction is False
        if strategy == "allreduce-powersgd":
            assert cfg.powersgd_rank == 4
        if strategy == "diloco-gc":
            assert (cfg.sync_every, cfg.outer_lr, cfg.outer_momentum, cfg.outer_density, cfg.outer_delay) == (
                10, 0.5, 0.3, 0.05, 2)


# A value other than the default for every training option, and where TrainConfig keeps it
# (None: under the same name, with the same value).
EVERY_OPTION = {
    "task": ("hybridtrain.tasks.shapes:widecnn", None),
    "task_args": ({"lr": 0.02, "hidden": 8}, ("task_args", '{"hidden": 8, "lr": 0.02}')),
    "global_batch_size": (96, ("global_batch", 96)), "max_steps": (123, None),
    "target": ("val_loss<=0.5", None), "stop_at_target": (False, None), "seed": (7, None),
    "device": ("cpu", None), "eval_every": (9, None),
    "compression.compressor": ("randomk", None), "compression.value_dtype": ("fp8", None),
    "compression.select": ("sort", None), "compression.density": (0.03, None),
    "compression.density_min": (0.01, None), "compression.density_max": (0.04, None),
    "compression.server_k_fraction": (0.2, None), "compression.error_feedback": (False, None),
    "compression.momentum_correction": (False, None), "compression.warmup_steps": (2, None),
    "compression.pipeline_chunks": (3, None), "compression.powersgd_rank": (5, None),
    "compression.aggregate_at_sites": (True, ("site_aggregation", True)),
    "compression.apply_in_forward": (True, None),
    "rebalance_every": (3, None),
    "local_sgd.sync_every": (11, None), "local_sgd.outer_lr": (0.7, None), "local_sgd.outer_momentum": (0.4, None),
    "local_sgd.outer_density": (0.05, None), "local_sgd.outer_delay": (4, None),
    "local_sgd.site_replicas": (True, None), "local_sgd.fragments": (3, None),
    "local_sgd.asynchronous": (True, None), "local_sgd.max_staleness": (5, None),
}
# Asynchronous outer steps replace the fixed delay and keep off site replicas: a walk of their own
# (with streaming fragments, which they combine with).
_ASYNC = ["local_sgd.asynchronous", "local_sgd.max_staleness"]
_COMMON = [p for p in EVERY_OPTION if "." not in p and p != "rebalance_every"]
_CODEC = [f"compression.{n}" for n in ("compressor", "value_dtype", "select", "density", "density_min", "density_max",
                                       "server_k_fraction", "error_feedback", "momentum_correction", "warmup_steps")]
# No strategy takes every option: each walk sets those its strategy (the name before any "+")
# takes and that go together (hybridtrain.compat).
WALKS = {
    "diloco-gc": [*_COMMON, *_CODEC, "compression.pipeline_chunks", "rebalance_every",
                  *(p for p in EVERY_OPTION if p.startswith("local_sgd.") and p not in (*_ASYNC, "local_sgd.fragments"))],
    "diloco+async": [*_ASYNC, "local_sgd.sync_every", "local_sgd.fragments"],
    # Streaming goes without site replicas.
    "diloco+streaming": ["local_sgd.sync_every", "local_sgd.outer_delay", "local_sgd.fragments"],
    "ps-bz-gc": [*_COMMON, *_CODEC, "compression.pipeline_chunks", "compression.aggregate_at_sites",
                 "rebalance_every"],
    "ps-gc": ["compression.pipeline_chunks", "compression.apply_in_forward"],
    "allreduce-powersgd": [*_COMMON, "compression.powersgd_rank"],
}


def test_the_walks_below_cover_every_training_option():
    from hybridtrain.train_options import CompressionOptions, LocalSgdOptions, TrainOptions

    fields = {*TrainOptions.model_fields, *(f"compression.{f}" for f in CompressionOptions.model_fields),
              *(f"local_sgd.{f}" for f in LocalSgdOptions.model_fields)}
    # The sections themselves, the strategy (each walk's), the alternatives to max_steps and a
    # task (epochs, script: their own tests) and the allocation (the plan's split, which reaches
    # the trainer as its batch sizes; it re-splits them itself with rebalance_every) are not
    # walked here.
    walked = {p for paths in WALKS.values() for p in paths}
    assert fields - walked == {"compression", "local_sgd", "strategy", "epochs", "script", "allocation"}
    assert walked <= fields


@pytest.mark.parametrize("walk", WALKS)
def test_every_training_option_goes_from_the_request_to_the_trainers_config_with_its_value(walk):
    strategy = walk.partition("+")[0]
    body: dict = {"strategy": strategy}
    for path in WALKS[walk]:
        section, _, name = path.rpartition(".")
        (body.setdefault(section, {}) if section else body)[name] = EVERY_OPTION[path][0]
    request = RunCreate(name="r", node_ids=[1], **body)
    run = _run(strategy, request.compression.model_dump(exclude_none=True) if request.compression else {},
               request.local_sgd.model_dump(exclude_none=True) if request.local_sgd else {})
    for field in ("task", "task_args", "global_batch_size", "max_steps", "target", "stop_at_target", "seed",
                  "device", "eval_every", "rebalance_every"):
        setattr(run, field, getattr(request, field))
    for worker, size in zip((w for w in run.workers if w.role == "worker"), (40, 30, 26) if "global_batch_size"
                            in body else (30, 20, 14)):
        worker.batch_size = size
    sites = ["1", "1", "2", "2"][: len(run.workers)]
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", sites=sites):
        cfg = _config(order)[1].to_dict()
        for path in WALKS[walk]:
            value, kept = EVERY_OPTION[path]
            name, expected = kept or (path.rpartition(".")[2], value)
            assert cfg[name] == expected, path


def test_a_script_run_reaches_the_trainer_as_its_script():
    run = _run("ps-bz-gc", {})
    run.bundle_sha256, run.script = SHA, "train.py"
    assert all(_config(order)[1].script == "train.py"
               for order in launch_orders(run, metrics_token=_token, public_url="http://cp"))


def test_a_run_stored_with_the_removed_overlap_option_launches_without_it():
    run = _run("ps-bz-gc", {"overlap": True, "pipeline_chunks": 4})
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        assert order.spec["train_options"]["compression"] == {"pipeline_chunks": 4}
        assert _config(order)[1].pipeline_chunks == 4


@pytest.mark.parametrize("stop", [True, False])
def test_whether_a_run_stops_at_its_target_reaches_the_trainer(stop):
    run = _run("ps-gc", {})
    run.stop_at_target = stop
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        assert _config(order)[1].stop_at_target is stop


def test_rank_sites_become_the_trainers_relay_plan():
    run = _run("ps-bz-gc", {})
    sites = ["4", "4", "9", "9"]
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", sites=sites):
        assert _config(order)[1].sites == ("4", "4", "9", "9")


def test_a_run_of_site_replicas_gets_its_sites_even_within_one_site():
    # All its workers then make one replica; without sites the trainer could not tell.
    run = _run("diloco", {}, {"site_replicas": True})
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", sites=["4", "4", "4", "4"]):
        cfg = _config(order)[1]
        assert cfg.site_replicas and cfg.sites == ("4", "4", "4", "4")


def test_site_replicas_are_left_out_of_a_run_whose_sites_are_unknown():
    run = _run("diloco", {}, {"site_replicas": True, "sync_every": 5})
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", sites=["4", "", "4", "9"]):
        assert order.spec["train_options"]["local_sgd"] == {"sync_every": 5}
        assert not _config(order)[1].site_replicas


def test_an_all_reduce_run_gets_no_sites_even_across_sites():
    run = _run("allreduce", {})
    orders = launch_orders(run, metrics_token=_token, public_url="http://cp", sites=["4", "4", "9"])
    assert all("sites" not in o.spec["options"] for o in orders)


def test_a_run_given_in_epochs_hands_the_trainer_its_epochs():
    run = _run("ps-bz-gc", {})
    run.max_steps, run.epochs = None, 3
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        cfg = _config(order)[1]
        assert cfg.epochs == 3 and "max-steps" not in order.spec["options"]


def test_a_script_run_reaches_the_trainer_with_its_bundle_and_arguments():
    run = _run("ps-bz-gc", {})
    run.bundle_sha256, run.script, run.script_args = SHA, "train/main.py", ["--epochs", "3"]
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        spec = RoleSpec.model_validate(order.spec)
        cfg = _config(order)[1]
        assert cfg.script == "train/main.py" and cfg.script_args == ("--epochs", "3")
        assert (spec.bundle.sha256, spec.bundle.path) == (SHA, "/api/v1/runs/7/bundle")


def test_a_bundled_task_run_names_its_bundle_to_the_agent():
    run = _run("allreduce", {})
    run.bundle_sha256, run.task, run.task_args = SHA, "examples.diabetes:task", {"hidden": 32}
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        spec = RoleSpec.model_validate(order.spec)
        cfg = _config(order)[1]
        assert spec.bundle.sha256 == SHA and cfg.task == "examples.diabetes:task"
        assert cfg.task_args == '{"hidden": 32}'


def _lifecycle(run: Run, **fields) -> Run:
    defaults = {"checkpoint_every": 100, "checkpoint_every_s": 600.0, "max_restarts": 3, "restarts": 0,
                "min_workers": 2, "min_workers_wait_s": 300.0}
    for key, value in (defaults | fields).items():
        setattr(run, key, value)
    return run


def test_checkpoints_and_minimum_workers_reach_the_trainer():
    run = _lifecycle(_run("ps-bz-gc", {}))
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp:8000"):
        cfg = _config(order)[1]
        assert (cfg.checkpoint_every, cfg.checkpoint_every_s) == (100, 600.0)
        assert cfg.checkpoint_url == "http://cp:8000/api/v1/runs/7/checkpoint"
        assert (cfg.min_workers, cfg.min_workers_wait_s) == (2, 300.0)
        assert cfg.resume is False and cfg.join is False


def test_a_restarts_orders_resume_from_the_checkpoint_store():
    run = _lifecycle(_run("ps-bz-gc", {}), restarts=1)
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", resume=True):
        cfg = _config(order)[1]
        assert cfg.resume is True and cfg.checkpoint_url == "http://cp/api/v1/runs/7/checkpoint"
        assert order.spec["attempt"] == 1


def test_a_joining_workers_order_is_a_valid_trainer_command_line():
    run = _lifecycle(_run("ps-bz-gc", {}))
    order = launch_orders(run, metrics_token=_token, public_url="http://cp", ranks=[run.workers[2]], join=True,
                          batch_sizes=[30, 20, 14])[0]
    args, cfg = _config(order)
    assert cfg.join is True and order.rank == 2 and cfg.batch_sizes == (30, 20, 14)


def test_a_ps_run_hands_every_rank_the_speeds_its_batch_was_split_with():
    run = _run("ps-bz-gc", {})
    for worker, speed in zip(run.workers[1:], (3.0, 2.0, 1.4)):
        worker.speed = speed
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        assert _config(order)[1].speeds == (3.0, 2.0, 1.4)


def test_a_run_with_a_node_of_unknown_speed_gets_no_speeds():
    run = _run("ps-bz-gc", {})
    run.workers[1].speed = 3.0
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        assert _config(order)[1].speeds == ()


def test_a_run_with_checkpoints_off_gets_no_checkpoint_flags():
    run = _lifecycle(_run("allreduce", {}), checkpoint_every=0, checkpoint_every_s=0.0)
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp"):
        cfg = _config(order)[1]
        assert cfg.checkpoint_every == 0 and cfg.checkpoint_url is None
        assert "min-workers" not in order.spec["options"]  # all-reduce: no server to wait


def test_a_script_run_is_never_told_to_resume():
    run = _lifecycle(_run("ps-bz-gc", {}), restarts=1)
    run.bundle_sha256, run.script = SHA, "train.py"
    for order in launch_orders(run, metrics_token=_token, public_url="http://cp", resume=True):
        cfg = _config(order)[1]
        assert cfg.resume is False and cfg.checkpoint_url is None
