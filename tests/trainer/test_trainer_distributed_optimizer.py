"""DistributedOptimizer (trainer.distributed_optimizer) in a plain run, the script run as one
worker: each step is the wrapped optimizer's, logged, and moves the process's context."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import hybridtrain as ht
from trainer import loop


@pytest.fixture()
def plain_run(tmp_path) -> Iterator[str]:
    """A plain run's context (no launcher) writing its metrics to a file; forgotten after."""
    loop.reset_for_tests()
    path = str(tmp_path / "metrics.jsonl")
    ht.init(global_batch=8, max_steps=3, metrics_out=path)
    yield path
    loop.reset_for_tests()


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _train() -> None:
    """The plain loop of the user guide, to the run's end."""
    torch.manual_seed(0)
    model = ht.prepare_model(nn.Linear(4, 1))
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    for x, y in ht.data_loader(data):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(loss=loss)


def test_a_plain_runs_steps_are_the_wrapped_optimizers_each_logged_once(plain_run):
    _train()
    records = _records(plain_run)
    for name in ("loss", "batch_size", "samples_per_s", "compute_s", "data_s"):
        assert [r["step"] for r in records if r["name"] == name] == [1, 2, 3], name
    assert {r["value"] for r in records if r["name"] == "batch_size"} == {8.0}


def test_the_context_counts_the_steps_and_stops_at_the_runs_budget(plain_run):
    _train()
    ctx = ht.init()
    assert ctx.step == 3 and ctx.should_stop


def test_a_step_refuses_a_closure(plain_run):
    model = ht.prepare_model(nn.Linear(4, 1))
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


def test_the_wrapped_optimizers_attributes_show_through(plain_run):
    model = ht.prepare_model(nn.Linear(4, 1))
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert opt.param_groups[0]["lr"] == 0.1
