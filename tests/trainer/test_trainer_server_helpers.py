"""The parameter server's helpers on their own (trainer.server holds them): each is built from
the run's config and the collaborators it acts on, here a real in-memory transport, without a
server."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from hybridtrain.contract import EVENT_CHECKPOINT, EVENT_WORKER_LEFT, EVENT_WORKER_LOST
from trainer import checkpoint
from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.departures import RESIDUAL_GONE, Departures
from trainer.donors import Donors
from trainer.compression import Payload
from trainer.frames import LAST_KINDS, Bye, Fetch, Grad, LayoutSpec, State, pack, unpack
from trainer.gathering import Gatherer
from trainer.joiner import Joiner
from trainer.late_changes import LateChanges
from trainer.membership import Member, Roster
from trainer.metrics import MetricsLogger
from trainer.planner import Planner, WorkerRow, worker_rows
from trainer.server import step_loss
from trainer.transport import InMemoryHub, Inbox

LAYOUT = LayoutSpec(names=("fc.weight", "fc.bias"), numels=(6, 2), dense_numel=2, buffer_numel=0)


class _Run:
    """A server's side of a run of `cfg`'s workers over an in-memory hub, its helpers wired as
    `ParameterServer` wires them; the metrics go to a file under `tmp_path`."""

    def __init__(self, cfg: TrainConfig, tmp_path: Path) -> None:
        self.cfg, self.hub = cfg, InMemoryHub(timeout_s=5)
        self.transport = self.hub.transport(0)
        self.ranks = list(range(1, cfg.workers + 1))
        self.inbox = Inbox(self.transport, self.ranks, timeout_s=5, last_kinds=LAST_KINDS)
        self.roster = Roster(cfg)
        for rank in self.ranks:
            self.roster.add(Member(rank))
        self.path = tmp_path / "metrics.jsonl"
        self.metrics = MetricsLogger(0, "ps", str(self.path))
        self.checkpoints = Checkpointer(cfg)
        self.departures = Departures(cfg, self.roster, self.transport, self.inbox, self.metrics, self.checkpoints)
        self.donors = Donors(cfg, self.roster, self.transport, self.inbox, self.departures)

    def events(self) -> list[dict]:
        return [r for r in map(json.loads, self.path.read_text().splitlines()) if "event" in r]


def test_a_lost_worker_leaves_the_roster_its_share_goes_to_the_others_and_the_event_says_what_is_gone(tmp_path):
    run = _Run(TrainConfig(strategy="ps-gc", workers=3, global_batch=48), tmp_path)
    run.departures.lose(2, TimeoutError(), 7)
    assert run.roster.ranks() == [1, 3] and 2 in run.departures.gone
    assert run.roster.batch_sizes[1] == 0 and sum(run.roster.batch_sizes) == 48
    (event,) = run.events()
    assert (event["event"], event["subject"], event["step"]) == (EVENT_WORKER_LOST, 2, 7)
    assert RESIDUAL_GONE in event["detail"]


def test_the_gatherer_lets_a_leaver_go_as_its_bye_arrives_and_returns_the_others_frames(tmp_path):
    run = _Run(TrainConfig(strategy="ps-gc", workers=2, global_batch=32), tmp_path)
    gatherer = Gatherer(run.cfg, run.roster, run.inbox, run.departures, run.checkpoints)
    run.hub.transport(2).send(0, pack(Bye(4, 2, leaving=True)))
    run.hub.transport(1).send(0, pack(Bye(4, 1)))
    got = gatherer.collect([1, 2], 4, first_s=5.0)
    assert list(got) == [1] and unpack(got[1][0]) == Bye(4, 1)
    assert run.roster.ranks() == [1]
    assert unpack(run.hub.transport(2).recv(0)) == Bye(4, 0)  # the server's goodbye to the leaver
    assert [e["event"] for e in run.events()] == [EVENT_WORKER_LEFT]


def _grad(rank: int, step: int) -> Grad:
    return Grad(step, rank, 0, 0.5, 16, 0.0, 0.0, 0.0, Payload(2, torch.ones(2)), Payload(0, torch.zeros(0)))


def test_a_round_closed_at_its_deadline_leaves_the_silent_worker_out_but_in_the_run(tmp_path):
    run = _Run(TrainConfig(strategy="diloco", workers=2, global_batch=32, asynchronous=True), tmp_path)
    late = LateChanges(lambda: 1)
    gatherer = Gatherer(run.cfg, run.roster, run.inbox, run.departures, run.checkpoints, late)
    run.hub.transport(1).send(0, pack(_grad(1, 4)))
    t0 = time.monotonic()
    first, frames, left_out = gatherer.gather_round(0, close_s=0.2)
    assert list(frames) == [1] and left_out == [2] and time.monotonic() - t0 < 2.0
    assert run.roster.ranks() == [1, 2] and not run.events()


def test_a_worker_left_out_and_silent_for_the_loss_deadline_since_is_lost(tmp_path):
    run = _Run(TrainConfig(strategy="diloco", workers=2, global_batch=32, asynchronous=True), tmp_path)
    late = LateChanges(lambda: 1)
    late.closed(4, [_grad(1, 4)], [2])
    late.missed_since[2] -= 100.0  # the loss deadline before any step is 30 s
    gatherer = Gatherer(run.cfg, run.roster, run.inbox, run.departures, run.checkpoints, late)
    run.hub.transport(1).send(0, pack(_grad(1, 8)))
    _, frames, left_out = gatherer.gather_round(4, close_s=0.2)
    assert list(frames) == [1] and left_out == [] and run.roster.ranks() == [1]
    assert [e["event"] for e in run.events()] == [EVENT_WORKER_LOST]


def test_a_late_change_met_while_gathering_a_round_is_taken_and_the_workers_next_frame_read(tmp_path):
    run = _Run(TrainConfig(strategy="diloco", workers=2, global_batch=32, asynchronous=True), tmp_path)
    late = LateChanges(lambda: 1)
    late.closed(4, [_grad(1, 4)], [2])
    gatherer = Gatherer(run.cfg, run.roster, run.inbox, run.departures, run.checkpoints, late)
    for rank, step in ((1, 8), (2, 4), (2, 8)):
        run.hub.transport(rank).send(0, pack(_grad(rank, step)))
    _, frames, left_out = gatherer.gather_round(4, close_s=5.0)
    assert {w: f.step for w, f in frames.items()} == {1: 8, 2: 8} and left_out == []
    assert list(late.parts) == [(2, 4)]


def test_a_scheduled_checkpoint_asks_a_live_worker_and_writes_its_answer(tmp_path):
    cfg = TrainConfig(strategy="ps-gc", workers=2, global_batch=32, checkpoint_every=5, checkpoint_dir=str(tmp_path))
    run = _Run(cfg, tmp_path)
    run.checkpoints.configure(LAYOUT)
    run.checkpoints.ask(5, run.donors, lambda: {"residual": None})
    assert unpack(run.hub.transport(1).recv(0)) == Fetch(5)
    worker = State(1, torch.arange(8, dtype=torch.float32), torch.zeros(0), 5, checkpoint.to_bytes({}))
    run.checkpoints.answer(1, worker)
    run.checkpoints.log_written(run.metrics, wait=True)
    assert [(e["event"], e["step"]) for e in run.events()] == [(EVENT_CHECKPOINT, 5)]
    assert torch.equal(checkpoint.read(checkpoint.latest(tmp_path), cfg)["params"], worker.params)


def test_a_planner_restores_its_plan_only_for_the_workers_it_was_made_for():
    cfg = TrainConfig(strategy="ps-bz-gc", workers=3, global_batch=60, allocation="measured")
    old = Roster(cfg)
    for rank in (1, 2, 3):
        old.add(Member(rank))
    old.densities, old.batch_sizes = [0.05, 0.02, 0.01], [30, 20, 10]
    state = Planner(cfg, old).state_dict()
    same, other = Roster(cfg), Roster(cfg)
    for rank in (1, 2, 3):
        same.add(Member(rank))
    for rank in (1, 3):
        other.add(Member(rank))
    Planner(cfg, same).load_state_dict(state)
    Planner(cfg, other).load_state_dict(state)
    assert (same.densities, same.batch_sizes) == ([0.05, 0.02, 0.01], [30, 20, 10])
    assert other.batch_sizes != [30, 20, 10]


def _site_frame(rows: list[tuple[float, ...]]) -> Grad:
    empty = Payload(0, torch.zeros(0))
    return Grad(10, int(rows[0][0]), 0, 1.0, sum(int(r[2]) for r in rows), 1.0, 0.0, 0.0, empty, empty, tuple(rows))


def test_a_sites_averaging_time_is_the_least_any_of_its_workers_reports():
    # Rank 2 waited 0.2 s for rank 1 besides the exchange; rank 1 waited for the exchange alone.
    site = _site_frame([(1, 1.0, 20, 2.0, 0.0, 0.05, 0.3), (2, 1.0, 20, 1.8, 0.0, 0.0, 0.5)])
    alone = _site_frame([(3, 1.0, 8, 2.0, 0.0, 0.0, 0.0)])
    assert [(r.rank, r.site_s) for r in worker_rows([site, alone])] == [(1, 0.3), (2, 0.3), (3, 0.0)]


def test_as_replicas_a_sites_workers_share_its_relays_compression_and_otherwise_keep_their_own():
    # The relay (rank 1) compresses the site's change at the outer step; its member waits for it.
    site = _site_frame([(1, 1.0, 20, 2.0, 0.0, 0.05, 0.3), (2, 1.0, 20, 1.8, 0.0, 0.0, 0.5)])
    assert [r.topk_s for r in worker_rows([site], replicas=True)] == [0.05, 0.05]
    assert [r.topk_s for r in worker_rows([site])] == [0.05, 0.0]  # per-site aggregation: each its own


def test_the_re_split_moves_samples_away_from_the_site_whose_averaging_takes_longer():
    # Two sites of two workers, equally fast, the same split; site B's averaging takes 0.4 s a
    # round longer, so its workers get fewer samples and the sites reach the outer step together.
    cfg = TrainConfig(strategy="diloco", workers=4, global_batch=80, allocation="measured", rebalance_every=1)
    roster = Roster(cfg)
    for rank in (1, 2, 3, 4):
        roster.add(Member(rank))
    roster.batch_sizes = [20, 20, 20, 20]
    a = _site_frame([(1, 1.0, 20, 2.0, 0.0, 0.0, 0.2), (2, 1.0, 20, 2.0, 0.0, 0.0, 0.2)])
    b = _site_frame([(3, 1.0, 20, 2.0, 0.0, 0.0, 0.6), (4, 1.0, 20, 2.0, 0.0, 0.0, 0.6)])
    Planner(cfg, roster).plan(10, worker_rows([a, b]), {}, densities=False)
    # 10 samples/s each: 22 / 10 + 0.2 = 18 / 10 + 0.6 = 2.4 s a round.
    assert roster.batch_sizes == [22, 22, 18, 18]


def test_a_steps_loss_weighs_each_workers_loss_by_its_samples():
    rows = [WorkerRow(1, 2.0, 30, 0.1, 0.0, 0.0), WorkerRow(2, 4.0, 10, 0.1, 0.0, 0.0)]
    assert step_loss(rows) == 2.5
    assert math.isnan(step_loss([*rows, WorkerRow(3, math.nan, 10, 0.1, 0.0, 0.0)]))


def test_a_joiner_computes_from_the_step_after_the_next_update_it_applies(tmp_path):
    # Streaming's next outer step is the next fragment's: with H = 20 and 4 fragments, step 15's.
    for strategy, extra, first in (("ps-gc", {}, 12), ("diloco", {"sync_every": 4}, 13),
                                   ("diloco", {"sync_every": 20, "fragments": 4}, 16)):
        run = _Run(TrainConfig(strategy=strategy, workers=2, global_batch=32, **extra), tmp_path)
        joiner = Joiner(run.cfg, run.roster, run.transport, run.inbox, run.metrics, run.departures, run.donors,
                        run.checkpoints)
        assert joiner.first_step_of_joiner(10, 100, LAYOUT) == first, (strategy, extra)
