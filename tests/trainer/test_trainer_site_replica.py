"""Sites as replicas (`--site-replicas`, trainer.site_replica): a site's workers average their
gradients every inner step through the site's relay and hold one replica; one change per site
crosses to the server every H steps. The pure pieces, whole runs in one process, and runs on
real processes over loopback."""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn.functional as F
from trainer_testing import (
    RankLost,
    Role,
    adamw,
    config,
    events,
    flat_parameters,
    global_batch,
    plain_sgd,
    run_in_process,
    start_ps_run,
    stop_all,
    tiny_data,
    tiny_mlp,
)

from hybridtrain.contract import EVENT_WORKER_JOINED
from trainer.algorithm import aggregate
from trainer.cli import UsageError, build_parser, config_from_args
from trainer.compression import Identity, Payload
from trainer.departures import Departures
from trainer.frames import BYE, Grad, Route, Welcome, pack, unpack
from trainer.relay import SERVER
from trainer.planner import worker_rows
from trainer.server import ParameterServer
from trainer.site_combine import SiteCombiner
from trainer.site_relay import SiteRelay
from trainer.site_replica import PIECE, SiteReplica, pieces, site_mean
from trainer.transport import InMemoryHub, InMemoryTransport, Inbox

# The server and ranks 1, 2 at "home", ranks 3, 4 "away": two sites of two, each a replica,
# with ranks 1 and 3 their relays.
SITES = ("home", "home", "home", "away", "away")
SITE_OF = {1: "home", 2: "home", 3: "away", 4: "away"}


# -- the pure pieces ------------------------------------------------------------------------------


def test_the_sites_mean_weights_each_workers_gradient_by_its_samples():
    # 10 and 30 samples: weights 1/4 and 3/4.
    mean = site_mean([(10, torch.tensor([4.0, 0.0, 2.0])), (30, torch.tensor([0.0, 4.0, 2.0]))])
    assert mean.tolist() == [1.0, 3.0, 2.0]


def test_the_mean_of_a_site_of_one_is_its_gradient():
    g = torch.tensor([0.25, -3.0])
    assert torch.equal(site_mean([(7, g)]), g)


def test_a_site_mean_without_samples_is_refused():
    with pytest.raises(ValueError, match="samples"):
        site_mean([(0, torch.zeros(2))])


def test_the_gradient_travels_in_pieces_of_at_most_a_piece_that_tile_it():
    bounds = pieces(2 * PIECE + 5)
    assert len(bounds) == 3 and bounds[0][0] == 0 and bounds[-1][1] == 2 * PIECE + 5
    assert all(a == b for (_, a), (b, _) in zip(bounds, bounds[1:]))
    assert max(b - a for a, b in bounds) <= PIECE
    assert pieces(10) == ((0, 10),)


def _change(sender: int, samples: int, values: list[float]) -> Grad:
    """A worker's outer-step change, uncompressed (its relay compresses the site's once)."""
    v = torch.tensor(values)
    return Grad(8, sender, 0, 0.5, samples, 0.1, 0.0, 0.0, Payload(0, torch.zeros(0)), Payload(v.numel(), v))


def _site_frame(relay: int, own: Grad, members: list[Grad]) -> Grad:
    """What a site's relay sends the server at an outer step: its members' changes combined with its own."""
    hub = InMemoryHub(timeout_s=5.0)
    inbox = Inbox(hub.transport(relay), [m.sender for m in members], timeout_s=5.0, last_kinds=frozenset({BYE}))
    for m in members:
        hub.transport(m.sender).send(relay, pack(m))
    combiner = SiteCombiner(relay, tuple(m.sender for m in members), [(0, 2)], Identity(), seed=0)
    return combiner.combine(own, inbox, density=1.0, dense_step=True, wait_s=5.0)


def test_the_server_averages_one_change_per_site_weighted_by_each_sites_samples():
    # A site's workers hold one replica, so its members' changes are its relay's: "home" did 10 +
    # 30 samples since the last outer step, "away" 10 + 10. Each relay's frame counts its site's.
    home = _site_frame(1, _change(1, 10, [2.0, -2.0]), [_change(2, 30, [2.0, -2.0])])
    away = _site_frame(3, _change(3, 10, [4.0, 8.0]), [_change(4, 10, [4.0, 8.0])])
    assert (home.samples, away.samples) == (40, 20)
    assert home.sparse.values.tolist() == [2.0, -2.0] and away.sparse.values.tolist() == [4.0, 8.0]
    _, mean = aggregate([home, away], 0, 2)
    # (40 * (2, -2) + 20 * (4, 8)) / 60
    torch.testing.assert_close(mean, torch.tensor([8 / 3, 4 / 3]))
    # The server still plans from every worker's own figures.
    assert [int(r[0]) for r in home.members] == [1, 2] and [int(r[2]) for r in away.members] == [10, 10]


def test_site_replicas_take_a_local_sgd_strategy_and_sites():
    parser = build_parser()
    with pytest.raises(UsageError, match="--site-replicas"):
        config_from_args(parser.parse_args(["--strategy", "ps-bz-gc", "--site-replicas", "--workers", "4",
                                            "--sites", ",".join(SITES)]))
    with pytest.raises(UsageError, match="give --sites"):
        config_from_args(parser.parse_args(["--strategy", "diloco", "--site-replicas", "--workers", "4"]))
    cfg = config_from_args(parser.parse_args(["--strategy", "diloco-gc", "--site-replicas", "--workers", "4",
                                              "--sites", ",".join(SITES)]))
    assert cfg.site_replicas and cfg.combines_at_sites and not cfg.site_aggregation


def _relay_of(members: tuple[int, ...]) -> SiteRelay:
    """Rank 3, the "away" site's relay for `members`, as its WELCOME makes it (H = 5)."""
    hub = InMemoryHub(timeout_s=5.0)
    relay = SiteRelay(_config(sync_every=5), 3, hub.transport(3), ((0, 8),))
    relay.inbox = Inbox(hub.transport(3), [SERVER], timeout_s=5.0, last_kinds=frozenset({BYE}))
    relay.take_welcome(Welcome((12, 12, 12, 12), (0.1,) * 4, 100, forwards=members))
    return relay


def test_a_joiner_routed_behind_a_relay_joins_its_sites_exchange_after_the_next_outer_step():
    relay = _relay_of((4,))
    # Admitted after step 10: it applies outer step 15 with the others and computes from 16.
    relay.on_frame(SERVER, pack(Route(10, (4, 5))))
    relay.admit_joiners(15)
    assert relay.site == (4,)
    relay.admit_joiners(16)
    assert relay.site == (4, 5)


def test_a_member_its_relay_left_out_is_no_joiner_while_the_server_still_routes_it():
    relay = _relay_of((4, 5))
    relay.leave_out(4)
    relay.on_frame(SERVER, pack(Route(10, (4, 5, 6))))  # rank 6 joins; 4 is not dropped yet
    relay.admit_joiners(16)
    assert relay.site == (5, 6)


def test_a_joiner_the_server_drops_before_its_first_step_never_joins():
    relay = _relay_of((4,))
    relay.on_frame(SERVER, pack(Route(10, (4, 5))))
    relay.on_frame(SERVER, pack(Route(12, (4,))))
    relay.admit_joiners(16)
    assert relay.site == (4,)


# -- whole runs in one process ----------------------------------------------------------------------


def _config(strategy: str = "diloco", **options):
    return config(**({"strategy": strategy, "workers": 4, "global_batch": 48, "sites": SITES, "site_replicas": True,
                      "dense_numel": 100} | options))


def test_with_h_1_and_an_outer_sgd_of_rate_1_site_replicas_equal_synchronous_sgd_on_the_global_batch():
    cfg = _config(sync_every=1, outer_lr=1.0, outer_momentum=0.0, value_dtype="fp32", allocation="equal", max_steps=4)
    data = tiny_data()
    run = run_in_process(cfg, 4, data=data, optimizer=plain_sgd)
    ref = tiny_mlp()
    opt = plain_sgd(ref)
    for step in range(1, 5):
        x, y = global_batch(data, step, [12] * 4, cfg.seed)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for model in run.models:
        torch.testing.assert_close(flat_parameters(model), flat_parameters(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy, options", [("diloco", {}), ("diloco-gc", {}), ("diloco", {"outer_delay": 2}),
                                               ("diloco-gc", {"pipeline_chunks": 2, "outer_delay": 1})],
                         ids=["diloco", "diloco-gc", "overlapped", "gc-chunked-overlapped"])
def test_a_sites_workers_are_identical_after_every_inner_step_and_the_sites_meet_at_outer_steps(strategy, options):
    cfg = _config(strategy, sync_every=4, max_steps=10, **options)
    snapshots: dict[tuple[int, int], torch.Tensor] = {}
    run_in_process(cfg, 10, optimizer=adamw,
                   after_step=lambda rank, step, run: snapshots.__setitem__((rank, step), flat_parameters(run.models[rank - 1])))
    for step in range(1, 11):
        assert torch.equal(snapshots[(1, step)], snapshots[(2, step)]), step
        assert torch.equal(snapshots[(3, step)], snapshots[(4, step)]), step
        # Overlapped, an outer step lands `outer_delay` steps late, on top of the steps since.
        meet = (4, 8, 10) if not options.get("outer_delay") else (10,)
        assert torch.equal(snapshots[(1, step)], snapshots[(3, step)]) == (step in meet), step


def test_each_outer_step_tells_the_server_how_long_each_site_averaged_over_its_round(monkeypatch):
    # The away site's member (rank 4) takes 20 ms longer to exchange each inner step.
    exchange = SiteReplica._exchange

    def slow_away(self, step, samples):
        if self.rank == 4:
            time.sleep(0.02)
        exchange(self, step, samples)

    seen: dict[tuple[int, int], float] = {}
    aggregate_ = ParameterServer.aggregate

    def spy(self, step, grads, chunk, arrival=None):
        seen.update({(step, r.rank): r.site_s for r in worker_rows(grads)})
        return aggregate_(self, step, grads, chunk, arrival)

    monkeypatch.setattr(SiteReplica, "_exchange", slow_away)
    monkeypatch.setattr(ParameterServer, "aggregate", spy)
    run_in_process(_config(sync_every=4, max_steps=8), 8, optimizer=adamw)
    for step in (4, 8):  # a round of four inner steps: the away site's relay waited for it each
        assert seen[(step, 3)] == seen[(step, 4)] >= 4 * 0.02, seen
        assert seen[(step, 1)] == seen[(step, 2)] < seen[(step, 3)], seen


@pytest.mark.parametrize("value_dtype, bf16", [("fp16", True), ("fp32", False)])
def test_a_sites_mean_crosses_its_lan_in_bf16_unless_the_runs_values_are_fp32(value_dtype, bf16):
    cfg = _config(sync_every=4, max_steps=2, value_dtype=value_dtype)
    grads: dict[int, torch.Tensor] = {}
    run_in_process(cfg, 1, optimizer=adamw,
                   after_step=lambda rank, step, run: grads.__setitem__(rank, run.clients[rank - 1].flat.grad.clone()))
    # The relay (rank 1) steps on the mean it sent its member (rank 2), rounded as sent.
    assert torch.equal(grads[1], grads[2])
    assert torch.equal(grads[1], grads[1].to(torch.bfloat16).float()) == bf16


def test_the_server_hears_one_frame_per_site_per_outer_step_and_a_member_only_its_relay():
    cfg = _config(sync_every=3, max_steps=9)
    run = run_in_process(cfg, 9, optimizer=adamw)
    sent = run.hub.sent
    outer = 3
    # Relays: HELLO, one frame per outer step, BYE (rank 1 also the starting weights).
    assert sent[(1, SERVER)] == 1 + 1 + outer + 1 and sent[(3, SERVER)] == 1 + outer + 1
    # Members: HELLO and BYE to the server; to their relay a piece a step, their change at each
    # outer step, and BYE.
    assert sent[(2, SERVER)] == sent[(4, SERVER)] == 2
    assert sent[(2, 1)] == sent[(4, 3)] == 9 + outer + 1
    # Back: the server's update once per site, with WELCOME and BYE (and rank 1's starting
    # weights to the others); the relay sends a mean a step, the update and BYE on.
    assert sent[(SERVER, 1)] == 1 + outer + 1 and sent[(SERVER, 3)] == 2 + outer + 1
    assert sent[(SERVER, 2)] == sent[(SERVER, 4)] == 3
    assert sent[(1, 2)] == sent[(3, 4)] == 9 + outer + 1
    assert not any(sent.get((a, b)) for a in (1, 2) for b in (3, 4))  # nothing between the sites


class _DiesAtStep(InMemoryTransport):
    """A rank lost just before it sends anything of inner step `step` (its thread ends quietly)."""

    def __init__(self, rank: int, hub: InMemoryHub, *, step: int) -> None:
        super().__init__(rank, hub)
        self.step, self.dead = step, False

    def send(self, peer: int, frame: torch.Tensor) -> None:
        f = unpack(frame)
        if self.dead or getattr(f, "step", 0) >= self.step and not hasattr(f, "reason"):
            self.dead = True
            raise RankLost
        super().send(peer, frame)


def _dies(rank: int, step: int):
    return lambda hub, r: _DiesAtStep(r, hub, step=step) if r == rank else hub.transport(r)


def _samples_per_outer_step(monkeypatch) -> dict[int, int]:
    """step -> the samples the server's aggregate of that outer step counted, once the run is over."""
    seen: dict[int, int] = {}
    aggregate_ = ParameterServer.aggregate

    def spy(self, step, grads, chunk, arrival=None):
        seen[step] = sum(g.samples for g in grads)
        return aggregate_(self, step, grads, chunk, arrival)

    monkeypatch.setattr(ParameterServer, "aggregate", spy)
    return seen


def test_a_lost_member_is_left_out_by_its_relay_and_dropped_by_the_server_at_the_next_outer_step(monkeypatch):
    seen = _samples_per_outer_step(monkeypatch)
    cfg = _config(sync_every=4, max_steps=10, allocation="equal")
    run = run_in_process(cfg, 10, optimizer=adamw, transport=_dies(4, 6))
    assert 4 not in run.server.roster
    # Step 8's "away" frame counts its relay's four inner steps alone; from step 9 the batch of
    # 48 is split over the three left.
    assert seen == {4: 4 * 48, 8: 4 * 24 + 4 * 12, 10: 2 * 48}
    flats = [flat_parameters(run.models[r - 1]) for r in (1, 2, 3)]
    assert all(torch.equal(flats[0], f) for f in flats[1:])  # the run ends on the common model


def test_a_lost_relay_leaves_its_member_training_alone_through_the_server(monkeypatch):
    seen = _samples_per_outer_step(monkeypatch)
    cfg = _config(sync_every=4, max_steps=10, allocation="equal")
    run = run_in_process(cfg, 10, optimizer=adamw, transport=_dies(3, 6))
    assert 3 not in run.server.roster and 4 in run.server.roster
    member = next(c for c in run.clients if c.rank == 4)
    assert member.relay.up == SERVER and member.relay.update_source == SERVER
    # Rank 4 sends step 8's change itself: its four inner steps, the last three on its own gradient.
    assert seen == {4: 4 * 48, 8: 4 * 24 + 4 * 12, 10: 2 * 48}
    flats = [flat_parameters(run.models[r - 1]) for r in (1, 2, 4)]
    assert all(torch.equal(flats[0], f) for f in flats[1:])


def test_a_member_leaving_between_outer_steps_is_let_go_at_the_next_and_its_site_trains_on(monkeypatch):
    seen = _samples_per_outer_step(monkeypatch)
    lost: list[int] = []
    lose = Departures.lose
    monkeypatch.setattr(Departures, "lose", lambda self, rank, *a, **k: (lost.append(rank), lose(self, rank, *a, **k)))

    def leave_after_6(rank: int, step: int, run) -> None:
        if rank == 4 and step == 6:
            run.clients[3].leave()  # a spot notice: returns once the server has let it go
            raise RankLost

    cfg = _config(sync_every=4, max_steps=10, allocation="equal")
    run = run_in_process(cfg, 10, optimizer=adamw, after_step=leave_after_6)
    assert 4 not in run.server.roster and lost == []
    # Its steps 5 and 6 are in its site's replica; step 8's frame counts its relay's samples.
    assert seen == {4: 4 * 48, 8: 4 * 24 + 4 * 12, 10: 2 * 48}
    flats = [flat_parameters(run.models[r - 1]) for r in (1, 2, 3)]
    assert all(torch.equal(flats[0], f) for f in flats[1:])


# -- real processes over loopback -------------------------------------------------------------------

# A user's loop that prints its replica's hash after every step and saves its final weights.
SCRIPT = """
import hashlib
import torch, torch.nn.functional as F
import hybridtrain as ht
from torch.utils.data import TensorDataset

ctx = ht.init()
torch.manual_seed(0)
model = ht.prepare_model(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
g = torch.Generator().manual_seed(0)
x = torch.randn(480, 12, generator=g)
data = TensorDataset(x, (x @ torch.randn(12, 3, generator=g)).argmax(1))
while ctx.step < ctx.max_steps:
    for xb, yb in ht.data_loader(data):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        print(f"PARAMS {ctx.rank} {ctx.step} {hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]}", flush=True)
torch.save(flat, f"final-{ctx.rank}.pt")
"""


def _script_data() -> tuple[torch.nn.Module, torch.utils.data.TensorDataset]:
    """SCRIPT's model and data, built the same way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(480, 12, generator=g)
    return model, torch.utils.data.TensorDataset(x, (x @ torch.randn(12, 3, generator=g)).argmax(1))


def _sites_run(tmp_path, *extra: str) -> tuple[list[dict], dict[int, dict[int, str]]]:
    """SCRIPT on two sites of two workers as separate processes, each outer step applied at once:
    the server's records and each worker's replica hash by step."""
    (tmp_path / "train.py").write_text(SCRIPT)
    args = ["--strategy", "diloco", "--site-replicas", "--sites", ",".join(SITES), "--global-batch", "48",
            "--allocation", "equal", "--outer-delay", "0", "--eval-every", "1000", "--timeout-s", "60",
            "--code-dir", str(tmp_path), "--script", "train.py", *extra]
    server, workers, _ = start_ps_run(tmp_path, 4, args, cwd=tmp_path)
    try:
        assert server.wait() == 0, server.output[-3000:]
        for role in workers.values():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *workers.values())
    hashes = {r: {int(s): h for s, h in re.findall(rf"PARAMS {r} (\d+) ([0-9a-f]{{16}})", role.output)}
              for r, role in workers.items()}
    return server.records(), hashes


def test_site_replicas_with_h_1_and_outer_rate_1_on_real_processes_equal_synchronous_sgd(tmp_path):
    _sites_run(tmp_path, "--sync-every", "1", "--outer-lr", "1", "--value-dtype", "fp32", "--max-steps", "6")
    ref, data = _script_data()
    opt = plain_sgd(ref)
    for step in range(1, 7):
        x, y = global_batch(data, step, [12] * 4, 0)
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
    for rank in (1, 2, 3, 4):
        torch.testing.assert_close(torch.load(tmp_path / f"final-{rank}.pt"), flat_parameters(ref), rtol=1e-5, atol=1e-6)


def test_on_real_processes_a_sites_workers_are_one_replica_and_each_site_crosses_once_per_outer_step(tmp_path):
    records, hashes = _sites_run(tmp_path, "--sync-every", "3", "--max-steps", "9")
    for step in range(1, 10):
        assert hashes[1][step] == hashes[2][step] and hashes[3][step] == hashes[4][step], step
        assert (hashes[1][step] == hashes[3][step]) == (step in (3, 6, 9)), step
    numel = sum(p.numel() for p in _script_data()[0].parameters())
    received = {(r["step"], r["peer"]): r["value"] for r in records
                if r.get("name") == "bytes_recv" and r["rank"] == 0}
    for step in range(1, 10):
        for relay in (1, 3):
            got = received.get((step, relay), 0)
            # One change for the site at an outer step (the small model travels fp32), else nothing.
            assert (numel * 4 <= got < 2 * numel * 4) if step % 3 == 0 else got == 0, (step, relay, got)
        # A relay's members send the server nothing while training: their HELLO, then their BYE.
        assert all(received.get((step, m), 0) == 0 if step < 9 else received[(step, m)] < 64 for m in (2, 4)), step


def test_a_joiner_joins_its_sites_replica_from_the_step_after_the_next_outer_step(tmp_path):
    # Rank 5 joins "away" mid-run: it takes the state of that site's relay (rank 3), its inner
    # optimizer's momentum included, and from its first step holds the site's replica. Steps
    # are slow until the joiner has a share, however long its process takes to start.
    slow = "        time.sleep(0.03 if sum(1 for n in ctx.batch_sizes if n) > 4 else 0.2)\n"
    (tmp_path / "train.py").write_text(SCRIPT.replace("lr=0.1)", "lr=0.1, momentum=0.9)")
                                       .replace("        opt.step()\n", "        opt.step()\n" + slow)
                                       .replace("import hashlib", "import hashlib, time"))
    # Without an outer delay: a joiner starts from the common model, its site D inner steps on.
    args = ["--strategy", "diloco", "--site-replicas", "--global-batch", "48", "--allocation", "equal",
            "--sync-every", "5", "--outer-delay", "0", "--max-steps", "100", "--eval-every", "1000", "--timeout-s", "60",
            "--code-dir", str(tmp_path), "--script", "train.py"]
    server, workers, port = start_ps_run(tmp_path, 4, [*args, "--sites", ",".join(SITES)], cwd=tmp_path)
    try:
        server.wait_for("[ps] step 5/")
        workers[5] = Role("worker", 5, 6, port, [*args, "--sites", ",".join((*SITES, "away")), "--join"],
                          metrics=tmp_path / "rank5.jsonl", cwd=tmp_path)
        assert server.wait() == 0, server.output[-3000:]
        for role in workers.values():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *workers.values())
    joined = events(server.records(), EVENT_WORKER_JOINED)
    assert [e["subject"] for e in joined] == [5] and "state of worker 3" in joined[0]["detail"]
    hashes = {r: {int(s): h for s, h in re.findall(rf"PARAMS {r} (\d+) ([0-9a-f]{{16}})", role.output)}
              for r, role in workers.items()}
    first = min(hashes[5])
    assert first == joined[0]["step"] + 5 + 1 and max(hashes[5]) == 100
    assert all(hashes[5][s] == hashes[3][s] == hashes[4][s] for s in range(first, 101))
    assert hashes[5][100] == hashes[1][100]
