"""The control plane's launch orders against the real trainer command line: every flag the
agent will pass is one the trainer accepts, with the planned batch sizes; and the choices the
API validates are the trainer's own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agents.spec import RoleSpec, trainer_argv
from app.models import Run, RunWorker
from app.queries.runs import launch_orders
from app.schemas.runs import DATASET_TRAIN_SIZES, MODELS, STRATEGIES, RunCreate
from trainer import cli as trainer_cli
from trainer.config import STRATEGIES as TRAINER_STRATEGIES
from trainer.data import DATASETS, load_dataset
from trainer.models import MODELS as TRAINER_MODELS


def test_api_choices_are_the_trainers():
    assert STRATEGIES == TRAINER_STRATEGIES
    assert MODELS == TRAINER_MODELS
    assert tuple(DATASET_TRAIN_SIZES) == DATASETS


@pytest.mark.parametrize("name", DATASETS)
def test_epoch_arithmetic_uses_the_real_training_set_sizes(name):
    assert DATASET_TRAIN_SIZES[name] == len(load_dataset(name).x_train)


def _run(strategy: str, compression: dict) -> Run:
    ps = strategy.startswith("ps")
    workers = ([RunWorker(rank=0, role="ps", node_id=1, node_name="a")] if ps else []) + [
        RunWorker(rank=i + int(ps), role="worker", node_id=1 + i, node_name=f"n{i}", batch_size=b, gpu_index=0)
        for i, b in enumerate([30, 20, 14])
    ]
    return Run(
        id=7, name="r", strategy=strategy, model="smallcnn", dataset="digits", global_batch_size=64,
        lr=0.05, max_steps=40, target_accuracy=0.9, seed=3, allocation="flops", device="auto",
        compression=compression, master_addr="10.0.0.1", master_port=29507, workers=workers,
    )


@pytest.mark.parametrize(
    ("strategy", "compression"),
    [
        ("ps-bz-gc", {"compressor": "topk", "density": 0.02, "density_min": 0.01, "density_max": 0.05,
                      "value_dtype": "fp16", "server_k_fraction": 0.05, "error_feedback": False,
                      "warmup_steps": 2, "select": "threshold", "pipeline_chunks": 4,
                      "momentum_correction": False}),
        ("ps", {}),
        ("allreduce-powersgd", {"powersgd_rank": 4}),
    ],
)
def test_every_launch_order_is_a_valid_trainer_command_line(strategy, compression):
    run = _run(strategy, compression)
    for order in launch_orders(run, metrics_token="htr_secret", public_url="http://cp:8000"):
        argv = trainer_argv(RoleSpec.model_validate(order.spec), command=[])
        args = trainer_cli.build_parser().parse_args(argv)
        cfg = trainer_cli.config_from_args(args)
        role = trainer_cli._role_spec(args, cfg)

        assert (role.role, role.rank, role.world_size) == (order.spec["role"], order.rank, len(run.workers))
        assert cfg.batch_sizes == (30, 20, 14) and cfg.global_batch == 64
        assert cfg.strategy == strategy and cfg.max_steps == 40 and cfg.target_accuracy == 0.9
        assert cfg.report_url == "http://cp:8000/api/v1/runs/7/metrics" and cfg.report_token == "htr_secret"
        if strategy == "ps-bz-gc":
            assert (cfg.density, cfg.error_feedback, cfg.server_k_fraction) == (0.02, False, 0.05)
            assert cfg.pipeline_chunks == 4 and cfg.momentum_correction is False
        if strategy == "allreduce-powersgd":
            assert cfg.powersgd_rank == 4


def test_run_request_compression_fields_map_to_trainer_flags():
    body = RunCreate(name="r", node_ids=[1], compression={"density": 0.02, "error_feedback": True})
    run = _run("ps-bz-gc", body.compression.model_dump(exclude_none=True))
    spec = launch_orders(run, metrics_token="t", public_url="http://cp")[0].spec
    assert spec["options"]["density"] == 0.02 and spec["options"]["error-feedback"] is True
    assert SimpleNamespace(**spec).role == "ps"


@pytest.mark.parametrize("stop", [True, False])
def test_whether_a_run_stops_at_its_target_reaches_the_trainer(stop):
    run = _run("ps-gc", {})
    run.stop_at_target = stop
    for order in launch_orders(run, metrics_token="t", public_url="http://cp"):
        args = trainer_cli.build_parser().parse_args(trainer_argv(RoleSpec.model_validate(order.spec), command=[]))
        assert trainer_cli.config_from_args(args).stop_at_target is stop


def test_rank_sites_become_the_trainers_relay_plan():
    run = _run("ps-bz-gc", {})
    sites = ["4", "4", "9", "9"]
    for order in launch_orders(run, metrics_token="t", public_url="http://cp", sites=sites):
        args = trainer_cli.build_parser().parse_args(trainer_argv(RoleSpec.model_validate(order.spec), command=[]))
        assert trainer_cli.config_from_args(args).sites == ("4", "4", "9", "9")


def test_an_all_reduce_run_gets_no_sites_even_across_sites():
    run = _run("allreduce", {})
    orders = launch_orders(run, metrics_token="t", public_url="http://cp", sites=["4", "4", "9"])
    assert all("sites" not in o.spec["options"] for o in orders)
