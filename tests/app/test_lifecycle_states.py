"""The run's transition table: which moves are allowed, and that a forbidden one is refused."""

from __future__ import annotations

import pytest

from app.errors import ConflictError
from app.lifecycle import TRANSITIONS, IllegalTransition, can_move, move
from app.models import Run, RunStatus

S = RunStatus
ENDS = {S.succeeded, S.failed, S.cancelled}

ALLOWED = {
    (S.queued, S.launching), (S.queued, S.running), (S.queued, S.degraded), (S.queued, S.restarting),
    (S.launching, S.running), (S.launching, S.degraded), (S.launching, S.restarting),
    (S.running, S.degraded), (S.running, S.restarting),
    (S.degraded, S.running), (S.degraded, S.restarting),
    (S.restarting, S.running), (S.restarting, S.degraded), (S.restarting, S.restarting),
    *{(active, end) for active in (S.queued, S.launching, S.running, S.degraded, S.restarting) for end in ENDS},
    # A launched run's cancel waits for its agents; a queued one has nothing to wait for.
    *{(launched, S.cancelling) for launched in (S.launching, S.running, S.degraded, S.restarting)},
    (S.cancelling, S.cancelled),
}


def test_the_table_names_every_state():
    assert set(TRANSITIONS) == set(RunStatus)


@pytest.mark.parametrize("current", list(RunStatus))
@pytest.mark.parametrize("to", list(RunStatus))
def test_a_move_is_allowed_exactly_when_the_table_lists_it(current, to):
    assert can_move(current, to) == ((current, to) in ALLOWED)


@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_finished_run_never_moves_again(end):
    run = Run(id=5, status=end)
    with pytest.raises(IllegalTransition, match=f"run 5 cannot go from {end} to running"):
        move(run, S.running)
    assert run.status == end


def test_an_illegal_transition_is_a_conflict():
    assert issubclass(IllegalTransition, ConflictError)


def test_a_restart_never_goes_back_to_launching():
    run = Run(id=6, status=S.restarting)
    with pytest.raises(IllegalTransition):
        move(run, S.launching)


def test_moving_to_an_end_stamps_the_finish_and_to_running_the_start():
    run = Run(id=7, status=S.launching, started_at=None, finished_at=None)
    move(run, S.running)
    assert run.status == S.running and run.started_at is not None and run.finished_at is None
    move(run, S.succeeded)
    assert run.finished_at is not None


def test_a_cancelling_run_can_only_end_cancelled():
    run = Run(id=8, status=S.cancelling)
    for other in (S.running, S.failed, S.succeeded, S.restarting):
        with pytest.raises(IllegalTransition):
            move(run, other)
    move(run, S.cancelled)
    assert run.finished_at is not None
