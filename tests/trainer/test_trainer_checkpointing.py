"""The parameter server's checkpoint schedule and what one checkpoint holds
(trainer.checkpointing.Checkpointer), without a run."""

from __future__ import annotations

import pytest
import torch

from trainer import checkpoint, checkpointing
from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.frames import LayoutSpec, State

LAYOUT = LayoutSpec(names=("fc.weight", "fc.bias"), numels=(6, 2), dense_numel=2, buffer_numel=0)


def _worker_state(step: int) -> State:
    return State(sender=1, params=torch.arange(8, dtype=torch.float32), buffers=torch.zeros(0), step=step,
                 optimizer=checkpoint.to_bytes({"momentum": [1.0]}))


def test_a_checkpoint_is_due_every_n_steps_and_once_a_step(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    assert [s for s in range(1, 11) if ckpts.due(s)] == [5, 10]
    ckpts.write(5, {"step": 5}, LAYOUT, _worker_state(5))
    assert not ckpts.due(5)
    assert ckpts.due(10)


def test_a_checkpoint_is_due_once_its_seconds_have_passed_since_the_last(tmp_path, monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(checkpointing.time, "monotonic", lambda: now[0])
    ckpts = Checkpointer(TrainConfig(checkpoint_every=0, checkpoint_every_s=60.0, checkpoint_dir=str(tmp_path)))
    now[0] = 159.0
    assert not ckpts.due(3)
    now[0] = 160.0
    assert ckpts.due(3)
    ckpts.write(3, {"step": 3}, LAYOUT, _worker_state(3))
    now[0] = 219.0
    assert not ckpts.due(4)


def test_a_run_without_a_schedule_takes_no_checkpoint(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=0, checkpoint_every_s=0, checkpoint_dir=str(tmp_path)))
    assert not ckpts.scheduled
    assert not any(ckpts.due(s) for s in range(1, 50))


def test_a_written_checkpoint_holds_the_servers_state_the_workers_model_and_the_layout(tmp_path) -> None:
    cfg = TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path))
    ckpts = Checkpointer(cfg)
    detail = ckpts.write(5, {"step": 5, "residual": [0.5]}, LAYOUT, _worker_state(5))
    state = checkpoint.read(checkpoint.latest(tmp_path), cfg)
    assert detail == "run-step-00000005.pt"  # no store: nothing is uploaded
    assert (state["step"], state["server"]["residual"]) == (5, [0.5])
    assert state["layout"] == {"names": ("fc.weight", "fc.bias"), "numels": (6, 2), "dense_numel": 2, "buffer_numel": 0}
    assert torch.equal(state["params"], torch.arange(8, dtype=torch.float32))
    assert checkpoint.from_bytes(state["optimizer"]) == {"momentum": [1.0]}
    assert ckpts.step == 5
    assert ckpts.close() is False  # there was no store to upload to


def test_a_checkpoint_written_in_the_background_is_reported_once_written_under_its_step(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    ckpts.write_in_background(5, {"step": 5}, LAYOUT, _worker_state(5))
    assert ckpts.written(wait=True) == [(5, "run-step-00000005.pt")]
    assert ckpts.step == 5 and checkpoint.saved_steps(tmp_path) == [5]
    assert ckpts.written(wait=True) == []  # reported once


def test_a_background_write_that_fails_raises_when_its_result_is_read(tmp_path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(blocker / "ck")))
    ckpts.write_in_background(5, {"step": 5}, LAYOUT, _worker_state(5))
    with pytest.raises(OSError):
        ckpts.written(wait=True)
    assert ckpts.step == 0


def test_a_pending_checkpoint_is_taken_only_from_the_worker_asked_and_for_its_step(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    ckpts.asked(5, 2, {"step": 5})
    assert not ckpts.take(1, _worker_state(5), LAYOUT)  # another worker
    assert not ckpts.take(2, _worker_state(6), LAYOUT)  # another step
    assert ckpts.take(2, _worker_state(5), LAYOUT)
    assert ckpts.pending is None and ckpts.written(wait=True) == [(5, "run-step-00000005.pt")]


def test_a_step_whose_state_was_taken_is_not_due_again_while_its_file_is_written(tmp_path) -> None:
    # The final evaluation's boundary comes at the last step again, before the writer is done.
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    ckpts.asked(5, 2, {"step": 5})
    assert ckpts.take(2, _worker_state(5), LAYOUT)
    assert not ckpts.due(5) and not ckpts.wanted(5)
    assert ckpts.written(wait=True) == [(5, "run-step-00000005.pt")]


def test_one_checkpoint_is_on_its_way_at_a_time(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    ckpts.asked(5, 2, {"step": 5})
    assert not ckpts.wanted(10)


def test_a_checkpoint_whose_worker_is_lost_is_owed_to_the_next_boundary(tmp_path) -> None:
    ckpts = Checkpointer(TrainConfig(checkpoint_every=5, checkpoint_dir=str(tmp_path)))
    ckpts.asked(5, 2, {"step": 5})
    ckpts.lost(1)  # not the worker asked: still pending
    assert ckpts.pending is not None
    ckpts.lost(2)
    assert ckpts.pending is None
    assert ckpts.wanted(6) and not ckpts.due(6)
    ckpts.asked(6, 1, {"step": 6})
    assert ckpts.take(1, _worker_state(6), LAYOUT) and ckpts.written(wait=True) == [(6, "run-step-00000006.pt")]
    assert not ckpts.wanted(7)  # paid: the schedule goes on from step 6
