"""A local SGD worker's rounds (`diloco`, `diloco-gc`; DiLoCo's algorithm 1, `trainer.local_sgd`
for the state and the pure steps): what follows each inner step, the pseudo-gradient's send,
and the outer steps on their way back.

An outer step is applied at once (no overlap), a fixed `--outer-delay` inner steps after its
change was sent, or, asynchronous, as soon as its update has come back (waiting only at
`--max-staleness`); under streaming several fragments' outer steps may be on their way at once,
applied oldest first. Each applied outer step reports how many inner steps it landed after its
send (`outer_staleness`) and the norm of the mean change (`outer_norm`).

`PSClient` (trainer.ps) holds one and hands it the flat model; it reads updates through the
`read_round` it is given, so that the wire stays the client's.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from trainer.config import TrainConfig
from trainer.flat_model import FlatModel
from trainer.local_sgd import LocalSGD
from trainer.metrics import MetricsLogger
from trainer.uplink import Upload


class OuterSteps:
    """The outer steps of one worker: the LocalSGD state (`local`) and the outer steps whose
    changes were sent but not yet applied (`pending`, oldest first)."""

    def __init__(self, cfg: TrainConfig, local: LocalSGD, flat: FlatModel, metrics: MetricsLogger, *,
                 read_round: Callable[[int], None], update_arrived: Callable[[int], bool],
                 ended: Callable[[], bool], buffers: Callable[[], list[torch.Tensor]] = list) -> None:
        self.cfg, self.local, self.flat, self.metrics = cfg, local, flat, metrics
        self._read_round, self._update_arrived, self._ended = read_round, update_arrived, ended
        # The model's float buffers (BatchNorm's statistics), and this worker's as of the last
        # outer step: with the common parameters, they are the run's model of then. Between outer
        # steps a worker's statistics follow its own drifted parameters, which an evaluation of
        # the common ones must not mix in (widecnn under diloco-gc scored 0.18 so, mid-round).
        self._buffers = buffers
        self._common_buffers = self._buffer_values()
        self.pending: deque[int] = deque()
        # The inner step after which the outer step being read is applied (its staleness is the gap).
        self._landing_at: int | None = None

    def after_inner_step(self, step: int, max_steps: int, *, loss: float, samples: int,
                         compute_s: float, site_s: float = 0.0) -> tuple[bool, float]:
        """Count inner step `step` (`site_s`: its averaging within the site) and apply the outer
        steps that land after it. Returns whether the pseudo-gradient goes up now, and the
        seconds spent waiting for a late outer step."""
        self.local.note(loss, samples, compute_s, site_s)
        late = 0.0
        # Outer steps that land now first: streaming's next fragment may be due at the same step.
        if self.pending and self._lands(step):
            t0 = time.perf_counter()
            # Oldest first, each on its own terms: under streaming several fragments' rounds may
            # be on their way, and each is its own send's staleness_bound steps old at a
            # different step (asynchronous: its own update may be here before that).
            while self.pending and not self._ended() and self._lands(step):
                self.land(step, upto=self.pending[0])
            # Waiting for an outer step that is late is communication, not compute.
            late = time.perf_counter() - t0
            self.metrics.log(step, "wait_s", late)
        return bool(self.local.due(step, max_steps)), late

    def send(self, upload: Upload, max_steps: int) -> None:
        """The round's change since the last outer step (of each fragment due) into the flat
        gradient; `upload` then reports the round's samples, loss and compute."""
        local, step = self.local, upload.step
        fragments = local.due(step, max_steps)
        # The fragments' own overlapped outer steps still on their way (the bounds are below H:
        # only at the run's last step, which syncs every fragment), with those before them.
        owed = [s for s in self.pending if set(local.due(s, max_steps)) & set(fragments)]
        if owed:
            self.land(step, upto=owed[-1])
        round_ = local.rounds[fragments[0]]
        upload.samples, upload.loss = round_.samples, round_.loss
        upload.compute_s, upload.site_s = round_.compute_s, round_.site_s
        if local.fragments > 1:  # each fragment's change weighs its own round's samples
            upload.chunk_samples = {p: local.rounds[p].samples for p in fragments}
        # Overlapped: the outer step is applied --outer-delay inner steps later, or asynchronous
        # when it has arrived; the run's last one at once, so that the run ends on the common model.
        later = self.cfg.staleness_bound > 0 and step < max_steps
        for p in fragments:
            a, b = local.spans[p]
            params = self.flat.span_values(a, b)
            local.delta(params, out=self.flat.grad[a:b], fragment=p)
            local.sent(params if later else None, fragment=p)
        if later:
            self.pending.append(step)

    def apply(self, step: int, max_steps: int) -> None:
        """The flat gradient holds the workers' mean pseudo-gradient (of the fragments that synced
        after `step`): the outer step."""
        local, norm_sq = self.local, 0.0
        for p in local.due(step, max_steps):
            a, b = local.spans[p]
            norm_sq += local.apply(self.flat.grad[a:b], step, fragment=p) ** 2
            # Overlapped, the inner steps since the send stay on top (a copy of the parameters only then).
            own = self.flat.span_values(a, b) if p in local.drift_from else None
            self.flat.load_span(local.parameters_after(own, fragment=p), a, b)
        self.keep_buffers()
        self.metrics.log(step, "outer_norm", math.sqrt(norm_sq))
        # Inner steps between the change's send and this outer step (0: applied before the next).
        landed, self._landing_at = self._landing_at, None
        self.metrics.log(step, "outer_staleness", 0 if landed is None else landed - step)

    def land(self, at: int, *, upto: int | None = None) -> None:
        """Read and apply, after inner step `at`, the outer steps still on their way, oldest
        first: all, or those of steps up to `upto` (a no-op without one)."""
        while self.pending and not self._ended() and (upto is None or self.pending[0] <= upto):
            self._landing_at = at
            self._read_round(self.pending.popleft())

    def _lands(self, step: int) -> bool:
        """Whether the oldest outer step on its way is applied after inner step `step`: once it
        is staleness_bound steps old (a fixed --outer-delay; asynchronous, --max-staleness, where
        the worker waits for it), or asynchronous as soon as its update (its round's, under
        streaming one fragment's) is here."""
        oldest = self.pending[0]
        if step - oldest >= self.cfg.staleness_bound:
            return True
        return self.cfg.asynchronous and self._update_arrived(oldest)

    def keep_buffers(self) -> None:
        """Take the model's float buffers as those of the common model (the start, an outer step)."""
        self._common_buffers = self._buffer_values()

    def _buffer_values(self) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self._buffers()]

    def _load_buffers(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b, v in zip(self._buffers(), values, strict=True):
                b.copy_(v)

    @contextmanager
    def global_model(self, step: int) -> Iterator[None]:
        """The run's model for the block: the common parameters of the last outer step and this
        worker's float buffers of then (an evaluation scores that, not this worker's drift
        since); its own are back after the block."""
        if self.local.at_common(step):
            yield
            return
        own, own_buffers = self.flat.values(), self._buffer_values()
        self.flat.load(self.local.common)
        self._load_buffers(self._common_buffers)
        try:
            yield
        finally:
            self.flat.load(own)
            self._load_buffers(own_buffers)

    def end_on_common(self, step: int) -> None:
        """A run stopped between outer steps ends on the common model of the last one."""
        if not self.local.at_common(step):
            self.flat.load(self.local.common)
            self._load_buffers(self._common_buffers)
