"""The roster of an elastic run: who is in, their batch shares after a change, where their
updates come from, and how long a silent worker has before it counts as lost."""

from __future__ import annotations

import pytest

from hybridtrain.contract import proportional_batch_sizes
from trainer.config import TrainConfig
from trainer.membership import LOSS_FLOOR_S, Member, Roster, relay_wait_s
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


def test_without_speeds_a_lost_workers_share_is_split_in_the_plans_proportions():
    # The control plane launches with its split (--batch-sizes) and no --speeds.
    roster = _roster(workers=4, global_batch=320, batch_sizes=(119, 106, 48, 47))
    roster.remove(4)
    roster.resplit()
    assert roster.batch_sizes == [*proportional_batch_sizes(320, [119.0, 106.0, 48.0]), 0]


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


def _sited(sites: tuple[str, ...], **options) -> Roster:
    roster = Roster(TrainConfig(**({"strategy": "ps", "workers": len(sites) - 1, "sites": sites} | options)))
    for rank in range(1, len(sites)):
        roster.add(Member(rank, site=sites[rank]))
    return roster


def test_a_joiner_in_a_remote_site_is_routed_behind_that_sites_relay():
    roster = _sited(("home", "home", "away", "away"))
    relay = roster.relay_for("away")
    roster.add(Member(4, site="away", joining=True, relay=relay))
    assert relay == 2
    assert roster.source(4) == 2 and roster.forwards(2) == (3, 4)
    assert 4 not in roster.update_targets()


def test_a_joiner_hears_the_server_in_its_own_site_without_sites_and_under_site_aggregation():
    assert _sited(("home", "home", "away", "away")).relay_for("home") is None
    assert _sited(("home", "home", "away", "away"), site_aggregation=True).relay_for("away") is None
    assert _sited(("home", "home", "away", "away")).relay_for("elsewhere") is None


def test_after_its_sites_relay_is_lost_a_joiner_is_routed_behind_an_orphan_that_hears_the_server():
    roster = _sited(("home", "home", "away", "away", "away"))
    roster.remove(2)
    assert roster.relay_for("away") == 3


def test_a_relayed_joiner_hears_the_server_once_its_relay_is_lost():
    roster = _sited(("home", "home", "away", "away"))
    roster.add(Member(4, site="away", relay=roster.relay_for("away")))
    assert roster.remove(2) == [3, 4]
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
    assert roster.loss_deadline_s() == 4.0  # a step time: a loss is noticed within two of the fault


def test_the_loss_deadline_waits_a_step_beyond_the_workers_usual_spread():
    # An equal split over GPUs 2.5x apart: the slow worker's frames come 2.4 s after the fast one's.
    roster = _roster()
    for fast, slow in ((1.6, 4.0), (1.5, 3.9), (1.6, 4.1)):
        roster.note_step(4.2)
        roster.note_spread([fast, slow, slow])
    assert roster.loss_deadline_s() == pytest.approx(4.2 + 2.5)


def test_a_relay_gives_up_on_its_members_before_the_server_gives_up_on_the_relay():
    roster = _roster()
    for _ in range(5):
        roster.note_step(4.0)
        roster.note_spread([3.9, 4.0])
    assert relay_wait_s(roster.step_s, 60.0) == 3.0
    assert relay_wait_s([0.2], 60.0) == 1.0 < LOSS_FLOOR_S
    assert relay_wait_s(roster.step_s, 60.0) < roster.loss_deadline_s()


def test_a_joiners_first_step_is_held_to_the_starts_deadline_then_to_the_step_time():
    roster = _roster()
    for _ in range(5):
        roster.note_step(4.0)
    roster.add(Member(4, joining=True))
    assert roster.loss_deadline_s() == 4.0  # still catching up: it sends no gradient this step
    roster.caught_up()
    assert 4 in roster.senders()
    assert roster.loss_deadline_s() == roster.cfg.timeout_s / 10
    roster.note_step(4.0)
    assert roster.loss_deadline_s() == 4.0


def test_the_donor_is_a_worker_in_the_servers_site():
    roster = Roster(TrainConfig(strategy="ps", workers=3, sites=("home", "away", "home", "away")))
    for rank, site in ((1, "away"), (2, "home"), (3, "away")):
        roster.add(Member(rank, site=site))
    assert roster.donor() == 2


def test_under_site_replicas_a_joiner_joins_its_sites_replica_behind_its_relay_the_servers_site_too():
    roster = _sited(("home", "home", "home", "away", "away"), strategy="diloco", site_replicas=True)
    assert [roster.source(r) for r in (1, 2, 3, 4)] == [SERVER, 1, SERVER, 3]
    assert (roster.relay_for("home"), roster.relay_for("away")) == (1, 3)
    assert roster.senders() == [1, 3]


def test_under_site_replicas_a_joiner_takes_its_state_from_its_own_sites_relay():
    # The inner optimizer's state is its site replica's; the other site's would set it apart.
    roster = _sited(("home", "home", "home", "away", "away"), strategy="diloco", site_replicas=True)
    assert (roster.donor("away"), roster.donor("home"), roster.donor()) == (3, 1, 1)
    assert _sited(("home", "home", "away", "away")).donor("away") == 1  # otherwise the server's site's
