"""Each worker's share of every global batch, read through torch's DataLoader.

The training set is read as one stream of shuffled epochs (epoch e is a permutation seeded by
the run's seed and e), and step t takes the stream's next B samples: worker m its contiguous
slice of n_m. So shards are disjoint and sized by batch share, every epoch sees every sample
exactly once (a global batch may straddle two epochs), re-balancing only changes slice widths,
and which samples a step sees depends on the step alone, so a resumed run reads on unchanged.
A data set never has to fit in memory: the loader's processes read only the samples of their
worker's slices, with prefetch and, on CUDA, pinned memory.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler


@lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch `epoch`: the same on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=gen)


# An epoch's order of n samples for a seed: `epoch_permutation`, or a data set's own
# (hybridtrain.datasets shuffles within windows of shards, so a step touches few shards).
EpochOrder = Callable[[int, int, int], torch.Tensor]


def dataset_order(dataset: Any) -> EpochOrder:
    """The epoch order `dataset` asks for (its `epoch_order(seed, epoch)`), else `epoch_permutation`."""
    own = getattr(dataset, "epoch_order", None)
    if own is None:
        return epoch_permutation
    return lambda n, seed, epoch: own(seed, epoch)


def batch_indices(step: int, worker: int, batch_sizes: Sequence[int], n_train: int, seed: int,
                  order: EpochOrder = epoch_permutation) -> torch.Tensor:
    """Indices of worker `worker`'s batch at 1-based `step`: its slice of that step's global batch."""
    if n_train < 1:
        raise ValueError("the training set is empty")
    start = (step - 1) * sum(batch_sizes) + sum(batch_sizes[:worker])
    positions = np.arange(start, start + batch_sizes[worker], dtype=np.int64)
    epochs, within = np.divmod(positions, n_train)
    out = torch.empty(len(positions), dtype=torch.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[torch.from_numpy(sel)] = order(n_train, seed, int(e))[torch.from_numpy(within[sel])]
    return out


def eval_slice(n_test: int, worker: int, batch_sizes: Sequence[int]) -> slice:
    """The contiguous part of the held-out set a worker scores, in proportion to its batch.

    A worker's batch share is its share of the compute, so every worker finishes scoring at once,
    as it finishes a step; equal parts would leave the fast workers waiting on the slow ones.
    """
    weights = np.asarray(batch_sizes, dtype=np.float64)
    # A 0 is a rank not in the run (lost, left, not joined yet): it scores nothing.
    if weights.size == 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"eval_slice: batch sizes must be >= 0 with a positive sum, got {list(batch_sizes)}")
    bounds = (np.concatenate([[0.0], np.cumsum(weights)]) / weights.sum() * n_test).round().astype(int)
    return slice(int(bounds[worker]), int(bounds[worker + 1]))


class StepSampler(Sampler[list[int]]):
    """Batches of indices for steps `first`..`last` at fixed batch sizes (a batch_sampler)."""

    def __init__(self, first: int, last: int, worker: int, batch_sizes: Sequence[int], n: int, seed: int,
                 order: EpochOrder = epoch_permutation) -> None:
        self.first, self.last, self.worker = first, last, worker
        self.batch_sizes, self.n, self.seed, self.order = tuple(batch_sizes), n, seed, order

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first, self.last + 1):
            yield batch_indices(step, self.worker, self.batch_sizes, self.n, self.seed, self.order).tolist()

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)


class _Transformed(torch.utils.data.Dataset):
    """A map-style data set with a per-sample transform (applied in the loader's processes)."""

    def __init__(self, data: Any, transform: Callable[[Any], Any]) -> None:
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        return self.transform(self.data[i])

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # The data set's own batch fetch where it has one (a sharded data set counts its reads there).
        fetch = getattr(self.data, "__getitems__", None)
        items = fetch(indices) if fetch else [self.data[i] for i in indices]
        return [self.transform(item) for item in items]


class _IterableShard(IterableDataset):
    """A stream read whole by every worker, which keeps its slice of every B consecutive items."""

    def __init__(self, data: IterableDataset, lo: int, hi: int, global_batch: int,
                 transform: Callable[[Any], Any] | None, skip: int = 0) -> None:
        self.data, self.lo, self.hi, self.b, self.transform = data, lo, hi, global_batch, transform
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        # Steps before the first one read here (a resume, a re-balanced split) took the
        # stream's first `skip` items; B stays fixed, so they are skipped whole.
        for i, item in enumerate(self.data):
            if i >= self.skip and self.lo <= i % self.b < self.hi:
                yield self.transform(item) if self.transform else item


def make_loader(
    dataset: Any,
    *,
    first_step: int,
    last_step: int,
    worker: int,
    batch_sizes: Sequence[int],
    seed: int,
    collate: Callable | None = None,
    transform: Callable | None = None,
    workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[Any]:
    """An iterator over this worker's batches for steps first..last at `batch_sizes`."""
    if isinstance(dataset, IterableDataset):
        lo, hi = sum(batch_sizes[:worker]), sum(batch_sizes[: worker + 1])
        shard = _IterableShard(dataset, lo, hi, sum(batch_sizes), transform,
                               skip=(first_step - 1) * sum(batch_sizes))
        # A stream is consumed in order: the loader's processes would each replay it whole.
        loader = DataLoader(shard, batch_size=hi - lo, collate_fn=collate, pin_memory=pin_memory)
        return _take(iter(loader), last_step - first_step + 1)
    data = _Transformed(dataset, transform) if transform else dataset
    sampler = StepSampler(first_step, last_step, worker, batch_sizes, len(dataset), seed, dataset_order(dataset))
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                        pin_memory=pin_memory, prefetch_factor=2 if workers else None,
                        persistent_workers=False, worker_init_fn=ignore_sigterm if workers else None)
    if not workers:
        return iter(loader)
    # iter() starts the loader's processes. A SIGTERM that reached one before its
    # worker_init_fn ran killed it, so the processes start with SIGTERM blocked (the mask is
    # inherited) and unblock it once they ignore it; the role gets any SIGTERM that came
    # meanwhile as soon as its own mask is restored.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_sigterm(worker_id: int) -> None:
    """A loader process leaves SIGTERM to its role: the agent's SIGTERM reaches the role's whole
    process group, and a loader process dying of it would fail the role ("DataLoader worker
    killed by signal") instead of letting it leave at its step boundary. It ends with the role
    (torch's loader stops its processes; the agent's SIGKILL sweeps the group after)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


class ShardedLoader:
    """This worker's batches, step after step, following the run's current batch sizes.

    `state()` gives (next step, last step, worker index, batch sizes, stop) at each batch. When
    the batch sizes change (re-balancing) the prefetched batches of the old split are dropped
    and reading restarts at the next step with the new one. One iteration is one epoch of
    steps (n // B, at least one), cut short at the run's last step or its target.
    """

    def __init__(self, dataset: Any, state: Callable[[], tuple[int, int, int, Sequence[int], bool]],
                 *, seed: int, collate: Callable | None = None, transform: Callable | None = None,
                 workers: int = 0, pin_memory: bool = False,
                 on_batch: Callable[[float], None] | None = None) -> None:
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.dataset, self.state, self.seed = dataset, state, seed
        self.collate, self.transform, self.workers, self.pin_memory = collate, transform, workers, pin_memory
        self.on_batch = on_batch
        self._it: Iterator[Any] | None = None
        self._key: tuple | None = None
        self._next_step = 0

    def steps_per_epoch(self, global_batch: int) -> int | None:
        """n // B (at least 1), or None for a stream of unknown length."""
        if isinstance(self.dataset, IterableDataset):
            return None
        return max(1, len(self.dataset) // global_batch)

    def __iter__(self) -> Iterator[Any]:
        step, last, worker, sizes, stop = self.state()
        per_epoch = self.steps_per_epoch(sum(sizes))
        end = last if per_epoch is None else min(last, step + per_epoch - 1)
        while step <= end and not stop:
            key = (worker, tuple(sizes), last)
            if self._it is None or key != self._key or step != self._next_step:
                self._it = make_loader(self.dataset, first_step=step, last_step=last, worker=worker,
                                       batch_sizes=sizes, seed=self.seed, collate=self.collate,
                                       transform=self.transform, workers=self.workers,
                                       pin_memory=self.pin_memory)
                self._key = key
            t0 = time.perf_counter()
            try:
                batch = next(self._it)
            except StopIteration:
                return
            if self.on_batch is not None:
                self.on_batch(time.perf_counter() - t0)
            self._next_step = step + 1
            yield batch
            # The loader keeps its own count: a loop that skips the optimizer for a batch still
            # moves on; sizes, the last step and the stop flag follow the run.
            _, last, worker, sizes, stop = self.state()
            step, end = step + 1, min(end, last)
