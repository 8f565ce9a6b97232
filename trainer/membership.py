"""Who is in a parameter-server run now: the live workers, their batch shares and densities,
who carries the update to whom, and how long the server waits before it calls a worker lost.

The server (trainer.server) changes the roster only at a step boundary: a lost or leaving
worker is dropped, a joiner added, and the fixed global batch is split again over whoever is
in (`Roster.resplit`). Shares and densities are kept per rank - 1, with 0 for ranks not in
the run, so every worker indexes the same lists whatever the membership (docs/elastic.md).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from hybridtrain.contract import equal_batch_sizes, proportional_batch_sizes
from trainer.config import TrainConfig, initial_batch_sizes
from trainer.frames import Route, pack
from trainer.relay import SERVER, plan_relay
from trainer.transport import Transport

# A worker that sends nothing for this long after its peers' frames of a step is lost, however
# short the steps: scheduling hiccups and a garbage collection must not drop a healthy worker.
LOSS_FLOOR_S = 2.0
# ... and for one recent step time (the median) beyond the spread of the workers' own step
# times (compute and compression, the most of recent steps), whichever is longer. The clock
# starts at the round's first frame, which comes up to a whole step after a node went silent (a
# worker sends once a step, at its end), so a loss is noticed within about two step times of the
# fault, the spread and the event's own latency, inside issue 15's three. The spread is where a
# healthy worker's frames are expected: a fraction of a step once the batch is re-split from
# measured times, up to most of a step for an equal split over unequal GPUs (`ps`, `ps-gc`),
# which a fixed multiple of the step (1.5 until 2026-12-05: a cut link noticed after 3.1 step
# times) either drops or waits on too long. A joiner's first step is held to the start's
# deadline (`Roster.loss_deadline_s`).
LOSS_STEPS = 1.0
# Under per-site aggregation a relay waits for its site's workers this long after its own
# chunk is ready (RELAY_SHARE of the floor, RELAY_STEPS recent step times), so that it reports
# its site (without the silent one) before the server, which hears only the relay, would call
# the relay itself lost.
RELAY_SHARE = 0.5
RELAY_STEPS = 0.75


def loss_deadline_s(step_s: Sequence[float], timeout_s: float, spread_s: float = 0.0) -> float:
    """How long after a round's first frame a silent worker counts as lost: LOSS_STEPS recent
    step times (their median) beyond `spread_s`, with a floor; a tenth of --timeout-s before any step."""
    if not step_s:
        return max(LOSS_FLOOR_S, timeout_s / 10)
    return max(LOSS_FLOOR_S, LOSS_STEPS * statistics.median(step_s) + spread_s)


def relay_wait_s(step_s: Sequence[float], timeout_s: float) -> float:
    """How long a site's relay waits for its members' chunks after its own is ready."""
    if not step_s:
        return RELAY_SHARE * loss_deadline_s(step_s, timeout_s)
    return max(RELAY_SHARE * LOSS_FLOOR_S, RELAY_STEPS * statistics.median(step_s))


@dataclass
class Member:
    """One live worker: its relative speed (HELLO or --speeds), site, relay address."""

    rank: int
    speed: float | None = None
    site: str | None = None
    address: tuple[str, int] | None = None
    # Taken off the relay routes (a lost relay's orphan, a joiner without a relay): the server
    # sends to it.
    direct: bool = False
    # Admitted, but applies one more step's update before it computes (a joiner catching up).
    joining: bool = False
    # A joiner's relay: the worker of its site the server routed it behind (None: the start's plan).
    relay: int | None = None


class Roster:
    """The live workers of a run, with their batch shares, densities and update routes."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.members: dict[int, Member] = {}
        self.plan = plan_relay(cfg.sites, cfg.workers, every_site=cfg.site_replicas)
        self.batch_sizes = initial_batch_sizes(cfg)
        self.densities = [cfg.densities[0]] * cfg.workers
        self.step_s: deque[float] = deque(maxlen=20)
        # How far apart the workers' own step times were (compute and compression), recent steps.
        self.spread_s: deque[float] = deque(maxlen=20)
        # Joiners computing their first step, whose cold start (first allocations, caches) may
        # trail the others by more than the loss deadline: that step is held to the start's.
        self.warming: set[int] = set()
        # Measured samples/s per rank (an average over recent steps), for re-splitting.
        self.rates: dict[int, float] = {}

    # -- who ---------------------------------------------------------------------------------------
    def ranks(self) -> list[int]:
        """Every live worker, joiners included, in rank order."""
        return sorted(self.members)

    def active(self) -> list[int]:
        """The workers that compute this step (not a joiner still catching up)."""
        return [r for r in self.ranks() if not self.members[r].joining]

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, rank: int) -> bool:
        return rank in self.members

    def add(self, member: Member) -> None:
        """A worker enters (its share is 0 until `resplit`)."""
        self.members[member.rank] = member
        self._grow(member.rank)

    def remove(self, rank: int) -> list[int]:
        """Drop `rank`; returns the workers it relayed to, which the server now sends to itself."""
        orphans = [r for r in self.ranks() if r != rank and self.source(r) == rank]
        self.members.pop(rank, None)
        self.rates.pop(rank, None)
        for r in orphans:
            self.members[r].direct = True
        if rank <= len(self.batch_sizes):
            self.batch_sizes[rank - 1] = 0
        return orphans

    def _grow(self, rank: int) -> None:
        while len(self.batch_sizes) < rank:
            self.batch_sizes.append(0)
            self.densities.append(self.cfg.densities[0])

    # -- routes -------------------------------------------------------------------------------------
    def source(self, rank: int) -> int:
        """Who hands `rank` the update: the server, or its site's relay while both are in."""
        member = self.members.get(rank)
        if member is None or member.direct:
            return SERVER
        relay = self.plan.source(rank) if member.relay is None else member.relay
        if relay == SERVER or relay not in self.members:
            return SERVER
        return relay

    def relay_for(self, site: str | None) -> int | None:
        """The worker a joiner of `site` hears the update from: the lowest-ranked worker of that
        site that computes and hears the server itself (its plan relay while it lives). None in
        the server's own site, without sites, or with per-site aggregation, whose relays also
        combine gradients and are planned once. Under site replicas the joiner joins its site's
        replica, whichever site: behind its relay, with which it averages every inner step."""
        if not site or not self.cfg.sites or self.cfg.site_aggregation:
            return None
        if site == self.cfg.sites[SERVER] and not self.cfg.site_replicas:
            return None
        ranks = [r for r in self.active() if self.members[r].site == site and self.source(r) == SERVER]
        return ranks[0] if ranks else None

    def forwards(self, rank: int) -> tuple[int, ...]:
        """The live workers `rank` relays the update to."""
        return tuple(r for r in self.ranks() if r != rank and self.source(r) == rank)

    def update_targets(self) -> list[int]:
        """The workers the server sends each update to itself."""
        return [r for r in self.ranks() if self.source(r) == SERVER]

    def senders(self) -> list[int]:
        """The workers whose GRAD frames reach the server: every active one, or with per-site
        aggregation those not behind a relay."""
        active = self.active()
        if not self.cfg.combines_at_sites:
            return active
        return [r for r in active if self.source(r) == SERVER]

    def donor(self, site: str | None = None) -> int | None:
        """A worker to ask for the run's state: one that reads the server's frames itself, in
        the server's site when there is one (its link is the fast one). Under site replicas a
        joiner of `site` takes its site's relay's: the inner optimizer's state is its replica's."""
        direct = [r for r in self.active() if self.source(r) == SERVER]
        if not direct:
            return None
        home = self.cfg.sites[SERVER] if self.cfg.sites else None
        if site is not None and self.cfg.site_replicas:
            home = site
        local = [r for r in direct if home is not None and self.members[r].site == home]
        return (local or direct)[0]

    # -- when is a worker lost ------------------------------------------------------------------------
    def note_step(self, seconds: float) -> None:
        """One step's time at the server, from waiting for its first frame to its last update."""
        self.step_s.append(seconds)
        self.warming.clear()

    def caught_up(self) -> None:
        """Joiners have received a whole step's update: they compute from the next step, their first."""
        for m in self.members.values():
            if m.joining:
                m.joining = False
                self.warming.add(m.rank)

    def note_spread(self, seconds: list[float]) -> None:
        """Each worker's own time to its gradient (compute and compression) in one step."""
        if seconds:
            self.spread_s.append(max(seconds) - min(seconds))

    def loss_deadline_s(self) -> float:
        """How long after a step's first frame a silent worker counts as lost (the start's while
        a joiner computes its first step)."""
        if self.warming:
            return loss_deadline_s((), self.cfg.timeout_s)
        return loss_deadline_s(self.step_s, self.cfg.timeout_s, max(self.spread_s, default=0.0))

    # -- the batch split ----------------------------------------------------------------------------
    def note_rates(self, rows: list[tuple[int, int, float]]) -> None:
        """(rank, samples, compute_s) of a step: refresh each worker's measured samples/s."""
        for rank, samples, compute_s in rows:
            if compute_s > 0 and samples > 0:
                rate = samples / compute_s
                old = self.rates.get(rank)
                self.rates[rank] = rate if old is None else 0.7 * old + 0.3 * rate

    def _given_speeds(self, ranks: list[int]) -> dict[int, float]:
        """The speeds given for `ranks` (HELLO, --speeds); when none is, the planned shares of
        those in the plan (--batch-sizes): the control plane launches with its split, made in
        proportion to the speeds it planned with, and no --speeds."""
        given = {r: float(self.members[r].speed) for r in ranks if self.members[r].speed}
        if given:
            return given
        planned = self.cfg.batch_sizes
        return {r: float(planned[r - 1]) for r in ranks if r <= len(planned) and planned[r - 1] > 0}

    def _speeds(self, ranks: list[int]) -> list[float]:
        """Relative speeds of `ranks`: the given ones (`_given_speeds`) under `flops` when every
        worker has one (equal when none has), else measured samples/s, a newcomer's scaled from
        its given speed."""
        given = self._given_speeds(ranks)
        if self.cfg.allocation == "flops" and len(given) == len(ranks):
            return [given[r] for r in ranks]
        if self.cfg.allocation == "flops" and not given:
            return [1.0] * len(ranks)  # no speeds given: the run started with equal shares
        measured = {r: self.rates[r] for r in ranks if r in self.rates}
        if not measured:
            typical = statistics.median(given.values()) if given else 1.0
            return [given.get(r, typical) for r in ranks]
        scale = [measured[r] / given[r] for r in measured if r in given]
        typical = statistics.median(measured.values())
        out = []
        for r in ranks:
            if r in measured:
                out.append(measured[r])
            elif r in given and scale:
                out.append(given[r] * statistics.median(scale))
            else:
                out.append(typical)
        return out

    def resplit(self) -> None:
        """Split the global batch over the live workers again (after a loss, a leave, a join)."""
        ranks = self.ranks()
        if not ranks:
            return
        total = self.cfg.global_batch
        if self.cfg.batch_sizes and ranks == list(range(1, self.cfg.workers + 1)):
            sizes = list(self.cfg.batch_sizes)
        elif self.cfg.allocation == "equal":
            sizes = equal_batch_sizes(total, len(ranks))
        else:
            sizes = proportional_batch_sizes(total, self._speeds(ranks))
        self.batch_sizes = [0] * len(self.batch_sizes)
        for r, n in zip(ranks, sizes):
            self._grow(r)
            self.batch_sizes[r - 1] = n

    def shares(self, ranks: list[int]) -> list[int]:
        """The batch shares of `ranks`, in that order."""
        return [self.batch_sizes[r - 1] for r in ranks]

    def set_shares(self, ranks: list[int], sizes: list[int]) -> None:
        """New batch shares for `ranks` (measured re-balancing)."""
        for r, n in zip(ranks, sizes):
            self.batch_sizes[r - 1] = n


def reroute(transport: Transport, roster: Roster, relay: int, step: int, *, peers: dict | None = None,
            source: int | None = None) -> None:
    """Tell `relay` whom it forwards the update to now (a ROUTE; with `source`, where its own
    updates come from); a relay lost meanwhile is the loss detection's to notice."""
    try:
        transport.send(relay, pack(Route(step, roster.forwards(relay), peers or {}, source)))
    except (ConnectionError, OSError):
        pass
