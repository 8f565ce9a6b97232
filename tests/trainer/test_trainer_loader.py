"""The loader reads one stream of shuffled epochs: shards tile each global batch, every sample
comes round once per epoch, a step's indices depend on the step alone, re-balancing continues
the stream, streams are sliced per worker, and the DataLoader's options change nothing."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from trainer.loader import ShardedLoader, StepSampler, batch_indices, eval_slice, make_loader

SEED = 7


class Numbers(Dataset):
    """Sample i is (i, i): the batches show which indices were read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i


class BatchedNumbers(Numbers):
    """Counts its batched fetches and single-item reads."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.batched_calls = 0
        self.item_calls = 0

    def __getitem__(self, i: int) -> tuple[int, int]:
        self.item_calls += 1
        return i, i

    def __getitems__(self, indices: list[int]) -> list[tuple[int, int]]:
        self.batched_calls += 1
        return [(i, i) for i in indices]


class Stream(IterableDataset):
    """Items 0..n-1 in order, with no length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def step_batch(step: int, sizes: list[int], n: int, seed: int = SEED) -> list[int]:
    """All workers' indices of one step, in worker order."""
    return torch.cat([batch_indices(step, w, sizes, n, seed) for w in range(len(sizes))]).tolist()


def firsts(batch) -> list[int]:
    """The sample indices of a batch: the inputs of (inputs, target), or a stream's items."""
    return (batch if isinstance(batch, torch.Tensor) else batch[0]).tolist()


def test_shards_of_one_step_are_disjoint_and_tile_the_global_batch():
    sizes, n = [5, 2, 9], 100
    shards = [batch_indices(3, w, sizes, n, SEED).tolist() for w in range(3)]
    assert [len(s) for s in shards] == sizes
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == sum(sizes)
    assert all(0 <= i < n for i in flat)


def test_steps_covering_k_epochs_see_every_sample_exactly_k_times():
    # 3 epochs of 50 samples at B = 16 is 150 samples: batches straddle the epoch boundaries.
    sizes, n, k = [7, 9], 50, 3
    steps = k * n // sum(sizes)
    assert steps * sum(sizes) < k * n < (steps + 1) * sum(sizes)
    seen = [i for t in range(1, steps + 1) for i in step_batch(t, sizes, n)]
    seen += step_batch(steps + 1, sizes, n)[: k * n - len(seen)]
    assert Counter(seen) == Counter({i: k for i in range(n)})


def test_each_epoch_is_a_permutation_of_the_data_set():
    sizes, n = [4, 4], 40
    epoch = [i for t in range(1, n // 8 + 1) for i in step_batch(t, sizes, n)]
    assert sorted(epoch) == list(range(n))


def test_a_steps_indices_depend_only_on_step_sizes_and_seed():
    first = batch_indices(11, 1, [3, 5], 37, SEED)
    # Calls for other steps and seeds in between change nothing: no hidden state.
    for t in range(1, 11):
        batch_indices(t, 0, [3, 5], 37, SEED + 1)
    assert torch.equal(batch_indices(11, 1, [3, 5], 37, SEED), first)
    assert not torch.equal(batch_indices(11, 1, [3, 5], 37, SEED + 1), first)


def test_epochs_are_shuffled_differently():
    sizes, n = [10], 10
    assert step_batch(1, sizes, n) != step_batch(2, sizes, n)


def test_rebalancing_mid_run_continues_the_global_stream_without_repeats_or_skips():
    n, b = 30, 8
    plan = {1: [4, 4], 2: [4, 4], 3: [6, 2], 4: [1, 7], 5: [7, 1], 6: [2, 6], 7: [4, 4], 8: [5, 3]}
    rebalanced = [i for t, sizes in plan.items() for i in step_batch(t, sizes, n)]
    unchanged = [i for t in plan for i in step_batch(t, [b], n)]
    assert rebalanced == unchanged
    assert Counter(rebalanced[: 2 * n]) == Counter({i: 2 for i in range(n)})


def test_batch_indices_rejects_an_empty_training_set():
    with pytest.raises(ValueError, match="empty"):
        batch_indices(1, 0, [4], 0, SEED)


def test_eval_slices_tile_the_held_out_set_in_proportion_to_batch_sizes():
    sizes, n = [1, 3, 4], 100
    parts = [eval_slice(n, w, sizes) for w in range(3)]
    assert parts[0].start == 0 and parts[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert [p.stop - p.start for p in parts] == [12, 38, 50]


def test_eval_slice_gives_a_rank_without_a_share_nothing():
    # A 0 is a rank not in the run (lost, left, not yet joined).
    assert eval_slice(10, 1, [4, 0]) == slice(10, 10)


def test_eval_slice_rejects_negative_sizes_and_an_empty_split():
    for sizes in ([4, -1], [0, 0]):
        with pytest.raises(ValueError, match="positive sum"):
            eval_slice(10, 0, sizes)


def test_step_sampler_yields_the_batches_of_its_steps():
    sampler = StepSampler(3, 5, 1, [2, 3], 20, SEED)
    assert len(sampler) == 3
    assert list(sampler) == [batch_indices(t, 1, [2, 3], 20, SEED).tolist() for t in (3, 4, 5)]


def test_make_loader_reads_the_workers_indices_for_each_step():
    loader = make_loader(Numbers(23), first_step=2, last_step=4, worker=1, batch_sizes=[3, 2],
                         seed=SEED)
    assert [firsts(b) for b in loader] == [batch_indices(t, 1, [3, 2], 23, SEED).tolist() for t in (2, 3, 4)]


def test_make_loader_applies_the_transform_to_each_sample():
    loader = make_loader(Numbers(10), first_step=1, last_step=1, worker=0, batch_sizes=[4], seed=SEED,
                         transform=lambda s: (s[0] * 10, s[1]))
    inputs, target = next(loader)
    assert inputs.tolist() == [10 * i for i in target.tolist()]


def test_two_loader_processes_yield_the_same_batches_as_none():
    def batches(workers: int) -> list[list[int]]:
        loader = make_loader(Numbers(40), first_step=1, last_step=9, worker=0, batch_sizes=[5, 3],
                             seed=SEED, workers=workers)
        return [firsts(b) for b in loader]

    assert batches(2) == batches(0)


def test_a_dataset_with_getitems_is_fetched_in_one_call_per_batch():
    data = BatchedNumbers(30)
    loader = make_loader(data, first_step=1, last_step=4, worker=0, batch_sizes=[6, 2], seed=SEED,
                         collate=lambda samples: samples)
    assert [len(b) for b in loader] == [6] * 4
    assert (data.batched_calls, data.item_calls) == (4, 0)


def test_a_stream_worker_keeps_its_slice_of_every_global_batch():
    sizes = [2, 3, 1]
    loader = make_loader(Stream(30), first_step=1, last_step=5, worker=1, batch_sizes=sizes, seed=SEED)
    assert [b.tolist() for b in loader] == [[6 * t + 2, 6 * t + 3, 6 * t + 4] for t in range(5)]


def test_a_stream_loader_stops_at_the_last_step():
    loader = make_loader(Stream(100), first_step=1, last_step=3, worker=0, batch_sizes=[4], seed=SEED)
    assert len(list(loader)) == 3


def test_a_stream_loader_stops_when_the_stream_ends():
    loader = make_loader(Stream(10), first_step=1, last_step=50, worker=0, batch_sizes=[4], seed=SEED)
    assert [len(b) for b in loader] == [4, 4, 2]


class RunState:
    """The run as the loader sees it: the trainer's step, last step, worker, sizes, stop flag."""

    def __init__(self, last: int, sizes: list[int], worker: int = 0) -> None:
        self.step, self.last, self.worker, self.sizes, self.stop = 1, last, worker, list(sizes), False

    def __call__(self):
        return self.step, self.last, self.worker, tuple(self.sizes), self.stop


def consume(loader: ShardedLoader, state: RunState, on_step=None) -> list[list[int]]:
    """One pass of the loader, the trainer advancing its step after each batch."""
    out = []
    for batch in loader:
        out.append(firsts(batch))
        state.step += 1
        if on_step is not None:
            on_step(state)
    return out


def test_one_iteration_of_the_sharded_loader_is_one_epoch_of_steps():
    state = RunState(last=100, sizes=[4, 3])
    loader = ShardedLoader(Numbers(30), state, seed=SEED)
    assert len(consume(loader, state)) == 30 // 7
    assert len(consume(loader, state)) == 30 // 7
    assert state.step == 2 * (30 // 7) + 1


def test_the_sharded_loader_follows_the_global_stream_across_epochs():
    state = RunState(last=100, sizes=[4, 3])
    loader = ShardedLoader(Numbers(30), state, seed=SEED)
    got = consume(loader, state) + consume(loader, state)
    assert got == [batch_indices(t, 0, [4, 3], 30, SEED).tolist() for t in range(1, len(got) + 1)]


def test_the_sharded_loader_stops_at_the_last_step():
    state = RunState(last=3, sizes=[4])
    loader = ShardedLoader(Numbers(100), state, seed=SEED)
    assert len(consume(loader, state)) == 3
    assert consume(loader, state) == []


def test_the_sharded_loader_stops_when_the_run_sets_its_stop_flag():
    state = RunState(last=100, sizes=[4])

    def stop_after_two(s: RunState) -> None:
        s.stop = s.step > 2

    loader = ShardedLoader(Numbers(100), state, seed=SEED)
    assert len(consume(loader, state, stop_after_two)) == 2


def test_the_sharded_loader_restarts_with_the_new_sizes_at_the_next_step():
    state = RunState(last=8, sizes=[4, 4])

    def rebalance(s: RunState) -> None:
        if s.step == 4:
            s.sizes = [6, 2]

    loader = ShardedLoader(Numbers(64), state, seed=SEED)
    got = consume(loader, state, rebalance)
    want = [batch_indices(t, 0, [4, 4] if t < 4 else [6, 2], 64, SEED).tolist() for t in range(1, 9)]
    assert got == want


def test_the_sharded_loader_times_each_batch():
    times: list[float] = []
    state = RunState(last=3, sizes=[2])
    loader = ShardedLoader(Numbers(10), state, seed=SEED, on_batch=times.append)
    consume(loader, state)
    assert len(times) == 3 and all(t >= 0 for t in times)


def test_the_sharded_loader_has_no_epoch_length_for_a_stream():
    loader = ShardedLoader(Stream(10), RunState(last=5, sizes=[2]), seed=SEED)
    assert loader.steps_per_epoch(2) is None


def test_an_epoch_is_at_least_one_step_when_the_batch_exceeds_the_data_set():
    loader = ShardedLoader(Numbers(10), RunState(last=5, sizes=[20]), seed=SEED)
    assert loader.steps_per_epoch(20) == 1


def test_the_sharded_loader_slices_a_stream_for_its_worker():
    state = RunState(last=4, sizes=[2, 3], worker=1)
    loader = ShardedLoader(Stream(100), state, seed=SEED)
    assert consume(loader, state) == [[5 * t + 2, 5 * t + 3, 5 * t + 4] for t in range(4)]


def test_rebalancing_a_stream_continues_at_the_next_global_batch():
    # After the split changes at step 3, worker 0 must read on from item 2 * B of the stream,
    # not from its start again (which would repeat the first two global batches).
    state = RunState(last=4, sizes=[2, 2])

    def rebalance(s: RunState) -> None:
        if s.step == 3:
            s.sizes = [3, 1]

    loader = ShardedLoader(Stream(100), state, seed=SEED)
    got = consume(loader, state, rebalance)
    assert got == [[0, 1], [4, 5], [8, 9, 10], [12, 13, 14]]



def test_a_stream_loader_starting_at_a_later_step_skips_the_earlier_global_batches():
    # A resumed run (or a restart after re-balancing) must not read the stream's start again.
    loader = make_loader(Stream(40), first_step=3, last_step=4, worker=0, batch_sizes=[2, 2], seed=SEED)
    assert [b.tolist() for b in loader] == [[8, 9], [12, 13]]


def test_the_sharded_loader_reads_the_same_with_two_loader_processes_across_epochs_and_a_rebalance():
    def read(workers: int) -> list[list[int]]:
        state = RunState(last=12, sizes=[3, 2])

        def rebalance(s: RunState) -> None:
            if s.step == 7:
                s.sizes = [1, 4]

        loader = ShardedLoader(Numbers(26), state, seed=SEED, workers=workers)
        return [b for _ in range(3) for b in consume(loader, state, rebalance)]

    assert read(2) == read(0)
    assert len(read(0)) == 12
