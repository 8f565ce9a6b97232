"""Asynchronous outer steps at the server (trainer.late_changes): the round's deadline, the late
changes' weights and the bound, and which late changes a round takes."""

from __future__ import annotations

import time

import pytest
import torch

from trainer import late_changes
from trainer.algorithm import aggregate
from trainer.compression import Payload
from trainer.frames import Eval, Grad, pack
from trainer.late_changes import LateChanges, fold_weight, round_deadline_s

NO_SPARSE = Payload(0, torch.zeros(0))


def _grad(rank: int, step: int, chunk: int = 0, samples: int = 16, value: float = 1.0, compute_s: float = 0.0) -> Grad:
    return Grad(step, rank, chunk, 0.5, samples, compute_s, 0.0, 0.0, Payload(2, torch.full((2,), value)), NO_SPARSE)


def _late(chunks: int = 2) -> LateChanges:
    """A server's record with the rounds of steps 4 and 8 closed, rank 3 left out of step 8's."""
    late = LateChanges(lambda: chunks)
    late.closed(4, [_grad(1, 4), _grad(2, 4), _grad(3, 4)], [])
    late.closed(8, [_grad(1, 8), _grad(2, 8)], [3])
    return late


def test_a_late_change_weighs_its_samples_over_one_plus_the_rounds_it_is_late():
    assert fold_weight(30, 1, bound=2) == 15 and fold_weight(30, 2, bound=2) == 10


def test_a_change_later_than_the_bound_is_dropped():
    assert fold_weight(30, 1) == 15 and fold_weight(30, 2) is None


def test_a_late_change_weighs_into_the_mean_as_its_folded_samples_say():
    # Worker 1's 16 samples now and worker 3's 16 one round late (weight 8): 2/3 and 1/3.
    grads = [_grad(1, 12, value=3.0), _grad(3, 8, value=0.0)]
    dense, _ = aggregate(grads, 2, 0, weights=[16, 8])
    torch.testing.assert_close(dense, torch.full((2,), 2.0))


def test_the_deadline_is_a_share_of_the_rounds_compute_with_a_floor_and_half_the_loss_deadline_at_most():
    assert round_deadline_s(8.0, 20.0) == pytest.approx(late_changes.DEADLINE_SHARE * 8.0)
    assert round_deadline_s(0.01, 20.0) == late_changes.DEADLINE_FLOOR_S
    assert round_deadline_s(100.0, 4.0) == 2.0


def test_before_any_round_has_reported_its_compute_the_deadline_is_half_the_loss_deadline():
    assert round_deadline_s(None, 6.0) == 3.0


def test_the_next_deadline_follows_the_median_compute_the_last_round_reported():
    late = LateChanges(lambda: 1)
    late.closed(4, [_grad(1, 4, compute_s=2.0), _grad(2, 4, compute_s=4.0), _grad(3, 4, compute_s=40.0)], [])
    assert late.deadline_s(100.0) == pytest.approx(late_changes.DEADLINE_SHARE * 4.0)


def test_a_change_of_a_round_already_closed_is_taken_as_it_arrives():
    late = _late()
    assert late.consume(3, pack(_grad(3, 8)))
    assert list(late.parts) == [(3, 8)]


def test_a_change_of_the_round_under_way_or_another_frame_is_left_for_the_round():
    late = _late()
    assert not late.consume(1, pack(_grad(1, 12)))
    assert not late.consume(1, pack(Eval(8, 1, {"accuracy": 1.0}, 1, 0.1)))
    assert not late.parts


def test_the_next_round_takes_a_late_change_whose_chunks_are_all_in_at_half_its_samples():
    late = _late()
    for chunk in (0, 1):
        late.consume(3, pack(_grad(3, 8, chunk, samples=20)))
    fold = late.fold({1, 2, 3})
    assert (fold.folded, fold.dropped, fold.samples) == (1, 0, 20)
    folded = [(g.sender, g.step, g.chunk, w) for c in (0, 1) for g, w in fold.grads(c)]
    assert folded == [(3, 8, 0, 10.0), (3, 8, 1, 10.0)]
    assert [g.chunk for g in fold.seen] == [1] and not late.parts


def test_a_late_change_with_chunks_still_to_come_waits_for_a_later_round():
    late = _late()
    late.consume(3, pack(_grad(3, 8, 0)))
    fold = late.fold({1, 2, 3})
    assert (fold.folded, fold.dropped, fold.grads(0)) == (0, 0, [])
    assert list(late.parts) == [(3, 8)]


def test_a_change_that_missed_two_rounds_is_dropped():
    late = _late()
    late.closed(12, [_grad(1, 12), _grad(2, 12)], [3])
    for chunk in (0, 1):
        late.consume(3, pack(_grad(3, 8, chunk)))
    fold = late.fold({1, 2, 3})
    assert (fold.folded, fold.dropped, fold.grads(0)) == (0, 1, [])
    assert [g.sender for g in fold.seen] == [3]  # its timings still reach the planner


def test_the_unfinished_change_of_a_worker_no_longer_in_the_run_is_dropped():
    late = _late()
    late.consume(3, pack(_grad(3, 8, 0)))
    fold = late.fold({1, 2})
    assert (fold.folded, fold.dropped) == (0, 1) and not late.parts


def test_an_unfinished_late_change_is_dropped_once_beyond_the_bound():
    late = _late()
    late.consume(3, pack(_grad(3, 8, 0)))
    late.closed(12, [_grad(1, 12), _grad(2, 12)], [])
    fold = late.fold({1, 2, 3})
    assert (fold.folded, fold.dropped) == (0, 1) and not late.parts


def test_a_worker_left_out_is_lost_only_once_silent_for_the_loss_deadline():
    late = _late()
    assert not late.silent_too_long(3, 10.0) and not late.silent_too_long(1, 0.0)
    time.sleep(0.02)
    assert late.silent_too_long(3, 0.01)
    late.consume(3, pack(_grad(3, 8)))  # heard from again
    assert not late.silent_too_long(3, 0.01)
