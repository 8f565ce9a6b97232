"""metric_sums gives per-metric sums over a worker's part of the evaluation data, which divide
into the same means whether a metric returns per-sample values or a batch mean."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

from hybridtrain.task import Metric, accuracy
from trainer.evaluation import metric_sums

CPU = torch.device("cpu")
N, CLASSES = 23, 3


class Logits(nn.Module):
    """The inputs are the logits; records whether it ran in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(self.training)
        return x


class Stream(IterableDataset):
    """A TensorDataset's samples as a stream."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


@pytest.fixture
def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, CLASSES, generator=gen), torch.randint(0, CLASSES, (N,), generator=gen))


def batch_mean_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(-1) == target).float().mean()


def exact(data: TensorDataset, idx) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of samples `idx`, computed in one go."""
    x, y = data.tensors[0][idx], data.tensors[1][idx]
    return float((x.argmax(-1) == y).double().mean()), float(F.cross_entropy(x.double(), y))


def means(sums: dict[str, float], count: int) -> dict[str, float]:
    return {k: v / count for k, v in sums.items()}


def test_per_sample_and_batch_mean_metrics_give_the_same_means(data):
    # 23 samples in batches of 5: the short last batch must weigh by its size, not as a batch.
    metrics = [accuracy(), Metric("acc_mean", batch_mean_accuracy)]
    sums, count = metric_sums(Logits(), data, part=None, metrics=metrics, loss=None, batch_size=5, device=CPU)
    assert count == N
    got = means(sums, count)
    # The batch means are float32.
    assert got["accuracy"] == pytest.approx(got["acc_mean"], abs=1e-6)
    assert got["accuracy"] == pytest.approx(exact(data, slice(None))[0], abs=1e-12)


def test_val_loss_is_the_mean_loss_when_a_loss_is_given(data):
    sums, count = metric_sums(Logits(), data, part=None, metrics=[accuracy()], loss=F.cross_entropy,
                              batch_size=5, device=CPU)
    assert set(sums) == {"accuracy", "val_loss"}
    assert sums["val_loss"] / count == pytest.approx(exact(data, slice(None))[1], rel=1e-6)


def test_val_loss_is_absent_without_a_loss(data):
    sums, _ = metric_sums(Logits(), data, part=None, metrics=[accuracy()], loss=None, batch_size=5, device=CPU)
    assert set(sums) == {"accuracy"}


def test_a_slice_part_scores_only_those_samples(data):
    sums, count = metric_sums(Logits(), data, part=slice(4, 15), metrics=[accuracy()], loss=F.cross_entropy,
                              batch_size=4, device=CPU)
    assert count == 11
    acc, loss = exact(data, slice(4, 15))
    assert sums["accuracy"] / count == pytest.approx(acc, abs=1e-12)
    assert sums["val_loss"] / count == pytest.approx(loss, rel=1e-6)


def test_slice_parts_of_all_workers_add_up_to_the_whole_set(data):
    parts = [slice(0, 6), slice(6, 17), slice(17, N)]
    results = [metric_sums(Logits(), data, part=p, metrics=[accuracy()], loss=None, batch_size=4, device=CPU)
               for p in parts]
    whole, count = metric_sums(Logits(), data, part=None, metrics=[accuracy()], loss=None, batch_size=4,
                               device=CPU)
    assert sum(c for _, c in results) == count
    assert sum(s["accuracy"] for s, _ in results) == pytest.approx(whole["accuracy"], abs=1e-12)


def test_a_stream_part_scores_the_items_at_its_positions_in_each_period(data):
    # Worker slice [2, 5) of every 7 items: positions 2-4, 9-11, 16-18 (and none of 21, 22).
    idx = [i for i in range(N) if 2 <= i % 7 < 5]
    sums, count = metric_sums(Logits(), Stream(data), part=(2, 5, 7), metrics=[accuracy()],
                              loss=F.cross_entropy, batch_size=4, device=CPU)
    assert count == len(idx) == 9
    acc, loss = exact(data, idx)
    assert sums["accuracy"] / count == pytest.approx(acc, abs=1e-12)
    assert sums["val_loss"] / count == pytest.approx(loss, rel=1e-6)


def test_a_stream_without_a_part_is_scored_whole(data):
    _, count = metric_sums(Logits(), Stream(data), part=None, metrics=[accuracy()], loss=None, batch_size=4,
                           device=CPU)
    assert count == N


def test_the_model_is_scored_in_eval_mode(data):
    model = Logits()
    metric_sums(model, data, part=None, metrics=[accuracy()], loss=None, batch_size=8, device=CPU)
    assert model.modes and not any(model.modes)


def test_a_training_model_is_back_in_training_mode_afterwards(data):
    model = Logits().train()
    metric_sums(model, data, part=None, metrics=[accuracy()], loss=None, batch_size=8, device=CPU)
    assert model.training


def test_a_model_in_eval_mode_stays_in_eval_mode(data):
    model = Logits().eval()
    metric_sums(model, data, part=None, metrics=[accuracy()], loss=None, batch_size=8, device=CPU)
    assert not model.training


def test_the_training_mode_is_restored_when_a_metric_raises(data):
    model = Logits().train()

    def broken(output, target):
        raise RuntimeError("metric bug")

    with pytest.raises(RuntimeError, match="metric bug"):
        metric_sums(model, data, part=None, metrics=[Metric("broken", broken)], loss=None, batch_size=8,
                    device=CPU)
    assert model.training


def test_no_gradients_are_recorded_during_evaluation(data):
    model = nn.Linear(CLASSES, CLASSES)
    metric_sums(model, data, part=None, metrics=[accuracy()], loss=F.cross_entropy, batch_size=8, device=CPU)
    assert all(p.grad is None for p in model.parameters())

