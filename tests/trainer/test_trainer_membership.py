"""The roster of an elastic run: who is in, their batch shares after a change, where their
updates come from, and how long a silent worker has before it counts as lost."""

from __future__ import annotations

from hybridtrain.contract import proportional_batch_sizes
from trainer.config import TrainConfig
from trainer.membership import LOSS_FLOOR_S, Member, Roster
from trainer.relay import SERVER


def _roster(**options) -> Roster:
    cfg = TrainConfig(**({"strategy": "ps-bz-gc", "workers": 3, "global_batch": 60} | options))
    roster = Roster(cfg)
    for rank in range(1, cfg.workers + 1):
        speed = cfg.speeds[rank - 1] if cfg.speeds else None
        roster.add(Member(rank, speed))
    return roster


def test_a_lost_workers_share_is_split_over_the_survivors_by_their_speeds():
    roster = _roster(speeds=(3.0, 1.0, 2.0), allocation="flops")
    roster.remove(3)
    roster.resplit()
    assert roster.batch_sizes == [45, 15, 0]


def test_under_measured_allocation_the_split_follows_measured_samples_per_second():
    roster = _roster(allocation="measured")
    roster.note_rates([(1, 20, 0.1), (2, 20, 0.4), (3, 20, 0.2)])  # 200, 50, 100 samples/s
    roster.remove(3)
    roster.resplit()
    assert roster.batch_sizes == [*proportional_batch_sizes(60, [200.0, 50.0]), 0]


def test_a_joiner_without_a_measurement_is_scaled_from_its_given_speed():
    roster = _roster(allocation="measured", speeds=(1.0, 1.0, 1.0))
    roster.note_rates([(1, 20, 0.1), (2, 20, 0.1), (3, 20, 0.1)])  # 200 samples/s each at speed 1
    roster.add(Member(7, speed=2.0))
    roster.resplit()
    assert roster.batch_sizes == [12, 12, 12, 0, 0, 0, 24]


def test_equal_allocation_splits_equally_over_whoever_is_in():
    roster = _roster(allocation="equal")
    roster.remove(2)
    roster.resplit()
    assert roster.batch_sizes == [30, 0, 30]


def test_a_lost_relays_site_peers_hear_the_server_directly():
    roster = _roster(workers=4, sites=("home", "home", "away", "away", "away"), global_batch=64)
    assert [roster.source(r) for r in (1, 2, 3, 4)] == [SERVER, SERVER, 2, 2]
    assert roster.remove(2) == [3, 4]
    assert [roster.source(r) for r in (3, 4)] == [SERVER, SERVER]
    assert roster.update_targets() == [1, 3, 4]


def test_a_joiner_computes_only_after_catching_up():
    roster = _roster()
    roster.add(Member(4, joining=True))
    assert roster.senders() == [1, 2, 3]
    assert 4 in roster.update_targets()


def test_the_loss_deadline_follows_the_step_time_with_a_floor():
    roster = _roster()
    for seconds in (0.1, 0.2, 0.15):
        roster.note_step(seconds)
    assert roster.loss_deadline_s() == LOSS_FLOOR_S
    for _ in range(20):
        roster.note_step(4.0)
    assert roster.loss_deadline_s() == 12.0


def test_the_donor_is_a_worker_in_the_servers_site():
    roster = Roster(TrainConfig(strategy="ps", workers=3, sites=("home", "away", "home", "away")))
    for rank, site in ((1, "away"), (2, "home"), (3, "away")):
        roster.add(Member(rank, site=site))
    assert roster.donor() == 2
