"""The relay (the server's update crosses to each remote site once) and the pipelined step (the
gradient travels in chunks): neither changes what is learned."""

from __future__ import annotations

import time

import pytest
import torch
from trainer_testing import RankLost, run_in_process, sgd, tiny_mlp

from trainer.algorithm import Layout, chunk_count, chunks
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.metrics import MetricsLogger
from trainer.ps import PSClient
from trainer.relay import SERVER, RelayPlan, direct_plan, plan_relay
from trainer.frames import Eval, Grad, unpack
from trainer.server import ParameterServer
from trainer.transport import InMemoryHub, InMemoryTransport

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


def test_under_site_replicas_the_servers_own_site_has_a_relay_too():
    plan = plan_relay(("home", "home", "home", "away", "away", "solo"), 5, every_site=True)
    assert plan.server_sends == (1, 3, 5)
    assert plan.forwards == {1: (2,), 3: (4,)}


def test_a_site_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="need a site"):
        plan_relay(("a", "b"), 4)


def _train(sites: tuple[str, ...], **options) -> tuple[list[torch.nn.Module], InMemoryHub]:
    cfg = TrainConfig(**({"strategy": "ps-bz-gc", "workers": 4, "global_batch": 32, "max_steps": 8,
                          "warmup_steps": 2, "dense_numel": 16, "sites": sites, "allocation": "flops"} | options))
    run = run_in_process(cfg, 8, eval_at=(4, 8))
    return run.models, run.hub


# Besides the steps: WELCOME, the first worker's weights (to every other worker) and BYE.
START, END = 2, 1


def test_relayed_training_ends_with_the_same_models_as_direct_training():
    direct, _ = _train(())
    relayed, _ = _train(PAPER_SITES)
    for a, b in zip(direct, relayed):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_the_server_sends_each_step_once_per_remote_site_and_the_relay_forwards_it():
    _, hub = _train(PAPER_SITES)
    steps, evals = 8, 2  # one EVAL_RESULT per evaluation, always direct
    assert hub.sent[(SERVER, 4)] == START + evals + END
    assert hub.sent[(SERVER, 3)] == START + steps + evals + END
    assert hub.sent[(3, 4)] == steps + END  # the relay forwards the BYE too, ending the peer's wait


def test_the_compressed_part_splits_into_near_equal_chunks_that_tile_it():
    layout = Layout.of(tiny_mlp(), 16)
    bounds = chunks(layout.sparse_numel, 3)
    assert bounds[0][0] == 0 and bounds[-1][1] == layout.sparse_numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    with pytest.raises(ValueError, match="chunks"):
        chunks(layout.sparse_numel, layout.sparse_numel + 1)


def test_a_model_smaller_than_the_pipeline_is_cut_into_as_many_chunks_as_it_has_compressed_elements():
    # The default pipeline's chunks meet models with few or no compressed elements (all dense).
    assert [chunk_count(n, 4) for n in (0, 1, 3, 4, 10**6)] == [1, 1, 3, 4, 4]
    assert chunks(0, chunk_count(0, 4)) == ((0, 0),)


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
    steps, evals, n = 8, 2, 3
    # Worker 1: HELLO, its weights, each chunk of each step, its counts at each evaluation, BYE.
    assert hub.sent[(1, SERVER)] == 2 + steps * n + evals + 1
    assert hub.sent[(SERVER, 3)] == START + steps * n + evals + END
    assert hub.sent[(3, 4)] == steps * n + END


def test_a_checkpoint_holds_one_flat_residual_whatever_the_chunking():
    cfg = TrainConfig(strategy="ps-bz-gc", workers=1, global_batch=8, warmup_steps=0, dense_numel=16,
                      pipeline_chunks=3, density=0.1, density_min=0.1, density_max=0.1)

    def client() -> PSClient:
        model = tiny_mlp()
        return PSClient(cfg, 1, InMemoryHub().transport(1), model, sgd(model), MetricsLogger(1, "worker"))

    worker = client()
    worker.flat.grad.normal_()
    for c in range(3):
        worker.uplink.compress(1, c, worker.densities[0])
    state = worker.state_dict()
    assert state["residual"].numel() == worker.layout.sparse_numel
    again = client()
    again.load_state_dict(state)
    for a, b in zip(worker.uplink.states, again.uplink.states):
        assert torch.equal(a.residual, b.residual)


# -- per-site aggregation: a remote site's gradients cross the WAN once ------------------------------

EXACT = {"density": 1.0, "density_min": 1.0, "density_max": 1.0, "server_k_fraction": 1.0, "value_dtype": "fp32"}


def test_a_site_aggregated_run_learns_the_reference_aggregation_when_nothing_is_dropped():
    direct, _ = _train(PAPER_SITES, **EXACT)
    aggregated, _ = _train(PAPER_SITES, site_aggregation=True, **EXACT)
    for a, b in zip(direct, aggregated):
        for pa, pb in zip(a.parameters(), b.parameters()):
            # Only the order of the sums differs: the site's weighted mean is taken at its relay.
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_a_sites_workers_send_their_gradients_to_its_relay_which_sends_one_frame_across():
    steps, evals = 8, 2
    _, hub = _train(PAPER_SITES, site_aggregation=True, pipeline_chunks=2)
    # Worker 4 (cloud) sends HELLO, its counts at each evaluation and BYE to the server; its
    # chunks go to rank 3, its site's relay, over the LAN (and its BYE, ending the relay's wait).
    assert hub.sent[(4, SERVER)] == 1 + evals + 1
    assert hub.sent[(4, 3)] == steps * 2 + 1
    # The relay sends one frame per chunk for the whole site, as many as an on-prem worker.
    assert hub.sent[(3, SERVER)] == hub.sent[(2, SERVER)]


def test_a_site_aggregated_compressed_run_keeps_the_replicas_identical():
    models, _ = _train(PAPER_SITES, site_aggregation=True, pipeline_chunks=2, density=0.1, density_min=0.05,
                       density_max=0.2)
    for other in models[1:]:
        for pa, pb in zip(models[0].parameters(), other.parameters()):
            assert torch.equal(pa, pb)


class _DiesAfterSending(InMemoryTransport):
    """A rank that is lost right after it has sent the server chunk `chunk` of step `step`, or
    (chunk None) just before it sends its evaluation of `step`."""

    def __init__(self, rank: int, hub: InMemoryHub, *, step: int, chunk: int | None) -> None:
        super().__init__(rank, hub)
        self.at, self.dead = (step, chunk), False

    def send(self, peer: int, frame: torch.Tensor) -> None:
        f = unpack(frame)
        if self.dead or (self.at[1] is None and isinstance(f, Eval) and f.step == self.at[0]):
            raise RankLost
        super().send(peer, frame)
        if peer == SERVER and isinstance(f, Grad) and (f.step, f.chunk) == self.at:
            self.dead = True


def test_a_relay_lost_between_its_sites_chunks_leaves_each_chunk_of_its_member_counted_once(monkeypatch):
    # Rank 3 relays for rank 4 (cloud) and is lost after passing on chunk 0 of step 3: rank 4's
    # chunk 0 of that step reached the server through it, its chunk 1 comes from rank 4 itself.
    seen: list[tuple[int, int, int]] = []
    aggregate = ParameterServer.aggregate

    def spy(self, step, grads, chunk, arrival=None):
        seen.append((step, chunk, sum(g.samples for g in grads)))
        return aggregate(self, step, grads, chunk, arrival)

    monkeypatch.setattr(ParameterServer, "aggregate", spy)
    cfg = TrainConfig(strategy="ps-bz-gc", workers=4, global_batch=32, max_steps=6, warmup_steps=2, dense_numel=16,
                      sites=PAPER_SITES, allocation="flops", site_aggregation=True, pipeline_chunks=2, **EXACT)
    run = run_in_process(cfg, 6, transport=lambda hub, rank: (_DiesAfterSending(rank, hub, step=3, chunk=0)
                                                              if rank == 3 else hub.transport(rank)))
    share = dict(zip((1, 2, 3, 4), initial_batch_sizes(cfg)))
    by = {(s, c): n for s, c, n in seen}
    assert by[(3, 0)] == 32  # the relay's frame: its own and rank 4's samples
    assert by[(3, 1)] == 32 - share[3]  # rank 4's own frame, the relay's samples gone
    assert all(by[(s, c)] == 32 for s in (4, 5, 6) for c in (0, 1))  # the batch split over 1, 2, 4
    survivors = [run.models[r - 1] for r in (1, 2, 4)]
    for other in survivors[1:]:
        for pa, pb in zip(survivors[0].parameters(), other.parameters()):
            assert torch.equal(pa, pb)


def test_a_site_worker_lost_before_an_evaluation_is_dropped_at_the_loss_deadline_not_the_timeout():
    # Rank 4 is behind its relay (rank 3): the server hears it directly only in an evaluation's
    # round, where it must be held to the loss deadline like everyone, not to --timeout-s.
    cfg = TrainConfig(strategy="ps-bz-gc", workers=4, global_batch=32, max_steps=6, warmup_steps=2, dense_numel=16,
                      sites=PAPER_SITES, allocation="flops", site_aggregation=True, timeout_s=120)
    t0 = time.monotonic()
    run = run_in_process(cfg, 6, eval_at=(3, 6), transport=lambda hub, rank: (
        _DiesAfterSending(rank, hub, step=3, chunk=None) if rank == 4 else hub.transport(rank)))
    assert time.monotonic() - t0 < 30
    assert 4 not in run.server.roster
    survivors = [run.models[r - 1] for r in (1, 2, 3)]
    for other in survivors[1:]:
        for pa, pb in zip(survivors[0].parameters(), other.parameters()):
            assert torch.equal(pa, pb)


class _LateToItsRelay(InMemoryTransport):
    """A site worker whose chunks reach its relay `late_s` after it is ready to send them."""

    def __init__(self, rank: int, hub: InMemoryHub, *, relay: int, late_s: float) -> None:
        super().__init__(rank, hub)
        self.relay, self.late_s = relay, late_s

    def send(self, peer: int, frame: torch.Tensor) -> None:
        if peer == self.relay and isinstance(unpack(frame), Grad):
            time.sleep(self.late_s)
        super().send(peer, frame)


def test_a_relays_wait_for_its_sites_chunks_counts_as_communication_not_compression():
    # Re-balancing reads compression as a worker's fixed cost a step: a relay charged with its
    # member's lateness would be given a smaller batch than its speed warrants.
    cfg = TrainConfig(strategy="ps-bz-gc", workers=4, global_batch=32, max_steps=4, warmup_steps=1, dense_numel=16,
                      sites=PAPER_SITES, allocation="flops", site_aggregation=True)
    run = run_in_process(cfg, 4, transport=lambda hub, rank: (
        _LateToItsRelay(rank, hub, relay=3, late_s=0.4) if rank == 4 else hub.transport(rank)))
    relay = run.clients[2]
    assert relay.metrics.last["compress_s"] < 0.2
    assert relay.metrics.last["comm_s"] >= 0.4
