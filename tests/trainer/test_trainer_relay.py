"""The relay (the server's update crosses to each remote site once) and the pipelined step (the
gradient travels in chunks): neither changes what is learned."""

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


def _train(sites: tuple[str, ...], **options) -> tuple[list[torch.nn.Module], InMemoryHub]:
    cfg = TrainConfig(**({"strategy": "ps-bz-gc", "workers": 4, "global_batch": 32, "max_steps": 8,
                          "eval_every": 4, "warmup_steps": 2, "dense_numel": 16, "sites": sites,
                          "allocation": "flops"} | options))
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


def test_the_compressed_part_splits_into_near_equal_chunks_that_tile_it():
    layout = Layout.of(tiny_mlp(), 16)
    chunks = layout.chunks(3)
    assert chunks[0][0] == 0 and chunks[-1][1] == layout.sparse_numel
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert max(b - a for a, b in chunks) - min(b - a for a, b in chunks) <= 1
    with pytest.raises(ValueError, match="chunks"):
        layout.chunks(layout.sparse_numel + 1)


def test_a_pipelined_step_learns_exactly_what_a_whole_step_learns_when_nothing_is_dropped():
    keep_all = {"density": 1.0, "density_min": 1.0, "density_max": 1.0, "server_k_fraction": 1.0}
    whole, _ = _train(PAPER_SITES, **keep_all)
    pipelined, _ = _train(PAPER_SITES, pipeline_chunks=3, **keep_all)
    for a, b in zip(whole, pipelined):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_pipelined_compressed_training_keeps_the_replicas_identical():
    models, _ = _train(PAPER_SITES, pipeline_chunks=3, density=0.1, density_min=0.1, density_max=0.1,
                       server_k_fraction=0.25)
    for other in models[1:]:
        for pa, pb in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(pa, pb)


def test_each_chunk_of_the_update_crosses_once_per_remote_site_and_is_relayed():
    _, hub = _train(PAPER_SITES, pipeline_chunks=3)
    steps, evals, chunks = 8, 2, 3
    assert hub.sent[(1, SERVER)] == steps * chunks + evals  # and its counts at each evaluation
    assert hub.sent[(SERVER, 3)] == steps * chunks + evals
    assert hub.sent[(3, 4)] == steps * chunks


def test_a_checkpoint_holds_one_flat_residual_whatever_the_chunking():
    cfg = TrainConfig(strategy="ps-bz-gc", workers=1, global_batch=8, warmup_steps=0, dense_numel=16,
                      pipeline_chunks=3, density=0.1, density_min=0.1, density_max=0.1)
    hub = InMemoryHub()
    worker = PSWorker(cfg, 1, tiny_mlp(), tiny_dataset(), hub.transport(1), MetricsLogger(1, "worker"), [8])
    worker.compute(1)
    for c in range(3):
        worker.compress(1, c)
    state = worker.state_dict() | {"step": 1}
    assert state["residual"].numel() == worker.layout.sparse_numel
    again = PSWorker(cfg, 1, tiny_mlp(), tiny_dataset(), hub.transport(1), MetricsLogger(1, "worker"), [8])
    again.load_state_dict(state)
    for a, b in zip(worker.codec_states, again.codec_states):
        assert torch.equal(a.residual, b.residual)
