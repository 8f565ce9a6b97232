"""Local SGD, the DiLoCo family (`diloco`, `diloco-gc`): a worker's state between outer steps,
and the outer step as pure functions over it.

Per outer step (DiLoCo, Douillard et al. 2023, algorithm 1; the numbers are the code's):
 1. Every worker starts from the common parameters theta and takes H inner steps of the task's own
    optimizer (its state stays on the worker) on its own shard of each global batch.
 2. Its pseudo-gradient is the change it made, delta_m = theta - theta_m (`pseudo_gradient`); it
    travels as the PS strategies' gradient does: fp16 values with error feedback under `diloco`,
    the top-k codec with error feedback and the adapted density under `diloco-gc`.
 3. The server averages them weighted by the samples each worker processed since the last outer
    step (eq. 1-2, `trainer.algorithm.aggregate`) and sends the mean back (re-sparsified under
    `diloco-gc`, fp16 with its own error feedback under `diloco`).
 4. Every worker applies the outer optimizer, Nesterov SGD, to the same mean (`outer_step`): the
    replicas' common parameters stay identical, as the PS strategies' do, and the server stays
    model-agnostic. Each worker then continues from theta.

Choices (the paper is silent, docs/trainer.md says more): the outer optimizer runs on every worker,
not on the server, so that the server's reply is the (compressible) mean change rather than the
whole model; heterogeneous workers all take the same H inner steps with batches sized to their
speed (the paper's rule: FLOPs first, then re-split from each round's measured compute), so they
reach the outer step together and the global batch of every inner step is the run's, whereas a
timed outer step would give each worker its own step count and break the sharding of each global
batch. With --outer-delay the outer step lands a few inner steps after its exchange began
(`LocalSGD.parameters_after`); with --async-outer at the first inner step after its mean arrived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridtrain.contract import next_sync, sync_fragments


def pseudo_gradient(common: torch.Tensor, local: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Step 2: delta = theta - theta_m, the direction an outer SGD step descends (into `out`)."""
    return torch.sub(common, local, out=out) if out is not None else common - local


def outer_step(params: torch.Tensor, velocity: torch.Tensor, delta: torch.Tensor, *, lr: float,
               momentum: float) -> None:
    """Step 4, Nesterov SGD in place, as torch.optim.SGD(nesterov=True) computes it:
    v <- mu * v + delta; theta <- theta - lr * (delta + mu * v). With mu = 0 it is plain SGD."""
    if momentum:
        velocity.mul_(momentum).add_(delta)
        params.sub_(delta + momentum * velocity, alpha=lr)
    else:
        params.sub_(delta, alpha=lr)


@dataclass
class Progress:
    """What a worker did since the last outer step: the samples weigh its pseudo-gradient, the
    loss, compute time and time averaging within its site (sites as replicas) report the whole
    round."""

    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    compute_s: float = 0.0
    site_s: float = 0.0

    def note(self, loss: float, samples: int, compute_s: float, site_s: float = 0.0) -> None:
        """One inner step."""
        self.steps += 1
        self.samples += samples
        self.compute_s += compute_s
        self.site_s += site_s
        if math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1

    @property
    def loss(self) -> float:
        """The mean loss of the round's inner steps (NaN if none reported one)."""
        return self.loss_sum / self.loss_count if self.loss_count else math.nan


class LocalSGD:
    """A worker's local-SGD state: the common parameters theta of the last outer step, the outer
    optimizer's velocity, and the progress of the inner steps since then. Flat tensors in the
    order of the worker's layout (`trainer.algorithm.Layout`), the order the pseudo-gradient
    travels in.

    Streaming (Streaming DiLoCo, Douillard et al. 2025): `spans` cut the flat vector into
    fragments, each with its own outer step (`hybridtrain.contract.sync_fragments`); theta, the
    velocity, the progress and an overlapped step's drift are then per fragment, and the methods
    that take a `fragment` work on that fragment's slice (the whole vector when there is one)."""

    def __init__(self, every: int, *, lr: float, momentum: float, numel: int,
                 device: torch.device | str = "cpu", spans: tuple[tuple[int, int], ...] | None = None) -> None:
        if every < 1:
            raise ValueError(f"sync every {every} steps: need at least 1")
        self.every, self.lr, self.momentum = every, lr, momentum
        self.spans = spans or ((0, numel),)
        if self.spans[0][0] != 0 or self.spans[-1][1] != numel or len(self.spans) > every:
            raise ValueError(f"fragments {self.spans} must tile {numel} elements, at most one per inner step")
        self.common = torch.zeros(numel, device=device)
        self.velocity = torch.zeros(numel, device=device)
        # Each fragment's last outer step: the common parameters are the run's model as of them.
        self.synced = [0] * len(self.spans)
        # The inner steps since each fragment's last outer step (its change's weight).
        self.rounds = [Progress() for _ in self.spans]
        # Overlapped outer steps (--outer-delay): per fragment, this worker's parameters when it
        # sent the change whose outer step is still on its way; the inner steps since then are
        # kept on top of it.
        self.drift_from: dict[int, torch.Tensor] = {}

    @property
    def fragments(self) -> int:
        """How many fragments the model's outer steps go in (1: not streaming)."""
        return len(self.spans)

    @property
    def synced_step(self) -> int:
        """The step of the last outer step, of any fragment."""
        return max(self.synced)

    @property
    def progress(self) -> Progress:
        """The inner steps since the last outer step (of the first fragment when streaming)."""
        return self.rounds[0]

    def at_common(self, step: int) -> bool:
        """Whether every fragment's outer step followed `step`: a worker's parameters are then the
        common ones."""
        return all(s == step for s in self.synced) and not self.drift_from

    def due(self, step: int, max_steps: int) -> tuple[int, ...]:
        """The fragments whose outer step follows inner step `step` (empty: none)."""
        return sync_fragments(step, self.every, max_steps, self.fragments)

    def next(self, step: int, max_steps: int) -> int:
        """The step of the next outer step (of any fragment) after `step`."""
        return next_sync(step, self.every, max_steps, self.fragments)

    def reset(self, params: torch.Tensor, step: int) -> None:
        """Take `params` as the common parameters of `step` (the run's start, a resume, a join)."""
        self.common.copy_(params)
        self.synced = [step] * self.fragments
        self.rounds = [Progress() for _ in self.spans]
        self.drift_from = {}

    def note(self, loss: float, samples: int, compute_s: float, site_s: float = 0.0) -> None:
        """One inner step: it counts towards every fragment's next outer step."""
        for progress in self.rounds:
            progress.note(loss, samples, compute_s, site_s)

    def _slice(self, tensor: torch.Tensor, fragment: int) -> torch.Tensor:
        a, b = self.spans[fragment]
        return tensor[a:b]

    def delta(self, local: torch.Tensor, out: torch.Tensor, fragment: int = 0) -> None:
        """Write this worker's pseudo-gradient for its `local` parameters (of `fragment`) into `out`."""
        pseudo_gradient(self._slice(self.common, fragment), local, out=out)

    def sent(self, local: torch.Tensor | None, fragment: int = 0) -> None:
        """The fragment's change has left: a new round of inner steps begins for it. `local`:
        this worker's parameters of it then, kept while the outer step is applied later
        (overlapped); None: it is applied before the next inner step."""
        self.rounds[fragment] = Progress()
        if local is None:
            self.drift_from.pop(fragment, None)
        else:
            self.drift_from[fragment] = local.clone()

    def apply(self, mean_delta: torch.Tensor, step: int, fragment: int = 0) -> float:
        """The outer step on the workers' mean change of `fragment`; returns that change's norm."""
        outer_step(self._slice(self.common, fragment), self._slice(self.velocity, fragment), mean_delta,
                   lr=self.lr, momentum=self.momentum)
        self.synced[fragment] = step
        return float(mean_delta.norm())

    def parameters_after(self, local: torch.Tensor | None, fragment: int = 0) -> torch.Tensor:
        """Where a worker's parameters (of `fragment`) go after its outer step: the common ones;
        overlapped, the common ones plus the inner steps taken since the change was sent (a
        delayed outer step, as Streaming DiLoCo overlaps its exchange: those steps' gradients saw
        the older model). `local` is only read when overlapped."""
        common = self._slice(self.common, fragment)
        drift_from = self.drift_from.pop(fragment, None)
        if drift_from is None:
            return common
        assert local is not None, "an overlapped outer step needs the parameters it moves"
        return common + (local - drift_from)

    def state_dict(self) -> dict:
        """The outer optimizer's state (the common parameters travel as the model's)."""
        return {"velocity": self.velocity.cpu(), "synced_step": self.synced_step, "every": self.every,
                "synced": list(self.synced)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s velocity (a checkpoint without one starts it at zero)."""
        velocity = state.get("velocity")
        if velocity is None:
            self.velocity.zero_()
        else:
            self.velocity.copy_(velocity.to(self.velocity.device))
