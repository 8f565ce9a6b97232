"""What a parameter-server worker's evaluation reports as its own seconds (trainer.loop.evaluate):
the scoring, not the wait for the other workers, which is communication. The benchmarks take
these seconds out of the time to target, so a wait counted here flatters the strategy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from trainer import loop
from trainer.config import TrainConfig
from trainer.metrics import MetricsLogger

WAIT_S = 0.5


class LateOthersClient:
    """The server's side of one worker, with the other worker late: the buffers' mean and the
    overlapped outer step arrive only after WAIT_S each. Records the seconds the worker reports."""

    def __init__(self) -> None:
        self.reported: list[float] = []

    def drain(self) -> None:
        time.sleep(WAIT_S)

    def average_buffers(self, step: int) -> None:
        time.sleep(WAIT_S)

    @contextmanager
    def global_model(self) -> Iterator[None]:
        yield

    def combine_eval(self, step: int, sums: dict[str, float], count: int, seconds: float) -> tuple[dict, bool]:
        self.reported.append(seconds)
        return {k: v / count for k, v in sums.items()}, False

    def close(self) -> None:
        pass


@pytest.fixture()
def worker() -> Iterator[LateOthersClient]:
    """Worker 0 of a two-worker diloco run, its client the late-others stand-in."""
    cfg = TrainConfig.from_dict({"strategy": "diloco", "workers": 2, "global_batch": 8, "max_steps": 10})
    ctx = loop.Context(cfg, rank=1, role="worker", device=torch.device("cpu"), metrics=MetricsLogger(1, "worker"))
    ctx.client = LateOthersClient()
    loop.reset_for_tests()
    loop._current = ctx
    yield ctx.client
    loop.reset_for_tests()


def test_a_ps_workers_evaluation_seconds_leave_out_the_wait_for_the_others(worker):
    data = torch.utils.data.TensorDataset(torch.randn(40, 3), torch.randn(40, 1))
    values = loop.evaluate(nn.Linear(3, 1), data, loss=nn.functional.mse_loss)
    assert "val_loss" in values
    (seconds,) = worker.reported
    assert 0 < seconds < WAIT_S
