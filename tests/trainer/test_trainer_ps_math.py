"""The PS step's arithmetic, in one process: workers and server driven piece by piece."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from trainer_testing import tiny_dataset, tiny_mlp

from trainer.config import TrainConfig, lr_at
from trainer.data import batch_indices
from trainer.metrics import MetricsLogger
from trainer.ps import GRAD, Layout, ParameterServer, PSWorker
from trainer.transport import InMemoryHub
from trainer.wire import Message, decode, encode


def _setup(cfg: TrainConfig, batch_sizes: list[int]):
    data = tiny_dataset()
    hub = InMemoryHub()
    workers = [
        PSWorker(cfg, r, tiny_mlp(), data, hub.transport(r), MetricsLogger(r, "worker"), batch_sizes)
        for r in range(1, cfg.workers + 1)
    ]
    server = ParameterServer(cfg, Layout.of(tiny_mlp(), cfg.dense_numel), hub.transport(0),
                             MetricsLogger(0, "ps"), batch_sizes, has_buffers=False)
    return data, workers, server


def _ps_step(step: int, workers: list[PSWorker], server: ParameterServer) -> Message:
    msgs = []
    for w in workers:
        loss, n, _ = w.compute(step)
        msgs.append(decode(encode(Message(GRAD, step, w.rank, [loss, n, 0.0, 0.0, 0.0], w.compress(step)))))
    reply = decode(encode(server.aggregate(step, msgs)))
    for w in workers:
        w.apply(step, reply)
    return reply


def _reference_grad(model, data, cfg, step, batch_sizes):
    idx = torch.cat([batch_indices(step, m, tuple(batch_sizes), len(data.y_train), cfg.seed)
                     for m in range(len(batch_sizes))])
    model.zero_grad()
    F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.grad.add_(p, alpha=cfg.weight_decay)


def _follows_momentum_sgd_on_the_global_batch(cfg: TrainConfig) -> list[PSWorker]:
    data, workers, server = _setup(cfg, [16, 16, 16])
    ref = tiny_mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=cfg.momentum)
    for step in (1, 2, 3):
        _ps_step(step, workers, server)
        _reference_grad(ref, data, cfg, step, [16, 16, 16])
        opt.step()
        for w in workers:
            for (name, p), q in zip(w.model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    return workers


def test_uncompressed_ps_step_equals_one_dense_sgd_step_on_the_global_batch():
    _follows_momentum_sgd_on_the_global_batch(TrainConfig(
        strategy="ps", workers=3, global_batch=48, lr=0.1, lr_warmup_steps=0,
        lr_schedule="constant", weight_decay=1e-3, max_steps=10))


def test_momentum_correction_in_dense_steps_equals_momentum_sgd_on_the_global_batch():
    # Warm-up steps send the velocity dense: the replicas then follow plain momentum SGD.
    workers = _follows_momentum_sgd_on_the_global_batch(TrainConfig(
        strategy="ps-gc", workers=3, global_batch=48, lr=0.1, lr_warmup_steps=0,
        lr_schedule="constant", weight_decay=1e-3, max_steps=10, warmup_steps=5, dense_numel=100,
        momentum_correction=True))
    assert all(w.velocity is not None and w.velocity.abs().sum() > 0 for w in workers)


def test_momentum_correction_compresses_the_velocity_and_restarts_what_was_sent():
    cfg = TrainConfig(strategy="ps-gc", workers=1, global_batch=16, warmup_steps=0, dense_numel=100,
                      density=0.1, momentum=0.9, momentum_correction=True)
    _, (worker,), _ = _setup(cfg, [16])
    nd = worker.layout.dense_numel
    worker.compute(1)
    worker.compress(1)
    before = worker.velocity.clone()
    worker.compute(2)
    velocity = 0.9 * before + worker.flat_grad[nd:]
    residual = worker.codec_states[0].residual.clone()
    (_, sparse) = worker.compress(2)
    # What goes is the top-k of residual + velocity; those coordinates start from zero again.
    accumulated = residual + velocity
    torch.testing.assert_close(sparse.values.float(), accumulated[sparse.indices].half().float())
    assert bool((worker.velocity[sparse.indices] == 0).all())
    kept = torch.ones_like(worker.velocity, dtype=torch.bool)
    kept[sparse.indices] = False
    torch.testing.assert_close(worker.velocity[kept], velocity[kept])
    # The optimizer applies the compressed tensors' update without momentum of its own.
    assert [g["momentum"] for g in worker.optimizer.param_groups] == [0.9, 0.0]


def test_without_momentum_correction_momentum_is_applied_after_compression():
    cfg = TrainConfig(strategy="ps-gc", workers=1, global_batch=16, dense_numel=100,
                      momentum_correction=False)
    _, (worker,), _ = _setup(cfg, [16])
    assert worker.velocity is None
    assert [g["momentum"] for g in worker.optimizer.param_groups] == [cfg.momentum]


def test_weighted_aggregation_equals_the_gradient_of_the_concatenated_unequal_batch():
    sizes = [5, 17, 42]
    cfg = TrainConfig(strategy="ps", workers=3, global_batch=sum(sizes), batch_sizes=tuple(sizes),
                      weight_decay=1e-3, dense_numel=100)
    data, workers, server = _setup(cfg, sizes)
    msgs = []
    for w in workers:
        loss, n, _ = w.compute(1)
        msgs.append(Message(GRAD, 1, w.rank, [loss, n, 0.0, 0.0, 0.0], w.compress(1)))
    dense, sparse = server.aggregate(1, msgs).payloads
    flat = torch.cat([dense.values, sparse.values])
    ref = tiny_mlp()
    _reference_grad(ref, data, cfg, 1, sizes)
    layout = Layout.of(ref, cfg.dense_numel)
    params = dict(ref.named_parameters())
    for name, off, n in zip(layout.names, layout.offsets, layout.numels):
        torch.testing.assert_close(flat[off : off + n], params[name].grad.reshape(-1), rtol=1e-5, atol=1e-7)
    # A plain mean of the three gradients would be a different (biased) update.
    plain = sum(torch.cat([p.values for p in decode(encode(m)).payloads]) for m in msgs) / 3
    assert sparse.numel > 0 and not torch.allclose(plain, flat, atol=1e-4)


def test_compressed_step_keeps_server_k_and_replicas_identical():
    cfg = TrainConfig(strategy="ps-bz-gc", workers=3, global_batch=48, speeds=(1.0, 0.5, 0.25),
                      dense_numel=100, warmup_steps=1, density=0.05, density_min=0.01,
                      density_max=0.2, server_k_fraction=0.1)
    _, workers, server = _setup(cfg, [27, 14, 7])
    sparse_numel = server.layout.sparse_numel
    for step in range(1, 8):
        reply = _ps_step(step, workers, server)
        if step > cfg.warmup_steps:
            assert reply.payloads[1].count == round(0.1 * sparse_numel)
    first = workers[0].model.state_dict()
    for w in workers[1:]:
        for k, v in w.model.state_dict().items():
            assert torch.equal(v, first[k]), k
    (state,) = server.codec_states
    assert state.residual is not None and state.residual.abs().sum() > 0


def test_warm_up_steps_travel_dense():
    cfg = TrainConfig(strategy="ps-gc", workers=2, global_batch=32, warmup_steps=2, dense_numel=100)
    _, workers, server = _setup(cfg, [16, 16])
    assert workers[0].compress(1)[1].indices is None
    workers[0].compute(3)
    assert workers[0].compress(3)[1].indices is not None


def test_weight_decay_enters_the_local_gradient_only_for_matrices():
    cfg = TrainConfig(strategy="ps", workers=1, global_batch=8, weight_decay=0.5)
    _, (worker,), _ = _setup(cfg, [8])
    plain = copy.deepcopy(worker.model)
    worker.compute(1)
    idx = batch_indices(1, 0, (8,), 256, cfg.seed)
    data = tiny_dataset()
    F.cross_entropy(plain(data.x_train[idx]), data.y_train[idx]).backward()
    for (name, p), q in zip(worker.model.named_parameters(), plain.parameters()):
        expected = q.grad + (0.5 * q.detach() if q.dim() > 1 else 0)
        torch.testing.assert_close(p.grad, expected, msg=name)


def test_learning_rate_schedule_warms_up_then_decays_to_zero():
    cfg = TrainConfig(lr=0.2, lr_warmup_steps=10, max_steps=110)
    assert lr_at(5, cfg) == 0.1 and lr_at(10, cfg) == 0.2
    assert abs(lr_at(60, cfg) - 0.1) < 1e-9 and lr_at(110, cfg) < 1e-12


def _batch_sizes_after_a_window(timings: list[tuple[float, float]]) -> list[float]:
    """Two steps of a 48-sample run planned as 24 + 24, the workers reporting (compute_s,
    compress_s); the batch sizes the server's reply then carries."""
    # The control plane passes its plan as --batch-sizes; `measured` must still refine it.
    cfg = TrainConfig(strategy="ps-bz-gc", workers=2, global_batch=48, batch_sizes=(24, 24),
                      allocation="measured", rebalance_every=2, dense_numel=100)
    _, workers, server = _setup(cfg, [24, 24])
    for step in (1, 2):
        msgs = []
        for w, (compute_s, compress_s) in zip(workers, timings):
            loss, n, _ = w.compute(step)
            msgs.append(Message(GRAD, step, w.rank, [loss, n, compute_s, 0.0, compress_s], w.compress(step)))
        reply = server.aggregate(step, msgs)
    return reply.scalars[-2:]


def test_measured_allocation_rebalances_a_planned_split_from_compute_times():
    # Worker 2 takes 3x as long per sample.
    assert _batch_sizes_after_a_window([(0.1, 0.0), (0.3, 0.0)]) == [36.0, 12.0]


def test_measured_allocation_counts_each_workers_compression_time():
    # 200 samples/s each, but worker 2 compresses for 60 ms: 30 samples in 0.15 s, 18 in 0.09 + 0.06 s.
    assert _batch_sizes_after_a_window([(0.12, 0.0), (0.12, 0.06)]) == [30.0, 18.0]


def test_the_server_adapts_densities_to_the_arrival_times_it_sees():
    # Worker 1's send returned at once (its frame sat in a socket buffer), but the server saw
    # its bytes take 0.4 s against worker 2's 0.1 s: worker 1's link is the slow one.
    cfg = TrainConfig(strategy="ps-bz-gc", workers=2, global_batch=48, warmup_steps=0, dense_numel=100)
    _, workers, server = _setup(cfg, [24, 24])
    server.transport.wire_s.update({1: 0.4, 2: 0.1})
    msgs = []
    for w in workers:
        loss, n, _ = w.compute(2)
        msgs.append(Message(GRAD, 2, w.rank, [loss, n, 0.1, 0.0, 0.0], w.compress(2)))
    reply = server.aggregate(2, msgs)
    d1, d2 = reply.scalars[1:3]
    assert d1 < cfg.density < d2


def test_a_worker_state_keeps_the_velocity_and_refuses_a_different_momentum_setting():
    cfg = TrainConfig(strategy="ps-gc", workers=1, global_batch=16, warmup_steps=0, dense_numel=100,
                      density=0.1, momentum_correction=True)
    _, (worker,), _ = _setup(cfg, [16])
    worker.compute(1)
    worker.compress(1)
    state = {**worker.state_dict(), "step": 1}
    _, (fresh,), _ = _setup(cfg, [16])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.velocity, worker.velocity) and fresh.velocity.abs().sum() > 0
    _, (plain,), _ = _setup(replace(cfg, momentum_correction=False), [16])
    with pytest.raises(ValueError, match="momentum correction on"):
        plain.load_state_dict(state)
