"""When the parameter server checkpoints, and what one checkpoint holds: the server's own
state, the model and optimizer state of one live worker (the replicas are equal) and the
layout, written by `trainer.checkpoint` and uploaded in the background by
`trainer.checkpoint_store.Uploader` when the run has a store. A scheduled checkpoint is asked
for and taken off the server's path: the `Pending` one keeps the server's state of its step
while the worker's answer is on its way, and the file is written on a thread of its own, so
the rounds go on. `Checkpointer` is also the server's side of that conversation: which worker it
asks at a boundary (through `trainer.donors.Donors`, passed in), and what it does with the answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridtrain.contract import EVENT_CHECKPOINT
from trainer import checkpoint
from trainer.checkpoint_store import Uploader
from trainer.config import TrainConfig
from trainer.frames import LayoutSpec, State
from trainer.ps_log import say

if TYPE_CHECKING:
    from trainer.donors import Donors
    from trainer.metrics import MetricsLogger


@dataclass(frozen=True)
class Pending:
    """A scheduled checkpoint asked for: its step, the worker asked, the server's state then."""

    step: int
    donor: int
    server_state: dict[str, Any]


class Checkpointer:
    """The server's checkpoint schedule (--checkpoint-every steps, --checkpoint-every-s seconds)
    and its writes; `step` is the step of the latest checkpoint (0: none yet), `pending` the
    scheduled one whose worker has not answered yet, `layout` the run's model's (known at the
    handshake). The server's side of the conversation takes its collaborators as arguments: the
    `Donors` that ask a worker, the server's state as a callable (a snapshot when called), the
    run's metrics for the checkpoint events."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.step = 0
        self.layout: LayoutSpec | None = None
        self.pending: Pending | None = None
        # The worker asked was lost before it answered: the next boundary asks another.
        self._owed = False
        self._at = time.monotonic()
        self.uploader = Uploader(cfg.checkpoint_url, cfg.report_token) if cfg.checkpoint_url else None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[tuple[int, Future]] = []

    @property
    def scheduled(self) -> bool:
        """Whether the run checkpoints on a schedule at all (and so at its end)."""
        return bool(self.cfg.checkpoint_every or self.cfg.checkpoint_every_s)

    def due(self, step: int) -> bool:
        """Whether the boundary after `step` takes a checkpoint: every N steps or S seconds, once a step."""
        # A step still on the writer thread counts as taken: the final evaluation's boundary comes
        # at the last step again, and must not ask for it twice.
        last = max([self.step, *(s for s, _ in self._writes)])
        if step <= last:
            return False
        every = self.cfg.checkpoint_every
        if every and step % every == 0:
            return True
        # Local SGD's server sees only the outer steps, H apart: one past a multiple counts.
        if every and self.cfg.is_local_sgd and step // every > last // every:
            return True
        return bool(self.cfg.checkpoint_every_s) and time.monotonic() - self._at >= self.cfg.checkpoint_every_s

    def wanted(self, step: int) -> bool:
        """Whether the boundary after `step` asks for a scheduled checkpoint: one is due, or a lost
        worker's is owed, and none is on its way (one at a time)."""
        return self.pending is None and (self.due(step) or self._owed and step > self.step)

    def asked(self, step: int, donor: int, server_state: dict[str, Any]) -> None:
        """`donor` was asked for its state of `step` (FETCH); `server_state` must be a snapshot.
        The next checkpoint by time counts from here."""
        self.pending, self._owed = Pending(step, donor, server_state), False
        self._at = time.monotonic()

    def lost(self, rank: int) -> None:
        """Worker `rank` is gone: if it was asked, its checkpoint is owed to the next boundary."""
        if self.pending is not None and self.pending.donor == rank:
            self.pending, self._owed = None, True

    def take(self, rank: int, worker: State, layout: LayoutSpec) -> bool:
        """`rank`'s STATE: if it answers the pending checkpoint, write it in the background
        (`written()` reports it) and say True; False for a state nobody asked for."""
        pending = self.pending
        if pending is None or rank != pending.donor or worker.step != pending.step:
            return False
        self.pending = None
        self.write_in_background(pending.step, pending.server_state, layout, worker)
        return True

    def write(self, step: int, server_state: dict[str, Any], layout: LayoutSpec, worker: State) -> str:
        """Write the checkpoint of `step` and queue its upload; the checkpoint event's detail."""
        return self._saved(step, self._save(step, server_state, layout, worker))

    def write_in_background(self, step: int, server_state: dict[str, Any], layout: LayoutSpec,
                            worker: State) -> None:
        """Write the checkpoint of `step` on the writer thread; `written()` reports it."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self._writes.append((step, self._writer.submit(self._save, step, server_state, layout, worker)))

    def written(self, *, wait: bool = False) -> list[tuple[int, str]]:
        """The background writes done since the last call, as (step, the event's detail), in order;
        `wait`: every one queued. A write that failed (a full disk) raises here."""
        done = []
        while self._writes and (wait or self._writes[0][1].done()):
            step, future = self._writes.pop(0)
            done.append((step, self._saved(step, future.result())))
        return done

    def _save(self, step: int, server_state: dict[str, Any], layout: LayoutSpec, worker: State) -> Path:
        return checkpoint.save(self.cfg.checkpoint_dir, step, {
            "server": server_state,
            "layout": {"names": layout.names, "numels": layout.numels, "dense_numel": layout.dense_numel,
                       "buffer_numel": layout.buffer_numel},
            "params": worker.params, "buffers": worker.buffers, "optimizer": worker.optimizer,
        }, self.cfg)

    def _saved(self, step: int, path: Path) -> str:
        self.step = max(self.step, step)
        self._at = time.monotonic()
        if self.uploader is None:
            return path.name
        self.uploader.submit(step, path)
        return f"{path.name}, uploading to the run's store"

    def close(self, deadline_s: float = 60.0) -> bool:
        """Wait up to `deadline_s` for the uploads; True if all were stored (False without a store).
        Checkpoints written after this stay in the directory only."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        uploaded = self.uploader.close(deadline_s) if self.uploader is not None else False
        self.uploader = None
        return uploaded


    # -- the server's side: asking a worker at a boundary, and the answer ------------------------------------
    def configure(self, layout: LayoutSpec) -> None:
        """The run's model layout, which every checkpoint records."""
        self.layout = layout

    def resumed(self, step: int) -> None:
        """The run resumed from the checkpoint of `step`: the latest one it has."""
        self.step = step

    def ask(self, step: int, donors: Donors, snapshot: Callable[[], dict[str, Any]]) -> None:
        """Ask a live worker for its state for `step`'s checkpoint, keeping `snapshot()` of the
        server's; the rounds go on, and `answer` writes the file when the worker's STATE comes."""
        donor = donors.pick()
        if donor is not None and donors.ask(donor, step):
            self.asked(step, donor, snapshot())

    def answer(self, rank: int, state: State) -> None:
        """A STATE read in a round: the answer to the scheduled checkpoint's FETCH, written in
        the background. (No other FETCH is on its way then: `settle` sees to it.)"""
        if not self.take(rank, state, self.layout):
            say(f"rank {rank}'s state of step {state.step} came unasked; dropped")

    def settle(self, donors: Donors, step: int, *, after_bye: bool = False) -> None:
        """Before another FETCH (a joiner's, the last checkpoint's): wait for the answer to the
        scheduled one, so the two answers cannot be taken for each other."""
        pending = self.pending
        if pending is None:
            return
        state = donors.fetch(pending.donor, step, after_bye=after_bye, ask=False)
        if state is not None:
            self.answer(pending.donor, state)

    def log_written(self, metrics: MetricsLogger, *, wait: bool = False) -> None:
        """A checkpoint event for each background write done (`wait`: for every one queued)."""
        for step, detail in self.written(wait=wait):
            metrics.event(step, EVENT_CHECKPOINT, detail=detail)

    def take_now(self, step: int, donors: Donors, snapshot: Callable[[], dict[str, Any]],
                 metrics: MetricsLogger, *, after_bye: bool = False) -> bool:
        """Write the run's checkpoint of `step` (and upload it) now; False without a live worker."""
        answer = donors.any_state(step, after_bye=after_bye)
        if answer is None:
            return False
        _, state = answer
        detail = self.write(step, snapshot(), self.layout, state)
        metrics.event(step, EVENT_CHECKPOINT, detail=detail)
        return True

    def close_run(self, metrics: MetricsLogger) -> None:
        """Wait for the checkpoints being written and (bounded) for the last one's upload."""
        try:
            self.log_written(metrics, wait=True)
        except Exception as exc:  # noqa: BLE001 - the run is ending; a failed write must not hide why
            say(f"a checkpoint could not be written: {exc}")
        self.close(60.0)
