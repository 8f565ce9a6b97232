"""Local SGD (`diloco`, `diloco-gc`): the outer step's arithmetic, whole runs in one process,
and runs on real processes with workers joining and leaving at outer steps."""

from __future__ import annotations

import math
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from test_trainer_elastic import SCRIPT, held, run_with_a_late_worker
from trainer_testing import (
    DIGITS,
    RankLost,
    adamw,
    config,
    events,
    flat_parameters,
    global_batch,
    plain_sgd,
    read_metrics,
    run_cli,
    run_in_process,
    series,
    start_ps_run,
    stop_all,
    tiny_data,
    tiny_mlp,
)

from hybridtrain.contract import (
    EVENT_RESUMED,
    EVENT_WORKER_JOINED,
    EVENT_WORKER_LEFT,
    fragment_offsets,
    next_sync,
    sync_due,
    sync_fragments,
)
from trainer import late_changes
from trainer.algorithm import Layout, aggregate, float_buffers
from trainer.cli import UsageError, build_parser, config_from_args
from trainer.codec_state import codec
from trainer.compression import CompressionState, Payload
from trainer.flat_model import FlatModel
from trainer.frames import UPDATE, Grad
from trainer.local_sgd import LocalSGD, Progress, outer_step, pseudo_gradient
from trainer.metrics import MetricsLogger
from trainer.outer_steps import OuterSteps
from trainer.ps import PSClient
from trainer.server import ParameterServer
from trainer.transport import InMemoryHub, InMemoryTransport
from trainer.wire import peek_kind


# -- the pure pieces ------------------------------------------------------------------------------


def test_the_pseudo_gradient_is_the_common_parameters_less_the_local_ones():
    assert pseudo_gradient(torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])).tolist() == [0.5, -1.0]


def test_the_outer_step_is_nesterov_sgd_by_hand():
    params, velocity, delta = torch.tensor([1.0, 2.0]), torch.zeros(2), torch.tensor([0.5, -1.0])
    outer_step(params, velocity, delta, lr=0.7, momentum=0.9)
    # v = delta; theta -= 0.7 * (delta + 0.9 v) = 0.7 * 1.9 delta
    torch.testing.assert_close(params, torch.tensor([1.0 - 0.665, 2.0 + 1.33]))
    outer_step(params, velocity, delta, lr=0.7, momentum=0.9)
    # v = 0.9 delta + delta = 1.9 delta; theta -= 0.7 * (delta + 0.9 * 1.9 delta) = 0.7 * 2.71 delta
    torch.testing.assert_close(params, torch.tensor([0.335 - 0.9485, 3.33 + 1.897]))


def test_the_outer_step_matches_torch_nesterov_sgd_over_several_steps():
    gen = torch.Generator().manual_seed(0)
    params, velocity = torch.randn(50, generator=gen), torch.zeros(50)
    reference = torch.nn.Parameter(params.clone())
    opt = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(5):
        delta = torch.randn(50, generator=gen)
        outer_step(params, velocity, delta, lr=0.7, momentum=0.9)
        reference.grad = delta.clone()
        opt.step()
    torch.testing.assert_close(params, reference.detach())


def test_without_momentum_the_outer_step_is_plain_sgd():
    params = torch.tensor([1.0, 1.0])
    outer_step(params, torch.zeros(2), torch.tensor([1.0, -2.0]), lr=0.5, momentum=0.0)
    assert params.tolist() == [0.5, 2.0]


def test_pseudo_gradients_are_averaged_by_the_samples_each_worker_processed():
    # Worker 1 trained on 10 samples since the outer step, worker 2 on 30: weights 1/4 and 3/4.
    grads = [Grad(20, w, 0, 0.0, n, 0.0, 0.0, 0.0, Payload(2, d), Payload(0, torch.zeros(0)))
             for w, n, d in ((1, 10, torch.tensor([4.0, 0.0])), (2, 30, torch.tensor([0.0, 4.0])))]
    dense, _ = aggregate(grads, 2, 0)
    assert dense.tolist() == [1.0, 3.0]


def test_outer_steps_come_every_h_steps_and_at_the_last_step():
    assert [s for s in range(1, 26) if sync_due(s, 10, 25)] == [10, 20, 25]
    assert next_sync(0, 10, 25) == 10 and next_sync(10, 10, 25) == 20 and next_sync(20, 10, 25) == 25


def test_each_streaming_fragment_syncs_every_h_steps_staggered_and_all_at_the_last_step():
    h, fragments, last = 20, 3, 95
    syncs = {p: [s for s in range(1, last + 1) if p in sync_fragments(s, h, last, fragments)] for p in range(fragments)}
    assert syncs == {0: [6, 26, 46, 66, 86, 95], 1: [13, 33, 53, 73, 93, 95], 2: [20, 40, 60, 80, 95]}
    assert all(len(sync_fragments(s, h, last, fragments)) <= 1 for s in range(1, last))
    assert [next_sync(s, h, last, fragments) for s in (0, 6, 12, 13, 20, 93)] == [6, 13, 13, 20, 26, 95]


def test_one_fragment_is_the_whole_model_every_h_steps():
    assert fragment_offsets(10) == (10,)
    assert all(sync_fragments(s, 10, 25) == ((0,) if sync_due(s, 10, 25) else ()) for s in range(1, 30))


def test_more_fragments_than_inner_steps_between_syncs_are_refused():
    assert fragment_offsets(4, 4) == (1, 2, 3, 4)
    with pytest.raises(ValueError, match="fragments"):
        fragment_offsets(4, 5)


def test_a_fragments_outer_step_moves_its_own_slice_and_keeps_its_own_round_and_drift():
    local = LocalSGD(4, lr=1.0, momentum=0.5, numel=4, spans=((0, 2), (2, 4)))
    local.reset(torch.ones(4), 0)
    local.note(1.0, 8, 0.1)
    local.sent(torch.tensor([0.5, 1.5]), fragment=0)  # fragment 0's change left at step 2
    local.note(3.0, 8, 0.1)
    assert (local.rounds[0].samples, local.rounds[1].samples, local.rounds[1].loss) == (8, 16, 2.0)
    local.apply(torch.tensor([0.2, -0.2]), 2, fragment=0)
    # Nesterov, first step: theta -= lr * (1 + mu) * delta, on fragment 0's slice only.
    assert local.common.tolist() == pytest.approx([0.7, 1.3, 1.0, 1.0])
    assert local.velocity.tolist() == pytest.approx([0.2, -0.2, 0.0, 0.0])
    assert local.synced == [2, 0] and local.synced_step == 2 and not local.at_common(2)
    assert local.parameters_after(torch.tensor([0.4, 1.7]), fragment=0).tolist() == pytest.approx([0.6, 1.5])
    assert not local.drift_from


def test_a_round_reports_its_samples_and_mean_loss():
    progress = Progress()
    for loss, n in ((1.0, 8), (math.nan, 8), (3.0, 16)):
        progress.note(loss, n, 0.1)
    assert (progress.steps, progress.samples, progress.loss) == (3, 32, 2.0)
    assert progress.compute_s == pytest.approx(0.3)


def test_an_overlapped_outer_step_keeps_the_inner_steps_taken_since_the_change_was_sent():
    local = LocalSGD(4, lr=1.0, momentum=0.0, numel=2)
    local.reset(torch.tensor([1.0, 1.0]), 0)
    local.sent(torch.tensor([0.5, 1.5]))  # delta (0.5, -0.5) left at step 4
    moved_since = torch.tensor([0.4, 1.7])  # two inner steps later
    local.apply(torch.tensor([0.2, -0.2]), 4)  # the mean change arrives
    assert local.common.tolist() == pytest.approx([0.8, 1.2])
    # theta' plus the drift since the send: (0.8 - 0.1, 1.2 + 0.2)
    assert local.parameters_after(moved_since).tolist() == pytest.approx([0.7, 1.4])
    assert not local.drift_from and torch.equal(local.parameters_after(moved_since), local.common)


@pytest.mark.parametrize("strategy", ["diloco", "diloco-gc"])
def test_error_feedback_conserves_the_pseudo_gradients_mass(strategy):
    # What was sent plus what is held back equals every pseudo-gradient given (one fp32 rounding).
    cfg = config(strategy=strategy, workers=1, global_batch=8, density=0.05)
    codec_ = codec(cfg, cfg.compressor)
    state = CompressionState(density=cfg.density)
    gen = torch.Generator().manual_seed(1)
    given, sent = torch.zeros(1000), torch.zeros(1000)
    for _ in range(5):
        delta = torch.randn(1000, generator=gen) * 1e-3
        given += delta
        payload = codec_.compress(delta, state)
        sent += payload.decoded() if payload.indices is None else torch.zeros(1000).index_add_(
            0, payload.indices, payload.values.float() * payload.scale)
    torch.testing.assert_close(sent + state.residual, given, rtol=0, atol=1e-6)
    if strategy == "diloco":
        assert payload.values.dtype == torch.float16 and payload.indices is None
    else:
        assert payload.count == 50


def test_a_worker_state_carries_the_common_parameters_and_the_outer_optimizer():
    cfg = config(strategy="diloco", workers=1, global_batch=16)
    hub = InMemoryHub()
    model = tiny_mlp()
    client = PSClient(cfg, 1, hub.transport(1), model, adamw(model), MetricsLogger(1, "worker"))
    client.local.velocity.normal_()
    client.local.synced = [40]
    common = client.local.common.clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # inner steps since the outer step: not the run's model
    state = client.state_frame()
    assert state.step == 40 and torch.equal(state.params, common)
    fresh_model = tiny_mlp(seed=5)
    fresh = PSClient(cfg, 1, hub.transport(2), fresh_model, adamw(fresh_model), MetricsLogger(1, "worker"))
    fresh.load_state(state)
    assert torch.equal(fresh.local.velocity, client.local.velocity)
    assert fresh.local.synced_step == 40 and torch.equal(flat_parameters(fresh_model), common)


def test_the_cli_refuses_the_per_step_variants_and_bad_outer_settings():
    parser = build_parser()
    for extra, match in ((["--apply-in-forward"], "--apply-in-forward"),
                         (["--sync-every", "0"], "--sync-every"), (["--outer-momentum", "1"], "--outer-momentum"),
                         (["--outer-lr", "0"], "--outer-lr"), (["--outer-delay", "20"], "--outer-delay"),
                         (["--sync-every", "4", "--fragments", "5"], "--fragments")):
        with pytest.raises(UsageError, match=match):
            config_from_args(parser.parse_args(["--strategy", "diloco", *extra]))
    cfg = config_from_args(parser.parse_args(["--strategy", "diloco-gc", "--sync-every", "7"]))
    assert (cfg.sync_every, cfg.allocation, cfg.rebalance_every, cfg.compresses) == (7, "measured", 1, True)


def test_the_cli_takes_asynchronous_outer_steps_instead_of_the_fixed_delay():
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["--strategy", "diloco", "--async-outer", "--sync-every", "8"]))
    assert (cfg.asynchronous, cfg.outer_delay, cfg.staleness_bound) == (True, 0, 7)
    bounded = config_from_args(parser.parse_args(["--strategy", "diloco-gc", "--async-outer", "--max-staleness", "2"]))
    assert bounded.staleness_bound == 2
    for extra, match in ((["--outer-delay", "2"], "--outer-delay and --async-outer"),
                         (["--max-staleness", "20"], "--max-staleness needs --sync-every"),
                         (["--sync-every", "1"], "--async-outer needs --sync-every")):
        with pytest.raises(UsageError, match=match):
            config_from_args(parser.parse_args(["--strategy", "diloco", "--async-outer", *extra]))
    with pytest.raises(UsageError, match="--max-staleness needs --async-outer"):
        config_from_args(parser.parse_args(["--strategy", "diloco", "--max-staleness", "2"]))


def test_streaming_makes_the_exchanges_chunks_its_fragments():
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(["--strategy", "diloco", "--fragments", "4", "--pipeline-chunks", "2"]))
    assert (cfg.fragments, cfg.streams, cfg.exchange_chunks) == (4, True, 4)
    # H = 20 in 4: fragment 0 after step 5, none after 7, all four after the last.
    assert [cfg.round_chunks(s, 4, 100) for s in (5, 7, 100)] == [(0,), (), (0, 1, 2, 3)]
    plain = config_from_args(parser.parse_args(["--strategy", "diloco", "--pipeline-chunks", "2"]))
    assert (plain.streams, plain.exchange_chunks, plain.round_chunks(20, 2, 100)) == (False, 2, (0, 1))


def test_the_outer_exchange_overlaps_no_inner_steps_unless_told():
    parser = build_parser()
    delay = {argv: config_from_args(parser.parse_args(["--strategy", "diloco", *argv])).outer_delay
             for argv in ((), ("--sync-every", "3"), ("--outer-delay", "2"))}
    assert delay == {(): 0, ("--sync-every", "3"): 0, ("--outer-delay", "2"): 2}
    assert config_from_args(parser.parse_args(["--strategy", "ps-bz-gc"])).outer_delay == 0


# -- whole runs in one process ----------------------------------------------------------------------


def test_diloco_with_h_1_and_an_outer_sgd_of_rate_1_equals_synchronous_sgd_on_the_global_batch():
    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=1, outer_lr=1.0, outer_momentum=0.0,
                 value_dtype="fp32")
    data, steps = tiny_data(), 4
    run = run_in_process(cfg, steps, data=data, optimizer=plain_sgd)
    ref = tiny_mlp()
    ref_opt = plain_sgd(ref)
    for step in range(1, steps + 1):
        x, y = global_batch(data, step, [16, 16, 16], cfg.seed)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for model in run.models:
        torch.testing.assert_close(flat_parameters(model), flat_parameters(ref), rtol=1e-5, atol=1e-6)


class _SlowStepSGD(torch.optim.SGD):
    """A slower device's optimizer: its step takes 20 ms."""

    def step(self, closure=None):  # type: ignore[override]
        time.sleep(0.02)
        return super().step(closure)


def test_a_workers_outer_step_reports_its_optimizer_steps_as_compute_for_the_re_split(monkeypatch):
    # No forward or backward time is reported (compute_s=0); worker 2's optimizer steps are slow.
    cfg = config(strategy="diloco", workers=2, global_batch=32, sync_every=4, max_steps=8)
    made: list[torch.optim.Optimizer] = []

    def optimizer(model):
        made.append((torch.optim.SGD if not made else _SlowStepSGD)(model.parameters(), lr=0.1))
        return made[-1]

    reported: dict[tuple[int, int], float] = {}
    aggregate_ = ParameterServer.aggregate

    def spy(self, step, grads, chunk, arrival=None):
        reported.update({(step, g.sender): g.compute_s for g in grads})
        return aggregate_(self, step, grads, chunk, arrival)

    monkeypatch.setattr(ParameterServer, "aggregate", spy)
    run_in_process(cfg, 8, optimizer=optimizer)
    for step in (4, 8):  # each round's four inner steps
        assert reported[(step, 2)] >= 4 * 0.02 and reported[(step, 1)] < 0.02, reported


@pytest.mark.parametrize("strategy", ["diloco", "diloco-gc"])
def test_replicas_leave_every_outer_step_identical_and_drift_apart_between(strategy):
    cfg = config(strategy=strategy, workers=3, global_batch=48, sync_every=4, max_steps=10, dense_numel=100)
    snapshots: dict[tuple[int, int], torch.Tensor] = {}
    run = run_in_process(cfg, 10, optimizer=adamw,
                         after_step=lambda rank, step, run: snapshots.__setitem__((rank, step),
                                                                                  flat_parameters(run.models[rank - 1])))
    for step in range(1, 11):
        same = all(torch.equal(snapshots[(1, step)], snapshots[(r, step)]) for r in (2, 3))
        assert same == (step in (4, 8, 10)), step
    assert all(c.local.synced_step == 10 for c in run.clients)


def test_overlapped_outer_steps_keep_the_common_model_identical_and_end_on_it():
    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=4, max_steps=10, outer_delay=2)
    snapshots: dict[tuple[int, int], torch.Tensor] = {}
    run = run_in_process(cfg, 10, optimizer=adamw,
                         after_step=lambda rank, step, run: snapshots.__setitem__((rank, step),
                                                                                  run.clients[rank - 1].local.common.clone()))
    # The outer step of step 4 lands at step 6 on every worker, step 8's at 10 with the last.
    for step in (5, 6, 7, 10):
        assert all(torch.equal(snapshots[(1, step)], snapshots[(r, step)]) for r in (2, 3))
    assert torch.equal(snapshots[(1, 5)], snapshots[(1, 4)]) and not torch.equal(snapshots[(1, 6)], snapshots[(1, 5)])
    flats = [flat_parameters(m) for m in run.models]
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    plain = run_in_process(replace_cfg(cfg, outer_delay=0), 10, optimizer=adamw)
    assert not torch.equal(flat_parameters(plain.models[0]), flats[0])  # the overlap changes the arithmetic


class _SlowUpdates(InMemoryTransport):
    """The server's updates take `delay_s` a chunk to arrive: a WAN far slower than the inner steps."""

    def __init__(self, rank: int, hub: InMemoryHub, delay_s: float) -> None:
        super().__init__(rank, hub)
        self.delay_s = delay_s

    def recv(self, peer: int, *, count: bool = True) -> torch.Tensor:
        frame = super().recv(peer, count=count)
        if peer == 0 and peek_kind(frame) == UPDATE:
            time.sleep(self.delay_s)
        return frame


def _async_run(monkeypatch, delay_s: float, **changes) -> dict[int, dict[int, float]]:
    """An asynchronous run of 3 workers, H = 8, 20 steps; rank -> outer step (under streaming,
    each fragment's round) -> its staleness."""
    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=8, max_steps=20, asynchronous=True,
                 **changes)
    seen: dict[int, dict[int, float]] = {}
    log = MetricsLogger.log

    def record(self, step, name, value, peer=None):
        if name == "outer_staleness":
            seen.setdefault(self.rank, {})[step] = value
        log(self, step, name, value, peer)

    monkeypatch.setattr(MetricsLogger, "log", record)
    # 10 ms an inner step: an update that is not slowed is back well within one.
    run = run_in_process(cfg, 20, optimizer=adamw, after_step=lambda *_: time.sleep(0.01),
                         transport=lambda hub, rank: _SlowUpdates(rank, hub, delay_s))
    flats = [flat_parameters(m) for m in run.models]
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    assert all(c.local.synced == [20] * c.local.fragments for c in run.clients)
    return seen


def test_an_asynchronous_outer_step_waits_for_a_slow_update_only_at_the_staleness_bound(monkeypatch):
    # Updates far slower than the inner steps: every overlapped outer step lands at the bound,
    # the last at once.
    seen = _async_run(monkeypatch, 0.15, max_staleness=2)
    assert all(seen[r] == {8: 2, 16: 2, 20: 0} for r in (1, 2, 3)), seen


def test_an_asynchronous_outer_step_lands_as_soon_as_its_update_is_here(monkeypatch):
    # Nothing slows the wire: the outer steps land before the bound, H - 1 = 7 (the last round
    # is 4 steps: step 16's lands by step 20's send).
    seen = _async_run(monkeypatch, 0.0)
    assert all(set(by_step) == {8, 16, 20} and by_step[20] == 0 for by_step in seen.values()), seen
    staleness = [by_step[step] for by_step in seen.values() for step in (8, 16)]
    assert all(1 <= v <= 7 for v in staleness) and min(staleness) < 3, seen


def test_asynchronous_fragments_outer_steps_stay_within_the_bound_several_on_their_way(monkeypatch):
    # Updates far slower than the inner steps, 4 fragments (a round every 2 steps), the bound
    # H - 1 = 7: several fragments' outer steps are on their way at once, each lands by its own
    # round's bound, and the replicas end on one model (_async_run checks it).
    seen = _async_run(monkeypatch, 0.3, fragments=4, dense_numel=100)
    for by_step in seen.values():
        assert set(by_step) == {*range(2, 20, 2), 20} and by_step[20] == 0, seen
        assert all(1 <= by_step[step] <= 7 for step in range(2, 20, 2)) and max(by_step.values()) > 2, seen


def test_an_asynchronous_fragments_outer_step_lands_as_soon_as_its_own_update_is_here(monkeypatch):
    # Nothing slows the wire: fragments 0-2's rounds, whose last chunk is not the exchange's
    # last, land before the bound too (those of steps 14-18 are landed by step 20's send).
    seen = _async_run(monkeypatch, 0.0, fragments=4, dense_numel=100)
    staleness = [by_step[step] for by_step in seen.values() for step in (2, 4, 6, 10, 12)]
    assert all(1 <= v <= 7 for v in staleness) and min(staleness) < 3, seen


def test_the_server_goes_on_without_a_straggler_and_folds_its_change_into_the_next_outer_step(monkeypatch):
    # H = 4, inner steps of 50 ms, a round's deadline of 30 ms; rank 3 stalls 0.15 s before step
    # 8: step 8's outer step closes without it (every worker has its mean before rank 3 has even
    # sent), rank 3's change joins step 12's mean, and the last outer step waits for everyone.
    outer, applied, stepped = _run_with_a_straggler(monkeypatch, stall_s=0.15)
    assert outer["outer_deferred"][8] >= 1 and outer["outer_deferred"][16] == 0, outer
    assert outer["outer_folded"][12] >= 1 and not any(outer["outer_dropped"].values()), outer
    assert applied[(1, 8)] < stepped[(3, 8)]  # no wait for the straggler's compute


def test_a_straggler_change_that_misses_two_outer_steps_is_dropped_and_the_server_says_so(monkeypatch):
    # Rank 3 stalls 0.35 s, longer than a round (0.2 s): its change of step 8 comes after step
    # 12's round has closed, two rounds late at step 16's, beyond the bound of one.
    outer, _, _ = _run_with_a_straggler(monkeypatch, stall_s=0.35)
    assert outer["outer_deferred"][8] >= 1 and outer["outer_dropped"][16] == 1, outer


def _run_with_a_straggler(monkeypatch, *, stall_s: float) -> tuple[dict, dict, dict]:
    """An asynchronous run, 3 workers, H = 4, 16 steps in 2 chunks, inner steps of 50 ms and a
    round's deadline of 30 ms; rank 3 stalls `stall_s` before step 8. Checks the replicas end
    equal; returns the server's outer_deferred/folded/dropped by step, when each (rank, outer
    step) was applied and when each (rank, step) was done."""
    monkeypatch.setattr(late_changes, "DEADLINE_FLOOR_S", 0.03)
    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=4, max_steps=16, asynchronous=True,
                 pipeline_chunks=2, dense_numel=100)
    outer: dict[str, dict[int, float]] = {}
    applied: dict[tuple[int, int], float] = {}
    stepped: dict[tuple[int, int], float] = {}
    log = MetricsLogger.log

    def record(self, step, name, value, peer=None):
        if self.rank == 0 and name in ("outer_deferred", "outer_folded", "outer_dropped"):
            outer.setdefault(name, {})[step] = value
        if name == "outer_staleness":
            applied[(self.rank, step)] = time.monotonic()
        log(self, step, name, value, peer)

    def pace(rank: int, step: int, run) -> None:
        stepped[(rank, step)] = time.monotonic()
        time.sleep(stall_s if (rank, step) == (3, 7) else 0.05)

    monkeypatch.setattr(MetricsLogger, "log", record)
    run = run_in_process(cfg, 16, optimizer=adamw, after_step=pace)
    assert len(run.clients) == 3 and all(c.local.synced == [16] for c in run.clients)
    flats = [flat_parameters(m) for m in run.models]
    assert all(torch.equal(flats[0], f) for f in flats[1:])
    return outer, applied, stepped


def _fragments_on_their_way(arrived: set[int]) -> tuple[OuterSteps, list[int]]:
    """A worker's asynchronous outer steps, H = 8 in 4 fragments, with fragment 0's round of step
    2 and fragment 1's of step 4 on their way (those of `arrived` back); the rounds it reads."""
    cfg = config(strategy="diloco", workers=1, global_batch=8, sync_every=8, max_steps=20, asynchronous=True,
                 fragments=4)
    model = tiny_mlp()
    flat = FlatModel(model, Layout.of(model, 16), torch.device("cpu"))
    n = flat.layout.numel
    local = LocalSGD(8, lr=0.7, momentum=0.0, numel=n, spans=tuple((p * n // 4, (p + 1) * n // 4) for p in range(4)))
    reads: list[int] = []
    outer = OuterSteps(cfg, local, flat, MetricsLogger(1, "worker"), read_round=reads.append,
                       update_arrived=arrived.__contains__, ended=lambda: False)
    outer.pending.extend([2, 4])
    return outer, reads


def test_between_outer_steps_the_global_model_has_the_buffers_of_the_last_outer_step():
    cfg = config(strategy="diloco", workers=1, global_batch=8, sync_every=4, max_steps=8)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    flat = FlatModel(model, Layout.of(model, 16), torch.device("cpu"))
    local = LocalSGD(4, lr=1.0, momentum=0.0, numel=flat.layout.numel)
    local.reset(flat.values(), 0)
    outer = OuterSteps(cfg, local, flat, MetricsLogger(1, "worker"), read_round=lambda step: None,
                       update_arrived=lambda step: False, ended=lambda: False, buffers=lambda: float_buffers(model))
    statistics = model[1].running_mean
    at_outer_step = statistics.clone()
    model(torch.randn(16, 4) + 3.0)  # inner step 1's forward pass moves this worker's statistics
    drifted = statistics.clone()
    with outer.global_model(1):  # what an evaluation after inner step 1 scores
        assert torch.equal(statistics, at_outer_step)
    assert torch.equal(statistics, drifted)


def test_asynchronous_fragments_outer_steps_whose_updates_are_here_land_together_oldest_first():
    outer, reads = _fragments_on_their_way({2, 4})
    outer.after_inner_step(5, 20, loss=0.0, samples=8, compute_s=0.0)
    assert reads == [2, 4] and not outer.pending


def test_an_asynchronous_fragments_outer_step_waits_behind_an_older_one_until_that_lands():
    # Step 4's update is here, step 2's not: neither lands until step 2's reaches the bound, 7.
    outer, reads = _fragments_on_their_way({4})
    for step in range(5, 9):
        outer.after_inner_step(step, 20, loss=0.0, samples=8, compute_s=0.0)
    assert reads == []
    outer.after_inner_step(9, 20, loss=0.0, samples=8, compute_s=0.0)
    assert reads == [2, 4]


def test_streaming_fragments_land_staggered_on_every_worker_and_the_replicas_end_equal():
    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=8, max_steps=21, fragments=4,
                 outer_delay=3, dense_numel=100)
    commons: dict[tuple[int, int], torch.Tensor] = {}
    run = run_in_process(cfg, 21, optimizer=adamw,
                         after_step=lambda rank, step, run: commons.__setitem__((rank, step),
                                                                                run.clients[rank - 1].local.common.clone()))
    spans = run.clients[0].local.spans
    assert len(spans) == 4 and spans[0][0] == 0 and spans[-1][1] == run.clients[0].layout.numel
    for step in range(4, 22):
        assert all(torch.equal(commons[(1, step)], commons[(r, step)]) for r in (2, 3)), step
        moved = {p for p, (a, b) in enumerate(spans) if not torch.equal(commons[(1, step)][a:b],
                                                                         commons[(1, step - 1)][a:b])}
        # Fragment p syncs after steps 2(p + 1) + 8k; its outer step lands 3 steps later, and the
        # run's last step brings every fragment's.
        assert moved == (set(range(4)) if step == 21 else set(sync_fragments(step - 3, 8, 21, 4))), step
    assert all(c.local.synced == [21] * 4 for c in run.clients)
    flats = [flat_parameters(m) for m in run.models]
    assert all(torch.equal(flats[0], f) for f in flats[1:])


def test_a_worker_leaving_a_streaming_run_between_fragments_leaves_the_others_equal_to_the_end():
    def leave_after_7(rank: int, step: int, run) -> None:
        if rank == 3 and step == 7:  # fragment 2's outer step of step 6 is still on its way
            run.clients[2].leave()
            raise RankLost

    cfg = config(strategy="diloco", workers=3, global_batch=48, sync_every=8, max_steps=21, fragments=4,
                 outer_delay=3, dense_numel=100)
    run = run_in_process(cfg, 21, optimizer=adamw, after_step=leave_after_7)
    assert 3 not in run.server.roster
    stayed = [c for c in run.clients if c.rank != 3]
    assert len(stayed) == 2 and all(c.local.synced == [21] * 4 for c in stayed)
    assert torch.equal(flat_parameters(run.models[0]), flat_parameters(run.models[1]))


def replace_cfg(cfg, **changes):
    from dataclasses import replace

    return replace(cfg, **changes)


# -- real processes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, extra", [("diloco", []), ("diloco-gc", []),
                                             # evaluations (every 15) while an outer step is on its way
                                             ("diloco", ["--outer-delay", "3", "--eval-every", "15"]),
                                             ("diloco", ["--async-outer", "--eval-every", "15"])])
def test_a_local_sgd_run_trains_the_digits_and_sends_a_fraction_of_a_ps_runs_bytes(tmp_path, strategy, extra):
    out = tmp_path / "m.jsonl"
    result = run_cli(*DIGITS, "--strategy", strategy, "--workers", "2", "--max-steps", "120", "--sync-every", "10",
                     "--eval-every", "60", *extra, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(out)
    # 1 % of each change a round, the rest fed back: the sparse run learns more slowly.
    assert series(records, "accuracy")[120] >= (0.85 if strategy == "diloco" else 0.75)
    # The server's rounds are the outer steps; a norm is charted for each.
    assert sorted(series(records, "outer_norm", rank=1)) == list(range(10, 121, 10))
    staleness = series(records, "outer_staleness", rank=1)
    assert sorted(staleness) == list(range(10, 121, 10)) and staleness[120] == 0
    if "--async-outer" in extra:
        # Within the bound H - 1 (how soon depends on the machine's load: the in-process tests
        # time it). An evaluation right after the send (30, 60, 90) waits.
        assert all(staleness[s] == 0 for s in (30, 60, 90))
        landed = sorted(staleness[s] for s in range(10, 120, 10) if s % 30)
        assert all(1 <= v <= 9 for v in landed), landed
    if "--outer-delay" in extra:
        # An evaluation due while an outer step is on its way (30, 60, 90) is taken after the
        # step it lands after, so the outer step keeps its overlap there as everywhere else.
        assert sorted(series(records, "accuracy")) == [15, 33, 45, 63, 75, 93, 105, 120]
        assert all(staleness[s] == 3 for s in range(10, 120, 10)), staleness
    sent = sum(r["value"] for r in records if r.get("name") == "bytes_sent" and r["rank"] == 1)
    dense_ps_step = 4 * sum(p.numel() for p in _digits_model().parameters())
    # H = 10 and half-width values (the small tensors stay fp32): over a twelfth less than a
    # dense PS run; top-k at 10 %: less still.
    assert sent < 120 * dense_ps_step / (12 if strategy == "diloco" else 25)


def _exchange_bytes(records: list[dict], rank: int) -> dict[int, float]:
    return {r["step"]: r["value"] for r in records if r.get("name") == "bytes_sent" and r["rank"] == rank}


def test_a_streaming_run_trains_the_digits_as_well_with_a_fraction_of_the_peak_exchange(tmp_path):
    records = {}
    for fragments in (1, 4):
        out = tmp_path / f"p{fragments}.jsonl"
        result = run_cli(*DIGITS, "--strategy", "diloco", "--workers", "2", "--max-steps", "120", "--sync-every", "12",
                         "--fragments", str(fragments), "--eval-every", "60", "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        records[fragments] = read_metrics(out)
    streamed, whole = records[4], records[1]
    assert series(streamed, "accuracy")[120] >= 0.85
    assert series(streamed, "accuracy")[120] >= series(whole, "accuracy")[120] - 0.05
    # A fragment's outer step every 3 steps (each fragment's every 12), all four at the last.
    assert sorted(series(streamed, "outer_norm", rank=1)) == list(range(3, 121, 3))
    # Each exchange carries a fragment: the peak a step falls about 4-fold (the dense tensors ride
    # with fragment 0), the total stays about the same.
    peak = {p: max(v for s, v in _exchange_bytes(records[p], 1).items() if 0 < s < 120) for p in records}
    total = {p: sum(_exchange_bytes(records[p], 1).values()) for p in records}
    assert peak[4] < 0.4 * peak[1], peak
    assert 0.8 * total[1] < total[4] < 1.25 * total[1], total


def _digits_model():
    from hybridtrain.tasks.digits import smallcnn

    return smallcnn(lr=0.1).model()


@pytest.mark.parametrize("extra", [[], ["--async-outer"]])
def test_a_joiner_of_a_diloco_run_waits_for_the_next_outer_step_and_ends_on_the_common_model(tmp_path, extra):
    # The others wait after step 5 until the server has the joiner's HELLO: it is admitted
    # after step 5 or 10, however long it takes to start.
    heard = tmp_path / "heard"
    (tmp_path / "train.py").write_text(held(SCRIPT, 5, heard))
    args = ["--strategy", "diloco", "--sync-every", "5", "--global-batch", "48", "--max-steps", "100",
            "--timeout-s", "60", "--code-dir", str(tmp_path), "--script", "train.py", *extra]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 5/", rank=3, cwd=tmp_path,
                                           heard=heard)
    joined = events(server.records(), EVENT_WORKER_JOINED)
    assert [e["subject"] for e in joined] == [3]
    results = {r: role.wait_for("RESULT") for r, role in roles.items()}
    assert len({line.split(" hash ")[1].split()[0] for line in results.values()}) == 1, results
    # It applied the next outer step with the others and computed from the inner step after it.
    first = min(series(roles[3].records(), "batch_size", rank=3))
    assert first == joined[0]["step"] + 5 + 1
    assert f"from step {first} " in joined[0]["detail"]


def test_a_joiner_of_a_streaming_run_takes_the_next_fragments_outer_step_and_ends_equal(tmp_path):
    heard = tmp_path / "heard"
    (tmp_path / "train.py").write_text(held(SCRIPT, 2, heard))
    # The weights (384 and 96 elements) go in 4 fragments; the biases ride with fragment 0.
    args = ["--strategy", "diloco", "--sync-every", "8", "--fragments", "4", "--dense-numel", "16",
            "--global-batch", "48", "--max-steps", "100", "--timeout-s", "60", "--code-dir", str(tmp_path),
            "--script", "train.py"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 2/", rank=3, cwd=tmp_path,
                                           heard=heard)
    joined = events(server.records(), EVENT_WORKER_JOINED)
    assert [e["subject"] for e in joined] == [3]
    results = {r: role.wait_for("RESULT") for r, role in roles.items()}
    assert len({line.split(" hash ")[1].split()[0] for line in results.values()}) == 1, results
    first = min(series(roles[3].records(), "batch_size", rank=3))
    assert first == next_sync(joined[0]["step"], 8, 100, 4) + 1 == joined[0]["step"] + 2 + 1
    assert f"from step {first} " in joined[0]["detail"]


@pytest.mark.parametrize("extra", [[], ["--async-outer"]])
def test_a_worker_leaving_a_diloco_run_between_outer_steps_drops_its_inner_steps_and_the_run_goes_on(tmp_path,
                                                                                                   extra):
    (tmp_path / "train.py").write_text(SCRIPT.replace("time.sleep(0.03)", "time.sleep(0.05)"))
    args = ["--strategy", "diloco", "--sync-every", "10", "--global-batch", "48", "--max-steps", "60",
            "--timeout-s", "60", "--code-dir", str(tmp_path), "--script", "train.py", *extra]
    server, workers, _ = start_ps_run(tmp_path, 2, args, cwd=tmp_path)
    try:
        server.wait_for("[ps] step 10/")
        workers[2].proc.send_signal(signal.SIGTERM)
        assert workers[2].wait() == 0, workers[2].output[-3000:]
        assert server.wait() == 0, server.output[-3000:]
        assert workers[1].wait() == 0, workers[1].output[-3000:]
    finally:
        stop_all(server, *workers.values())
    left = events(server.records(), EVENT_WORKER_LEFT)
    assert [e["subject"] for e in left] == [2]
    assert "inner steps since the outer step" in left[0]["detail"]
    assert " step 60 " in workers[1].wait_for("RESULT")


def _diloco_run(tmp_path, steps: int, *extra: str, name: str, overlap: tuple[str, ...] = ("--outer-delay", "0"),
                ) -> list[dict]:
    # Inner SGD without momentum at a constant rate: the inner optimizer holds no state, so a
    # resumed run can equal an uninterrupted one exactly; the outer momentum's velocity is the
    # state a resume must restore. fp32 values: the workers' error-feedback residuals of fp16
    # rounding are not checkpointed (as under the PS strategies), so fp16 would differ by them.
    # No outer delay: a run that ends applies its pending outer step at once, where one that goes
    # on applies it `delay` steps later, so the first run's last step is not the whole run's.
    args = ["--task", "hybridtrain.tasks.digits:smallcnn", "--global-batch", "48",
            "--task-args", '{"lr": 0.1, "momentum": 0.0, "schedule": "constant"}',
            "--strategy", "diloco", "--workers", "2", "--sync-every", "5", "--outer-momentum", "0.5",
            *overlap, "--eval-every", "1000", "--checkpoint-every", "7", "--value-dtype", "fp32", "--max-steps", str(steps),
            # A fixed split: local SGD's default re-splits from measured (so timing-dependent) compute.
            "--allocation", "equal"]
    proc = run_cli(*args, *extra, "--metrics-out", str(tmp_path / f"{name}.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(tmp_path / f"{name}.jsonl")


def test_a_diloco_run_checkpoints_at_outer_steps_and_resumes_with_its_outer_velocity(tmp_path):
    from trainer import checkpoint

    first = _diloco_run(tmp_path, 20, "--checkpoint-dir", str(tmp_path / "ck"), name="first")
    # Every 7 steps: asked at the first outer step past a multiple (10, past 7). Its worker
    # answers at the next outer step, when it next hears the server, and one checkpoint is on
    # its way at a time, so 15 (past 14) is skipped; the run's end takes 20.
    assert [e["step"] for e in events(first, "checkpoint")] == [10, 20]
    saved = torch.load(tmp_path / "ck" / "run-step-00000020.pt", weights_only=False)
    outer = checkpoint.from_bytes(saved["optimizer"])["outer"]
    assert outer["synced_step"] == 20 and outer["velocity"].abs().sum() > 0
    _diloco_run(tmp_path, 30, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", name="resumed")
    _diloco_run(tmp_path, 30, "--checkpoint-dir", str(tmp_path / "whole"), name="whole")
    resumed = torch.load(tmp_path / "ck" / "run-step-00000030.pt", weights_only=False)
    whole = torch.load(tmp_path / "whole" / "run-step-00000030.pt", weights_only=False)
    torch.testing.assert_close(resumed["params"], whole["params"], rtol=0, atol=1e-6)


def test_an_asynchronous_diloco_run_checkpoints_the_common_model_and_resumes_from_it(tmp_path):
    from trainer import checkpoint

    overlap = ("--async-outer",)
    first = _diloco_run(tmp_path, 20, "--checkpoint-dir", str(tmp_path / "ck"), name="first", overlap=overlap)
    # The outer step on its way is applied before the state is taken: the checkpoint holds the
    # common model of its step.
    assert [e["step"] for e in events(first, "checkpoint")] == [10, 20]
    saved = torch.load(tmp_path / "ck" / "run-step-00000010.pt", weights_only=False)
    assert checkpoint.from_bytes(saved["optimizer"])["outer"]["synced_step"] == 10
    resumed = _diloco_run(tmp_path, 30, "--checkpoint-dir", str(tmp_path / "ck"), "--resume", name="resumed",
                          overlap=overlap)
    assert [e["step"] for e in events(resumed, "checkpoint")] == [25, 30]
    assert min(series(resumed, "batch_size", rank=1)) == 21
    assert set(series(resumed, "outer_staleness", rank=1)) == {25, 30}


def test_a_streaming_run_resumes_from_its_checkpoint_with_every_fragment_on_the_common_model(tmp_path):
    from trainer import checkpoint

    first = _diloco_run(tmp_path, 20, "--fragments", "2", "--sync-every", "6", "--checkpoint-dir", str(tmp_path / "ck"),
                        name="first")
    assert [e["step"] for e in events(first, "checkpoint")][-1] == 20
    outer = checkpoint.from_bytes(torch.load(tmp_path / "ck" / "run-step-00000020.pt",
                                             weights_only=False)["optimizer"])["outer"]
    assert outer["synced"] == [20, 20]
    resumed = _diloco_run(tmp_path, 40, "--fragments", "2", "--sync-every", "6", "--checkpoint-dir",
                          str(tmp_path / "ck"), "--resume", name="resumed")
    assert [e["step"] for e in events(resumed, EVENT_RESUMED)] == [20]
    # Fragment 0 syncs after steps 3 + 6k, fragment 1 after 6k: the resumed rounds go on from 21.
    assert sorted(series(resumed, "outer_norm", rank=1)) == [21, 24, 27, 30, 33, 36, 39, 40]
    saved = torch.load(tmp_path / "ck" / "run-step-00000040.pt", weights_only=False)
    assert checkpoint.from_bytes(saved["optimizer"])["outer"]["synced"] == [40, 40]
    assert math.isfinite(series(resumed, "loss", rank=0)[40])
