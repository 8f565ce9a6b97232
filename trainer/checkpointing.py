"""When the parameter server checkpoints, and what one checkpoint holds: the server's own
state, the model and optimizer state of one live worker (the replicas are equal) and the
layout, written by `trainer.checkpoint` and uploaded in the background by
`trainer.checkpoint_store.Uploader` when the run has a store. Who the worker is, and asking it,
is the server's (`trainer.boundary`)."""

from __future__ import annotations

import time
from typing import Any

from trainer import checkpoint
from trainer.checkpoint_store import Uploader
from trainer.config import TrainConfig
from trainer.frames import LayoutSpec, State


class Checkpointer:
    """The server's checkpoint schedule (--checkpoint-every steps, --checkpoint-every-s seconds)
    and its writes; `step` is the step of the latest checkpoint (0: none yet)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.step = 0
        self._at = time.monotonic()
        self.uploader = Uploader(cfg.checkpoint_url, cfg.report_token) if cfg.checkpoint_url else None

    @property
    def scheduled(self) -> bool:
        """Whether the run checkpoints on a schedule at all (and so at its end)."""
        return bool(self.cfg.checkpoint_every or self.cfg.checkpoint_every_s)

    def due(self, step: int) -> bool:
        """Whether the boundary after `step` takes a checkpoint: every N steps or S seconds, once a step."""
        if step <= self.step:
            return False
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            return True
        return bool(self.cfg.checkpoint_every_s) and time.monotonic() - self._at >= self.cfg.checkpoint_every_s

    def write(self, step: int, server_state: dict[str, Any], layout: LayoutSpec, worker: State) -> str:
        """Write the checkpoint of `step` and queue its upload; the checkpoint event's detail."""
        path = checkpoint.save(self.cfg.checkpoint_dir, step, {
            "server": server_state,
            "layout": {"names": layout.names, "numels": layout.numels, "dense_numel": layout.dense_numel,
                       "buffer_numel": layout.buffer_numel},
            "params": worker.params, "buffers": worker.buffers, "optimizer": worker.optimizer,
        }, self.cfg)
        self.step, self._at = step, time.monotonic()
        if self.uploader is None:
            return path.name
        self.uploader.submit(step, path)
        return f"{path.name}, uploading to the run's store"

    def close(self, deadline_s: float = 60.0) -> bool:
        """Wait up to `deadline_s` for the uploads; True if all were stored (False without a store).
        Checkpoints written after this stay in the directory only."""
        uploaded = self.uploader.close(deadline_s) if self.uploader is not None else False
        self.uploader = None
        return uploaded
