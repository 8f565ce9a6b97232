"""What the parameter server says of the run as it goes: its training time across resumes, a
progress line on stderr (every 2 s, and at each evaluation), and whether and when an evaluation
reached the run's target (`time_to_target_s`)."""

from __future__ import annotations

import sys
import time

from hybridtrain.contract import parse_target
from trainer.config import TrainConfig
from trainer.metrics import MetricsLogger


class RunProgress:
    """The run's clock (started at the end of the handshake), its target and when it was reached."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.target = parse_target(cfg.target) if cfg.target else None
        self.stop_at_target = cfg.stop_at_target
        self.elapsed_s = 0.0
        self.t0 = time.time()
        self.last_print = 0.0
        self.reached_at: float | None = None
        self.warned = False

    def resumed(self, elapsed_s: float) -> None:
        """A resumed run had trained this long before."""
        self.elapsed_s = elapsed_s

    def start(self) -> None:
        """Training starts now (the handshake is over)."""
        self.t0 = time.time()

    def elapsed(self) -> float:
        """Training seconds so far, across resumes."""
        return self.elapsed_s + time.time() - self.t0

    def reached(self, values: dict[str, float]) -> bool:
        """Whether an evaluation's `values` reach the target (a warning, once, if they lack its metric)."""
        if self.target is None:
            return False
        if self.target.metric not in values:
            if not self.warned:
                self.warned = True
                print(f"[ps] warning: the target {self.target} names a metric the evaluation does not "
                      f"report (it reports {', '.join(values) or 'none'})", file=sys.stderr, flush=True)
            return False
        return self.target.reached(values[self.target.metric])

    def note_reached(self, step: int, metrics: MetricsLogger) -> None:
        """The target was reached at `step`: the first time, log the run's `time_to_target_s`."""
        if self.reached_at is None:
            self.reached_at = self.elapsed()
            metrics.log(step, "time_to_target_s", self.reached_at)

    def show(self, step: int, max_steps: int, loss: float, values: dict[str, float] | None = None) -> None:
        """The progress line: every 2 s, at the last step, and at every evaluation (`values`)."""
        now = time.time()
        if values is None and now - self.last_print < 2.0 and step != max_steps:
            return
        self.last_print = now
        extra = "".join(f" {k} {v:.4f}" for k, v in (values or {}).items())
        print(f"[ps] step {step}/{max_steps} loss {loss:.4f}{extra} elapsed {self.elapsed():.1f}s",
              file=sys.stderr, flush=True)
