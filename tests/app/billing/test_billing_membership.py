"""A node is billed only while one of its ranks was part of the run."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.billing.membership import MembershipChange, rank_spans, union_seconds

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_a_rank_without_membership_changes_spans_its_start_to_its_end():
    assert rank_spans(at(0), at(30), [], end=at(60)) == [(at(0), at(30))]


def test_a_rank_still_running_is_held_until_the_bills_end():
    assert rank_spans(at(5), None, [], end=at(60)) == [(at(5), at(60))]


def test_a_lost_rank_stops_counting_at_its_loss_even_if_its_process_lives_on():
    spans = rank_spans(at(0), at(50), [MembershipChange(at(20), "worker_lost")], end=at(60))
    assert spans == [(at(0), at(20))]


def test_a_rank_that_rejoins_counts_again_from_its_join():
    changes = [MembershipChange(at(10), "worker_lost"), MembershipChange(at(25), "worker_joined")]
    assert rank_spans(at(0), None, changes, end=at(60)) == [(at(0), at(10)), (at(25), at(60))]


def test_a_rank_added_mid_run_counts_from_its_admission_not_its_process_start():
    changes = [MembershipChange(at(31), "worker_joined")]
    assert rank_spans(at(30), at(60), changes, end=at(60)) == [(at(31), at(60))]


def test_a_loss_reported_twice_closes_the_span_once():
    changes = [MembershipChange(at(10), "worker_lost"), MembershipChange(at(12), "worker_lost")]
    assert rank_spans(at(0), None, changes, end=at(60)) == [(at(0), at(10))]


def test_a_node_hosting_two_ranks_is_billed_for_the_union_of_their_spans():
    server = [(at(0), at(60))]
    worker = [(at(0), at(10)), (at(25), at(60))]
    assert union_seconds(server + worker) == 3600.0
    assert union_seconds([(at(0), at(10)), (at(25), at(30))]) == 15 * 60.0
