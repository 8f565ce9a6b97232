"""The PS step's arithmetic: the algorithm's pure pieces, and whole runs in one process."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from trainer_testing import config, global_batch, run_in_process, sgd, tiny_data, tiny_mlp

from trainer.algorithm import (
    Layout,
    add_payload,
    aggregate,
    aggregate_sparsified,
    correction_momentum,
    server_sparsify,
    worker_sparsify,
)
from trainer.compression import CompressionState, Payload, build_compressor
from trainer.frames import Grad, ProtocolError
from trainer.metrics import MetricsLogger
from trainer.ps import PSClient
from trainer.server import ParameterServer
from trainer.sgd_rules import add_decay
from trainer.transport import InMemoryHub
from trainer.updates import UpdateApplier


def _follows_sgd_on_the_global_batch(cfg, steps: int = 3, optimizer=sgd):
    data = tiny_data()
    sizes = [cfg.global_batch // cfg.workers] * cfg.workers
    ref = tiny_mlp()
    ref_opt = optimizer(ref)
    run = run_in_process(cfg, steps, data=data, optimizer=optimizer)
    for step in range(1, steps + 1):
        x, y = global_batch(data, step, sizes, cfg.seed)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for model in run.models:
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    return run


def test_uncompressed_ps_step_equals_one_sgd_step_on_the_global_batch():
    _follows_sgd_on_the_global_batch(config(strategy="ps", workers=3, global_batch=48))


def test_an_adam_optimizer_follows_adam_on_the_global_batch():
    _follows_sgd_on_the_global_batch(config(strategy="ps", workers=3, global_batch=48),
                                     optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=1e-2))


def test_momentum_correction_in_dense_steps_equals_momentum_sgd_on_the_global_batch():
    # Warm-up steps send the velocity dense: the replicas then follow plain momentum SGD.
    run = _follows_sgd_on_the_global_batch(config(strategy="ps-gc", workers=3, global_batch=48,
                                                  warmup_steps=5, dense_numel=100))
    assert all(c.velocity is not None and c.velocity.abs().sum() > 0 for c in run.clients)


def test_momentum_correction_compresses_the_velocity_and_restarts_what_was_sent():
    codec = build_compressor("topk", value_dtype="fp32", error_feedback=True, select="topk")
    state = CompressionState(density=0.1, residual=torch.randn(100))
    velocity = torch.randn(100)
    grad = torch.randn(100)
    expected_velocity = 0.9 * velocity + grad
    accumulated = state.residual + expected_velocity
    sent = worker_sparsify(grad, codec=codec, state=state, velocity=velocity, momentum=0.9, dense_step=False)
    # What goes is the top-k of residual + velocity; those coordinates start from zero again.
    torch.testing.assert_close(sent.values, accumulated[sent.indices])
    assert torch.equal(sent.indices, accumulated.abs().topk(10).indices.sort().values)
    assert bool((velocity[sent.indices] == 0).all())
    kept = torch.ones(100, dtype=torch.bool)
    kept[sent.indices] = False
    torch.testing.assert_close(velocity[kept], expected_velocity[kept])


def _client(cfg, model=None, optimizer=None) -> PSClient:
    model = model or tiny_mlp()
    return PSClient(cfg, 1, InMemoryHub().transport(1), model, optimizer or sgd(model), MetricsLogger(1, "worker"))


def test_momentum_correction_takes_the_compressed_tensors_out_of_the_optimizers_momentum():
    client = _client(config(strategy="ps-gc", workers=1, global_batch=16, dense_numel=100))
    assert client.rules.momentum == 0.9 and client.velocity is not None
    # Decay moved into the local gradient (step 1): the optimizer applies none of its own.
    assert client.rules.decay == [1e-3, 0.0]
    assert [g["weight_decay"] for g in client.optimizer.param_groups] == [0.0, 0.0]


def test_without_momentum_correction_the_optimizer_keeps_its_momentum():
    client = _client(config(strategy="ps-gc", workers=1, global_batch=16, dense_numel=100,
                            momentum_correction=False))
    assert client.velocity is None and client.rules.momentum == 0.0


def test_a_non_sgd_optimizer_gets_no_momentum_correction_and_keeps_its_decay():
    model = tiny_mlp()
    client = _client(config(strategy="ps-gc", workers=1, global_batch=16, dense_numel=100), model,
                     torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    assert client.velocity is None and client.rules.decay == []
    assert client.optimizer.param_groups[0]["weight_decay"] == 0.1


def test_momentum_correction_takes_the_one_plain_momentum_of_the_groups():
    assert correction_momentum([{"momentum": 0.9}, {"momentum": 0.9, "dampening": 0}]) == 0.9
    assert correction_momentum([{"momentum": 0.0}, {}]) == 0.0


def test_momentum_correction_refuses_mixed_dampened_or_nesterov_momentum():
    assert correction_momentum([{"momentum": 0.9}, {"momentum": 0.5}]) is None
    assert correction_momentum([{"momentum": 0.9, "dampening": 0.1}]) is None
    assert correction_momentum([{"momentum": 0.9, "nesterov": True}]) is None


def test_weighted_aggregation_equals_the_gradient_of_the_concatenated_unequal_batch():
    sizes = [5, 17, 42]
    data = tiny_data()
    layout = Layout.of(tiny_mlp(), 100)
    grads, flats = [], []
    for m, n in enumerate(sizes):
        model = tiny_mlp()
        x, y = data.tensors[0][sum(sizes[:m]) : sum(sizes[: m + 1])], data.tensors[1][sum(sizes[:m]) : sum(sizes[: m + 1])]
        F.cross_entropy(model(x), y).backward()
        params = dict(model.named_parameters())
        flat = torch.cat([params[name].grad.reshape(-1) for name in layout.names])
        flats.append(flat)
        nd = layout.dense_numel
        grads.append(Grad(1, m + 1, 0, 0.0, n, 0.0, 0.0, 0.0, Payload(nd, flat[:nd]),
                          Payload(flat.numel() - nd, flat[nd:])))
    dense, sparse = aggregate(grads, layout.dense_numel, layout.sparse_numel)
    ref = tiny_mlp()
    F.cross_entropy(ref(data.tensors[0][:64]), data.tensors[1][:64]).backward()
    params = dict(ref.named_parameters())
    expected = torch.cat([params[name].grad.reshape(-1) for name in layout.names])
    torch.testing.assert_close(torch.cat([dense, sparse]), expected, rtol=1e-5, atol=1e-7)
    # A plain mean of the three gradients would be a different (biased) update.
    assert not torch.allclose(sum(flats) / 3, expected, atol=1e-4)


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "fp8"])
def test_aggregating_into_the_servers_residual_equals_summing_then_compressing(value_dtype):
    n, gen = 20_000, torch.Generator().manual_seed(3)
    worker = build_compressor("topk", value_dtype=value_dtype)
    steps = [[Grad(s, m, 0, 0.0, 10 * m, 0.0, 0.0, 0.0, Payload(4, torch.randn(4, generator=gen)),
                   worker.compress(torch.randn(n, generator=gen), CompressionState(density=0.05)))
              for m in (1, 2, 3)] for s in (1, 2, 3)]
    fused, plain = CompressionState(density=0.1), CompressionState(density=0.1)
    codec = build_compressor("topk", value_dtype=value_dtype)
    # The sums differ only in the order of fp32 additions, which may tip a value's rounding to
    # the wire's dtype by one step; what is sent plus what is kept is the same either way.
    rel = {"fp32": 1e-5, "fp16": 2.0**-10, "fp8": 2.0**-3}[value_dtype]
    for grads in steps:
        dense, got = aggregate_sparsified(grads, 4, n, codec=codec, state=fused, dense_step=False)
        want_dense, total = aggregate(grads, 4, n)
        want = server_sparsify(total, codec=codec, state=plain, dense_step=False)
        torch.testing.assert_close(dense, want_dense, rtol=0, atol=0)
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.decoded(), want.decoded(), rtol=rel, atol=1e-7)
        torch.testing.assert_close(codec.decompress(got, total) + fused.residual,
                                   codec.decompress(want, total) + plain.residual, rtol=1e-5, atol=1e-6)


def test_a_dense_step_aggregates_without_touching_the_servers_residual():
    grads = [Grad(1, m, 0, 0.0, m, 0.0, 0.0, 0.0, Payload(0, torch.zeros(0)), Payload(6, torch.full((6,), float(m))))
             for m in (1, 3)]
    state = CompressionState(density=0.5)
    _, update = aggregate_sparsified(grads, 0, 6, codec=build_compressor("topk"), state=state, dense_step=True)
    assert update.indices is None and torch.equal(update.values, torch.full((6,), 2.5))
    assert state.residual is None


def test_compressed_steps_keep_server_k_and_the_replicas_identical():
    cfg = config(strategy="ps-bz-gc", workers=3, global_batch=48, speeds=(1.0, 0.5, 0.25), dense_numel=100,
                 warmup_steps=1, density=0.05, density_min=0.01, density_max=0.2, server_k_fraction=0.1)
    run = run_in_process(cfg, 7)
    sparse_numel = run.server.layout.sparse_numel
    first = run.models[0].state_dict()
    for model in run.models[1:]:
        for k, v in model.state_dict().items():
            assert torch.equal(v, first[k]), k
    (state,) = run.server.aggregator.states
    assert state.residual is not None and state.residual.abs().sum() > 0
    # The server's update carried about k_s = 10 % of the compressed part (estimated top-k).
    assert run.server.metrics.last["density"] == pytest.approx(0.1, rel=0.1)
    assert sparse_numel > 900
    # The residuals differ per worker: identical replicas are not a trivial consequence.
    assert not torch.equal(run.clients[0].uplink.states[0].residual, run.clients[1].uplink.states[0].residual)


def test_a_sparse_payload_is_added_into_the_tensors_it_spans_at_each_ones_factor():
    # A chunk of 10 elements over two tensors: elements 2-5 are a's 4-7, elements 6-9 are b's 0-3.
    a, b = torch.zeros(8), torch.ones(4)
    payload = Payload(10, torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float16), torch.tensor([0, 3, 5, 9]),
                      scale=0.5)
    add_payload([(a, 4, 8, 2, 6, -1.0), (b, 0, 4, 6, 10, 2.0)], payload)
    assert torch.equal(a, torch.tensor([0.0, 0, 0, 0, 0, -1.0, 0, -1.5]))
    assert torch.equal(b, torch.tensor([1.0, 1, 1, 5.0]))


def test_a_dense_payload_is_added_whole_into_the_tensors_it_spans():
    a, b = torch.zeros(3), torch.zeros(2)
    add_payload([(a, 0, 3, 0, 3, 1.0), (b, 0, 2, 3, 5, -2.0)], Payload(5, torch.arange(5.0)))
    assert torch.equal(a, torch.tensor([0.0, 1.0, 2.0])) and torch.equal(b, torch.tensor([-6.0, -8.0]))


def test_updates_applied_in_place_learn_what_the_flat_gradient_and_the_optimizers_step_learn(monkeypatch):
    cfg = config(strategy="ps-bz-gc", workers=3, global_batch=48, speeds=(1.0, 0.5, 0.25), dense_numel=100,
                 warmup_steps=1, density=0.05, density_min=0.01, density_max=0.2, server_k_fraction=0.1,
                 pipeline_chunks=3)
    in_place = run_in_process(cfg, 6, eval_at=(3,))
    monkeypatch.setattr(UpdateApplier, "in_place", property(lambda self: False))
    through_grad = run_in_process(cfg, 6, eval_at=(3,))
    assert all(c.applier.pieces is not None for c in in_place.clients)
    assert not any(c.applier.pieces is not None for c in through_grad.clients)
    for a, b in zip(in_place.models, through_grad.models):
        for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(in_place.models[0][0].weight, tiny_mlp()[0].weight)


def test_warm_up_steps_travel_dense():
    client = _client(config(strategy="ps-gc", workers=1, global_batch=16, warmup_steps=2, dense_numel=100))
    client.flat.grad.normal_()
    assert client.uplink.compress(1, 0, client.densities[0])[1].indices is None
    assert client.uplink.compress(3, 0, client.densities[0])[1].indices is not None


def test_sgd_weight_decay_enters_the_local_gradient_only_for_its_decaying_groups():
    model = tiny_mlp()
    client = _client(config(strategy="ps", workers=1, global_batch=8), model, sgd(model, weight_decay=0.5))
    plain = tiny_mlp()
    data = tiny_data()
    client.zero_grad()
    F.cross_entropy(model(data.tensors[0][:8]), data.tensors[1][:8]).backward()
    F.cross_entropy(plain(data.tensors[0][:8]), data.tensors[1][:8]).backward()
    client.flat.collect()
    add_decay(client.optimizer, client.rules)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        expected = q.grad + (0.5 * q.detach() if q.dim() > 1 else 0)
        torch.testing.assert_close(p.grad, expected, msg=name)


def _server(cfg) -> ParameterServer:
    server = ParameterServer(cfg, InMemoryHub().transport(0), MetricsLogger(0, "ps"))
    server.configure(Layout.of(tiny_mlp(), cfg.dense_numel).spec)
    return server


def _grad(step: int, rank: int, n: int, layout, *, compute_s=0.0, topk_s=0.0, last_tx_s=0.0) -> Grad:
    nd, ns = layout.dense_numel, layout.sparse_numel
    return Grad(step, rank, 0, 1.0, n, compute_s, last_tx_s, topk_s, Payload(nd, torch.zeros(nd)),
                Payload(ns, torch.zeros(ns)))


def _batch_sizes_after_a_window(timings: list[tuple[float, float]]) -> tuple[int, ...]:
    """Two steps of a 48-sample run planned as 24 + 24, the workers reporting (compute_s,
    compress_s); the batch sizes the server's reply then carries."""
    # The control plane passes its plan as --batch-sizes; `measured` must still refine it.
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=48, batch_sizes=(24, 24), allocation="measured",
                 rebalance_every=2, dense_numel=100)
    server = _server(cfg)
    for step in (1, 2):
        grads = [_grad(step, r, 24, server.layout, compute_s=c, topk_s=t) for r, (c, t) in enumerate(timings, 1)]
        update = server.aggregate(step, grads, 0)
    return update.batch_sizes


def test_measured_allocation_rebalances_a_planned_split_from_compute_times():
    # Worker 2 takes 3x as long per sample.
    assert _batch_sizes_after_a_window([(0.1, 0.0), (0.3, 0.0)]) == (36, 12)


def test_measured_allocation_counts_each_workers_compression_time():
    # 200 samples/s each, but worker 2 compresses for 60 ms: 30 samples in 0.15 s, 18 in 0.09 + 0.06 s.
    assert _batch_sizes_after_a_window([(0.12, 0.0), (0.12, 0.06)]) == (30, 18)


def test_the_server_adapts_densities_to_the_arrival_times_it_sees():
    # Worker 1's send returned at once (its frame sat in a socket buffer), but the server saw
    # its bytes take 0.4 s against worker 2's 0.1 s: worker 1's link is the slow one.
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=48, warmup_steps=0, dense_numel=100)
    server = _server(cfg)
    grads = [_grad(2, r, 24, server.layout, last_tx_s=0.1) for r in (1, 2)]
    d1, d2 = server.aggregate(2, grads, 0, {1: 0.4, 2: 0.1}).densities
    assert d1 < cfg.density < d2


def test_a_worker_state_keeps_the_velocity_and_refuses_a_different_momentum_setting():
    cfg = config(strategy="ps-gc", workers=1, global_batch=16, warmup_steps=0, dense_numel=100, density=0.1)
    client = _client(cfg)
    client.flat.grad.normal_()
    client.uplink.compress(1, 0, client.densities[0])
    state = client.state_dict()
    fresh = _client(cfg)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.velocity, client.velocity) and fresh.velocity.abs().sum() > 0
    plain = _client(replace(cfg, momentum_correction=False))
    with pytest.raises(ValueError, match="momentum correction on"):
        plain.load_state_dict(state)


def test_replicas_start_from_the_first_workers_weights_whatever_their_factory_drew():
    run = run_in_process(config(strategy="ps", workers=3, global_batch=48), 0,
                         model=lambda rank: tiny_mlp(seed=rank))
    for model in run.models[1:]:
        for pa, pb in zip(run.models[0].parameters(), model.parameters()):
            assert torch.equal(pa, pb)


def test_workers_that_build_different_models_abort_the_run_naming_the_difference():
    def model(rank: int) -> nn.Module:
        return tiny_mlp() if rank == 1 else nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))

    with pytest.raises(ProtocolError, match=r"model replicas differ.*0.weight has 768 elements"):
        run_in_process(config(strategy="ps", workers=2, global_batch=32), 1, model=model)
