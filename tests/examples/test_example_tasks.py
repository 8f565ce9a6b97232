"""The examples' tasks: each builds, a plain-torch step lowers its loss, and the target each
README states is reached by the task's own training recipe in plain torch."""

from __future__ import annotations

import pytest
import torch
from examples_testing import scores, train_until

from hybridtrain.task import Task, TaskError, load_task


def one_step_lowers_the_loss(task: Task) -> None:
    torch.manual_seed(0)
    model = task.model()
    opt = task.optimizer(model)
    collate = task.collate or torch.utils.data.default_collate
    x, y = collate([task.train_data[i] for i in range(32)])
    before = task.loss(model(x), y)
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = task.loss(model(x), y)
    assert after < before


def test_diabetes_task_loads_by_reference(example):
    example("diabetes", "diabetes")
    task = load_task("diabetes:task", {"hidden": 32})
    assert task.metric_directions == {"mae": False, "val_loss": False}
    assert len(task.train_data) + len(task.eval_data) == 442


def test_diabetes_step_lowers_the_loss(example):
    one_step_lowers_the_loss(example("diabetes", "diabetes").task())


def test_diabetes_refuses_a_bad_hidden_width(example):
    example("diabetes", "diabetes")
    with pytest.raises(TaskError, match="hidden must be a positive integer, got 0"):
        load_task("diabetes:task", {"hidden": 0})


@pytest.mark.parametrize("seed", [0, 1])
def test_diabetes_reaches_its_readme_target(example, seed):
    task = example("diabetes", "diabetes").task()
    reached, seen = train_until(task, target=("val_loss", 0.55), batch=64, max_steps=200,
                                eval_every=5, seed=seed)
    assert reached is not None, seen


def test_charlm_task_loads_by_reference(example):
    example("charlm", "charlm")
    task = load_task("charlm:task", {})
    assert task.metric_directions == {"char_accuracy": True, "val_loss": False}
    assert 200_000 <= sum(p.numel() for p in task.model().parameters()) <= 500_000


def test_charlm_corpus_is_the_same_for_a_seed(example):
    charlm = example("charlm", "charlm")
    assert torch.equal(charlm.corpus(5000, seed=1), charlm.corpus(5000, seed=1))
    assert not torch.equal(charlm.corpus(5000, seed=1), charlm.corpus(5000, seed=2))


def test_charlm_model_is_causal(example):
    charlm = example("charlm", "charlm")
    torch.manual_seed(0)
    model = charlm.CharTransformer(16, 32, 1, 2).eval()
    x = torch.randint(0, len(charlm.ALPHABET), (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % len(charlm.ALPHABET)
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :10], model(y)[0, :10], atol=1e-5)


def test_charlm_step_lowers_the_loss(example):
    one_step_lowers_the_loss(example("charlm", "charlm").task())


def test_charlm_schedule_warms_up_then_decays(example):
    task = example("charlm", "charlm").task(lr=1e-3, warmup_steps=10)
    opt = task.optimizer(task.model())
    sched = task.schedule(opt, 100)
    rates = []
    for _ in range(100):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert rates[-1] == pytest.approx(1e-4, rel=1e-2)


def test_charlm_reaches_its_readme_target(example):
    task = example("charlm", "charlm").task()
    reached, seen = train_until(task, target=("val_loss", 0.9), batch=64, max_steps=200, eval_every=20)
    assert reached is not None, seen


def test_charlm_refuses_heads_that_do_not_divide_dim(example):
    example("charlm", "charlm")
    with pytest.raises(TaskError, match=r"dim \(100\) must be a multiple of heads \(3\)"):
        load_task("charlm:task", {"dim": 100, "heads": 3})


class FirstFeature(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0]


def test_reference_scores_average_metrics_over_samples(example):
    task = example("diabetes", "diabetes").task()
    x, y = task.eval_data.tensors
    got = scores(task, FirstFeature())
    assert got["mae"] == pytest.approx((x[:, 0] - y).abs().mean().item(), rel=1e-5)
    assert got["val_loss"] == pytest.approx(((x[:, 0] - y) ** 2).mean().item(), rel=1e-5)
