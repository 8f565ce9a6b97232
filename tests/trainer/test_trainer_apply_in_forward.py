"""Apply-in-forward: a worker's step() applies the update's first chunk and returns; the later
chunks are applied by forward pre-hooks just before the layers that hold them run. What is
learned is exactly what applying the whole update at step() learns."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from trainer_testing import run_in_process

from trainer.cli import UsageError, build_parser, config_from_args
from trainer.config import TrainConfig
from trainer.pass_hooks import ApplyInForward

SITES = ("onprem", "onprem", "onprem", "cloud", "cloud")
FIXED = {"density": 0.1, "density_min": 0.1, "density_max": 0.1, "server_k_fraction": 0.25}


def three_layers(rank: int = 0) -> nn.Module:
    """Three 16x16 layers: with three chunks, chunk c holds layer c's weight exactly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 3, (96,), generator=g))


def cfg(**options) -> TrainConfig:
    return TrainConfig(**({"strategy": "ps-bz-gc", "workers": 4, "global_batch": 32, "max_steps": 8,
                           "warmup_steps": 2, "dense_numel": 16, "pipeline_chunks": 3, "allocation": "flops",
                           "apply_in_forward": True}
                          | FIXED | options))


def test_a_run_applying_its_updates_during_the_forward_pass_learns_exactly_what_one_applying_them_at_step_learns(
        monkeypatch):
    # Relayed, with evaluations (which apply what is pending first) and the run's last step.
    lazy = run_in_process(cfg(sites=SITES), 8, data=data(), model=three_layers, eval_at=(4, 8))
    monkeypatch.setattr(ApplyInForward, "wanted", staticmethod(lambda asked, applier: False))
    whole = run_in_process(cfg(sites=SITES), 8, data=data(), model=three_layers, eval_at=(4, 8))
    assert all(c.in_forward for c in lazy.clients) and not any(c.in_forward for c in whole.clients)
    for a, b in zip(lazy.models, whole.models):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_step_returns_with_the_later_chunks_pending_and_each_layer_applies_its_own_before_it_runs():
    seen = {}

    def probe(rank: int, step: int, run) -> None:
        if rank != 1 or step != 3:
            return
        hooks, model = run.clients[0].in_forward, run.models[0]
        last = model[4].weight.detach().clone()
        seen["pending"] = (hooks.pending, hooks.next_chunk)
        x = torch.zeros(2, 16)
        model[0](x)  # the first layer's weight is chunk 0's, applied already
        seen["after first"] = hooks.next_chunk
        model[2](torch.zeros(2, 16))
        seen["after second"] = hooks.next_chunk
        seen["last unchanged"] = torch.equal(model[4].weight, last)
        model(x)
        seen["after all"] = hooks.pending
        seen["last changed"] = not torch.equal(model[4].weight, last)

    run_in_process(cfg(workers=2), 8, data=data(), model=three_layers, after_step=probe)
    assert seen == {"pending": (3, 1), "after first": 1, "after second": 2, "last unchanged": True,
                    "after all": None, "last changed": True}


def test_the_runs_last_step_and_an_evaluation_leave_nothing_pending():
    run = run_in_process(cfg(workers=2), 6, data=data(), model=three_layers, eval_at=(3,))
    assert all(c.in_forward.pending is None and c.step == 6 for c in run.clients)


def test_apply_in_forward_is_off_unless_asked_and_where_the_update_is_not_in_chunks():
    assert cfg().applies_in_forward
    assert not cfg(apply_in_forward=False).applies_in_forward
    assert not cfg(pipeline_chunks=1).applies_in_forward
    assert not cfg(strategy="ps").applies_in_forward
    assert not cfg(site_aggregation=True).applies_in_forward


@pytest.mark.parametrize("extra, says", [
    (["--pipeline-chunks", "1"], "needs --pipeline-chunks"),
    (["--no-momentum-correction"], "--momentum-correction"),
])
def test_asking_for_apply_in_forward_where_it_cannot_work_is_a_usage_error(extra, says):
    args = ["--strategy", "ps-bz-gc", "--workers", "2", "--pipeline-chunks", "3", "--apply-in-forward", *extra]
    with pytest.raises(UsageError, match=says):
        config_from_args(build_parser().parse_args(args))
