"""The relay: the server's update crosses to each remote site once, and nothing else changes."""

from __future__ import annotations

import threading

import pytest
import torch
from trainer_testing import tiny_dataset, tiny_mlp

from trainer.config import TrainConfig
from trainer.metrics import MetricsLogger
from trainer.ps import Layout, ParameterServer, PSWorker
from trainer.relay import SERVER, RelayPlan, direct_plan, plan_relay
from trainer.transport import InMemoryHub

PAPER_SITES = ("onprem", "onprem", "onprem", "cloud", "cloud")


def test_without_sites_the_server_sends_to_every_worker():
    assert plan_relay((), 4) == direct_plan(4) == RelayPlan((1, 2, 3, 4))


def test_a_remote_site_receives_one_copy_through_its_lowest_rank():
    plan = plan_relay(PAPER_SITES, 4)
    assert plan.server_sends == (1, 2, 3)
    assert plan.forwards == {3: (4,)}
    assert [plan.source(r) for r in (1, 2, 3, 4)] == [SERVER, SERVER, SERVER, 3]


def test_workers_in_the_servers_site_keep_their_direct_link():
    plan = plan_relay(("a", "a", "a", "b"), 3)
    assert plan.server_sends == (1, 2, 3)
    assert plan.forwards == {}


def test_each_remote_site_gets_its_own_relay():
    plan = plan_relay(("a", "b", "c", "b", "c", "b"), 5)
    assert plan.server_sends == (1, 2)
    assert plan.forwards == {1: (3, 5), 2: (4,)}
    assert plan.forwards_of(3) == ()


def test_a_site_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="need a site"):
        plan_relay(("a", "b"), 4)


def _train(sites: tuple[str, ...]) -> tuple[list[torch.nn.Module], InMemoryHub]:
    cfg = TrainConfig(strategy="ps-bz-gc", workers=4, global_batch=32, max_steps=8, eval_every=4,
                      warmup_steps=2, dense_numel=16, sites=sites, allocation="flops")
    data, hub, batch_sizes = tiny_dataset(), InMemoryHub(timeout_s=20), [8, 8, 8, 8]
    workers = [PSWorker(cfg, r, tiny_mlp(), data, hub.transport(r), MetricsLogger(r, "worker"), batch_sizes)
               for r in range(1, 5)]
    server = ParameterServer(cfg, Layout.of(tiny_mlp(), cfg.dense_numel), hub.transport(0),
                             MetricsLogger(0, "ps"), batch_sizes, has_buffers=False)
    errors: list[BaseException] = []

    def guarded(fn) -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(x.train,)) for x in [server, *workers]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return [w.model for w in workers], hub


def test_relayed_training_ends_with_the_same_models_as_direct_training():
    direct, _ = _train(())
    relayed, _ = _train(PAPER_SITES)
    for a, b in zip(direct, relayed):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_the_server_sends_each_step_once_per_remote_site_and_the_relay_forwards_it():
    _, hub = _train(PAPER_SITES)
    steps, evals = 8, 2  # one EVAL_RESULT per evaluation, always direct
    assert hub.sent[(SERVER, 4)] == evals
    assert hub.sent[(SERVER, 3)] == steps + evals
    assert hub.sent[(3, 4)] == steps
