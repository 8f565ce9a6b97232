"""How the parameter server plans the next step from the last one's timings (step 5 and
III-A): each worker's density from its link's time, and the batch split from its compute and
compression times under `--allocation measured`. The plan is written into the run's `Roster`,
whose shares and densities every update announces."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from trainer.algorithm import adapt_densities
from trainer.allocation import rebalance
from trainer.config import TrainConfig
from trainer.frames import Grad
from trainer.membership import Roster


@dataclass(frozen=True)
class WorkerRow:
    """One worker's own figures of a step, as the server plans from them."""

    rank: int
    loss: float
    samples: int
    compute_s: float
    last_tx_s: float
    topk_s: float
    # Sites as replicas: the round's averaging within the worker's site, a cost of the site's.
    site_s: float = 0.0


def worker_rows(grads: list[Grad], *, replicas: bool = False) -> list[WorkerRow]:
    """Each worker's figures in rank order, a site's combined frame expanded into its members.

    Under sites as replicas (`replicas`) a site's costs are its workers' alike: every inner step
    they average over the LAN, whose time is their least (each other one's includes waiting
    for that one), and at the outer step the relay compresses the site's change, which the
    members wait for (its compression is theirs).
    """
    rows = []
    for g in grads:
        figures = g.members or (g.own(),)
        site_s = min(r[6] for r in figures)
        compress_s = max(r[5] for r in figures)
        rows += [WorkerRow(int(r[0]), r[1], int(r[2]), r[3], r[4], compress_s if replicas else r[5], site_s)
                 for r in figures]
    return sorted(rows, key=lambda r: r.rank)


class Planner:
    """The next step's densities and batch split, from a window of recent steps' timings; the
    roster it plans for is the run's (passed in, shared with the server's other helpers)."""

    def __init__(self, cfg: TrainConfig, roster: Roster) -> None:
        self.cfg, self.roster = cfg, roster
        self.compute_window: list[list[float]] = []
        self.overhead_window: list[list[float]] = []
        self.window_ranks: list[int] = []
        # Apply-in-forward: each worker's compression time of its last whole step, the fixed cost
        # the next split counts when it is planned at the first chunk.
        self.compress_s: dict[int, float] = {}

    def plan_early(self, step: int, grads: list[Grad], chunks: int) -> None:
        """Apply-in-forward: the workers take the next batch split from the first chunk, before the
        rest arrives, so it is planned then: from this step's compute times (every chunk's frame
        carries them) and each worker's compression of its last whole step."""
        rows = [replace(r, topk_s=self.compress_s.get(r.rank, r.topk_s * chunks))
                for r in worker_rows(grads, replicas=self.cfg.site_replicas)]
        self.plan(step, rows, {}, densities=False)

    def plan_step(self, step: int, grads: list[Grad], arrival: dict[int, float]) -> list[WorkerRow]:
        """The plan from a step's last chunk, whose frames carry the step's full timings
        (compression summed; a site's combined frame each of its workers' own); returns them."""
        rows = worker_rows(grads, replicas=self.cfg.site_replicas)
        ahead = self.cfg.applies_in_forward
        if ahead:
            self.compress_s.update({r.rank: r.topk_s for r in rows})
        self.plan(step, rows, arrival, batches=not ahead)
        return rows

    def plan(self, step: int, rows: list[WorkerRow], arrival: dict[int, float], *, densities: bool = True,
             batches: bool = True) -> None:
        """Densities from last transmission times (step 5); batch sizes from compute and
        compression times. Only the workers still in the run are planned for."""
        rows = [r for r in rows if r.rank in self.roster]
        if not rows:
            return
        ranks = [r.rank for r in rows]
        if batches:
            self.roster.note_rates([(r.rank, r.samples, r.compute_s) for r in rows])
            self.roster.note_spread([r.compute_s + r.topk_s for r in rows])
        if densities and self.cfg.compresses and step > self.cfg.warmup_steps + 1:
            # A link's time is the longer of the worker's own send time (previous step, its bytes
            # at the rate TCP measured: trainer.linkclock) and the frame's arrival time seen here
            # (this step): each clock can read short where the other does not.
            times = [max(r.last_tx_s, arrival.get(r.rank, 0.0)) for r in rows]
            target, low, high, _ = self.cfg.densities
            adapted = adapt_densities(
                [self.roster.densities[k - 1] for k in ranks], times, target=target,
                low=low, high=high, gamma=self.cfg.density_gamma,
                floor=self.cfg.density_time_floor_s,
            )
            for k, d in zip(ranks, adapted):
                self.roster.densities[k - 1] = d
        # `measured` refines whatever split the run started from; compression time counts as a
        # fixed per-step cost (trainer.allocation.rebalance).
        if batches and self.cfg.allocation == "measured" and len(self.roster) > 1:
            if ranks != self.window_ranks or ranks != self.roster.ranks():
                # Membership changed: a window over other workers says nothing about these.
                self.compute_window, self.overhead_window, self.window_ranks = [], [], ranks
                if ranks != self.roster.ranks():
                    return
            self.compute_window.append([r.compute_s for r in rows])
            # A site's averaging takes as long whatever the split within it: a fixed cost, as
            # compression is, which the split across sites must count (the slower site's
            # averaging made every other site wait for it at the outer step).
            self.overhead_window.append([r.topk_s + r.site_s for r in rows])
            if len(self.compute_window) >= self.cfg.rebalance_every:
                means = [sum(col) / len(col) for col in zip(*self.compute_window)]
                overheads = [sum(col) / len(col) for col in zip(*self.overhead_window)]
                shares = self.roster.shares(ranks)
                self.roster.set_shares(ranks, rebalance(sum(shares), shares, means, overheads))
                self.compute_window, self.overhead_window = [], []

    def state_dict(self) -> dict[str, Any]:
        """The plan (densities, batch sizes, and for whom) and the timing windows, as a snapshot."""
        return {
            "ranks": self.roster.ranks(),
            "densities": list(self.roster.densities),
            "batch_sizes": list(self.roster.batch_sizes),
            "compute_window": [list(r) for r in self.compute_window],
            "overhead_window": [list(r) for r in self.overhead_window],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`: the split and densities were planned for the workers of then,
        so they are kept only for the same set."""
        if state.get("ranks") != self.roster.ranks():
            return
        self.roster.densities = list(state["densities"])
        self.roster.batch_sizes = list(state["batch_sizes"])
        self.compute_window = [list(r) for r in state["compute_window"]]
        self.overhead_window = [list(r) for r in state.get("overhead_window", [])]
        self.window_ranks = self.roster.ranks()
