"""How workers come into a parameter-server run (docs/elastic.md, "The choice: a transport that
admits peers"): at the start, the workers' HELLOs, the check that they built one model, the plan
each is welcomed with, and the weights they all start from (worker 1's for a fresh run, the
checkpoint's for a resumed one); later, at a step boundary, a newcomer:

1. Its HELLO waits for the next boundary. The server asks a live worker for its state (FETCH;
   the worker answers with its weights and optimizer state as of its last step), hands it to the
   newcomer with a WELCOME, sends it the next step's update to apply, and from the step after it
   computes with its share. A newcomer in a remote site hears the update from a worker of its
   site, told so with a ROUTE, as the start's relay plan would have had it: one WAN copy per
   site, not one per worker (`Roster.relay_for`).
2. Below --min-workers the server waits for joiners up to --min-workers-wait-s, then fails.
"""

from __future__ import annotations

import queue
import time

import torch

from hybridtrain.contract import EVENT_RESUMED, EVENT_WAITING, EVENT_WORKER_JOINED, next_sync
from trainer.algorithm import chunk_count
from trainer.checkpointing import Checkpointer
from trainer.config import TrainConfig
from trainer.departures import Departures
from trainer.donors import Donors
from trainer.frames import SERVER, Abort, Hello, LayoutSpec, ProtocolError, State, Welcome, expect, pack
from trainer.membership import Member, Roster, reroute
from trainer.metrics import MetricsLogger
from trainer.ps_log import say
from trainer.transport import Inbox, Transport

# A run, fresh or resumed, waits up to --start-wait-s (120 s) for every expected worker
# (--expect-ranks, default every rank): start-up differs by tens of seconds between nodes
# (imports and the task's data on a full core or on a third of one: 25 s on the paper
# testbed's ResNet-18), and a worker admitted later is a joiner, which misses the site relay
# plan, so its site pays one WAN copy of every update per worker. A restart names the ranks it
# launched, so a lost node's rank, which never comes, is not waited for.
# Once no worker has said HELLO for this long, the server says whom it is waiting for.
START_QUIET_S = 20.0


class TooFewWorkers(ProtocolError):
    """Fewer than --min-workers for --min-workers-wait-s: the run fails (no restart)."""


class Joiner:
    """Greets the start's workers and admits later ones into the roster; holds the model a
    resumed run starts from until the workers have it."""

    def __init__(self, cfg: TrainConfig, roster: Roster, transport: Transport, inbox: Inbox,
                 metrics: MetricsLogger, departures: Departures, donors: Donors, checkpoints: Checkpointer) -> None:
        self.cfg, self.roster, self.transport, self.inbox, self.metrics = cfg, roster, transport, inbox, metrics
        self.departures, self.donors, self.checkpoints = departures, donors, checkpoints
        self.elastic = hasattr(transport, "arrivals")
        self.resume_model: State | None = None
        self.resume_layout: LayoutSpec | None = None
        self.started = False  # the start's HELLOs are in: any later one is a joiner's
        if self.elastic:
            transport.on_arrival = self.heard  # type: ignore[attr-defined]

    def resume_from(self, state: dict) -> None:
        """The workers start from this checkpoint's model (trainer.checkpoint), of this layout."""
        lay = state["layout"]
        self.resume_layout = LayoutSpec(tuple(lay["names"]), tuple(lay["numels"]), lay["dense_numel"],
                                        lay["buffer_numel"])
        self.resume_model = State(SERVER, state["params"], state["buffers"], state["step"], state["optimizer"])

    # -- the start ---------------------------------------------------------------------------------------
    def greet(self) -> Hello:
        """The start's HELLOs, checked to be of one model (and the checkpoint's), their senders
        in the roster; returns the first worker's HELLO (its layout and data size)."""
        hellos = self._initial_hellos()
        ranks = sorted(hellos)
        first = hellos[ranks[0]][0]
        for w, (hello, _) in hellos.items():
            diff = first.layout.difference(hello.layout)
            if diff:
                raise ProtocolError(f"the model replicas differ: worker {ranks[0]} and worker {w} "
                                    f"built different models ({diff}); the task's model factory must "
                                    "build the same architecture on every rank")
        if self.resume_layout is not None and self.resume_layout.difference(first.layout):
            raise ProtocolError(f"the checkpoint's model differs from the workers' "
                                f"({self.resume_layout.difference(first.layout)}): resume the same task")
        for w, (hello, host) in hellos.items():
            speed = hello.speed or (self.cfg.speeds[w - 1] if w <= len(self.cfg.speeds) else None)
            address = (host, hello.listen_port) if host and hello.listen_port else None
            self.roster.add(Member(w, speed, hello.site, address))
        if ranks != list(range(1, self.cfg.workers + 1)):
            self.roster.resplit()
        self.started = True
        return first

    def welcome(self, step: int, max_steps: int) -> None:
        """Each greeted worker's WELCOME (its plan), then the weights they all start from."""
        ranks = self.roster.ranks()
        donor = SERVER if self.resume_model is not None else ranks[0]
        peers = {m.rank: m.address for m in self.roster.members.values() if m.address}
        for w in ranks:
            self.transport.send(w, pack(self._welcome(w, step, max_steps, donor=donor, peers=peers)))
        if self.resume_model is not None:
            self.transport.send_many(ranks, pack(self.resume_model))
            self.metrics.event(step, EVENT_RESUMED, detail=f"from the checkpoint of step {step}, "
                               f"with {len(ranks)} workers; the workers' error-feedback residuals start empty")
            say(f"resumed from step {step} with {len(ranks)} workers")
            self.resume_model = None
        else:
            state = expect(self.inbox.get(donor)[0], State, peer=donor)
            self.transport.send_many([w for w in ranks if w != donor], pack(state))

    def _initial_hellos(self) -> dict[int, tuple[Hello, str | None]]:
        if not self.elastic:
            for w in range(1, self.cfg.workers + 1):
                self.inbox.add(w)
            return {w: (expect(self.inbox.get(w)[0], Hello, peer=w), None) for w in range(1, self.cfg.workers + 1)}
        hellos: dict[int, tuple[Hello, str | None]] = {}
        start = last = time.monotonic()
        deadline = start + self.cfg.timeout_s
        expected = set(self.cfg.expect_ranks or range(1, self.cfg.workers + 1))
        said = False
        while not expected <= hellos.keys() and time.monotonic() < deadline:
            now = time.monotonic()
            if len(hellos) >= max(1, self.cfg.min_workers):
                if now - start > self.cfg.start_wait_s:
                    break
                if not said and now - last > min(START_QUIET_S, self.cfg.start_wait_s / 2):
                    missing = sorted(expected - hellos.keys())
                    say(f"{len(hellos)} of {len(expected)} workers connected; waiting up to "
                        f"{min(self.cfg.start_wait_s, self.cfg.timeout_s):.0f} s from the start for "
                        f"rank(s) {', '.join(map(str, missing))}, then starting without them")
                    said = True
            try:
                conn, raw, host = self.transport.arrivals.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                continue
            try:
                hello = expect(raw, Hello)
            except ProtocolError as exc:
                self.transport.refuse(conn, pack(Abort(SERVER, str(exc))))
                continue
            if hello.sender < 1 or hello.sender in hellos:
                self.transport.refuse(conn, pack(Abort(SERVER, f"rank {hello.sender} is taken or not a worker's")))
                continue
            self.transport.adopt(hello.sender, conn, raw)
            self.inbox.add(hello.sender)
            hellos[hello.sender] = (hello, host)
            last = time.monotonic()
        if len(hellos) < max(1, self.cfg.min_workers):
            raise ProtocolError(f"only {len(hellos)} of {self.cfg.workers} workers connected within "
                                f"{self.cfg.timeout_s:.0f} s (--timeout-s); --min-workers is {self.cfg.min_workers}")
        return hellos

    # -- at a boundary -----------------------------------------------------------------------------------
    def heard(self, raw: torch.Tensor) -> None:
        """A connection's first frame is in (on the transport's thread): once the run has started,
        say that a joiner waits for the next boundary, which under local SGD may be minutes away."""
        if not self.started:
            return
        try:
            hello = expect(raw, Hello)
        except ProtocolError:
            return  # refused at the boundary, with the reason
        say(f"worker {hello.sender} asks to join; it is admitted at the next step boundary")

    def admit(self, layout: LayoutSpec, step: int, max_steps: int) -> None:
        """Admit every newcomer whose HELLO has arrived since the last boundary."""
        while True:
            try:
                conn, raw, host = self.transport.arrivals.get_nowait()
            except queue.Empty:
                return
            self._arrive(conn, raw, host, layout, step, max_steps)

    def wait_for_workers(self, layout: LayoutSpec, step: int, max_steps: int) -> None:
        """Below --min-workers: admit joiners for up to --min-workers-wait-s, then fail the run."""
        need = max(1, self.cfg.min_workers)
        wait = self.cfg.min_workers_wait_s
        self.metrics.event(step, EVENT_WAITING, detail=f"{len(self.roster)} workers, --min-workers {need}: "
                           f"training paused for up to {wait:.0f} s")
        say(f"{len(self.roster)} of the {need} workers --min-workers asks for: waiting up to {wait:.0f} s "
            "for workers to join")
        deadline = time.monotonic() + wait
        while len(self.roster) < need:
            left = deadline - time.monotonic()
            if left <= 0 or not self.elastic:
                raise TooFewWorkers(f"fewer than --min-workers {need} workers: {len(self.roster)} left and none "
                                    f"joined within --min-workers-wait-s {wait:.0f} s; the run stops")
            try:
                conn, raw, host = self.transport.arrivals.get(timeout=min(left, 0.5))
            except queue.Empty:
                self.departures.drop_failed(step)
                self.departures.require_a_worker(step)
                continue
            self._arrive(conn, raw, host, layout, step, max_steps)

    def _arrive(self, conn, raw, host: str, layout: LayoutSpec, step: int, max_steps: int) -> None:
        try:
            hello = expect(raw, Hello)
        except ProtocolError as exc:
            self.transport.refuse(conn, pack(Abort(SERVER, str(exc))))
            return
        rank = hello.sender
        diff = layout.difference(hello.layout) if rank >= 1 else "rank 0 is the server's"
        if diff:
            self.transport.refuse(conn, pack(Abort(SERVER, f"worker {rank} cannot join: its model differs "
                                                           f"from the run's ({diff})")))
            return
        if rank in self.roster:
            # The same rank again: a restarted process whose old one the server has not missed yet.
            self.departures.lose(rank, ConnectionError("replaced by a new process of the same rank"), step)
        self.checkpoints.settle(self.donors, step)
        answer = self.donors.any_state(step, site=hello.site)
        if answer is None:
            self.transport.refuse(conn, pack(Abort(SERVER, f"worker {rank} cannot join: no live worker "
                                                           "holds the model")))
            return
        donor, state = answer
        self.transport.adopt(rank, conn, raw)
        self.inbox.add(rank)
        self.departures.returns(rank)
        address = (host, hello.listen_port) if host and hello.listen_port else None
        relay = self.roster.relay_for(hello.site) if address else None
        self.roster.add(Member(rank, hello.speed, hello.site, address, direct=relay is None, joining=True,
                               relay=relay))
        self.roster.resplit()
        if relay is not None and address is not None:
            # Before the update the joiner catches up with: the relay reads frames in order.
            reroute(self.transport, self.roster, relay, step, peers={rank: address})
        # Its relay's address too: a site replica's member sends it its gradients.
        to_relay = {relay: self.roster.members[relay].address} if relay is not None else {}
        self.transport.send(rank, pack(self._welcome(rank, step, max_steps, donor=SERVER, catch_up=True,
                                                     peers={r: a for r, a in to_relay.items() if a})))
        self.transport.send(rank, pack(state))
        share = self.roster.batch_sizes[rank - 1]
        self.metrics.event(step, EVENT_WORKER_JOINED, subject=rank,
                           detail=f"admitted after step {step} with the state of worker {donor}; from "
                                  f"step {self.first_step_of_joiner(step, max_steps, layout)} its share is {share} of "
                                  f"{self.cfg.global_batch}")
        say(f"worker {rank} joined after step {step}; batch shares "
            f"{[n for n in self.roster.batch_sizes if n]}")

    def turn_away(self, reason: str) -> None:
        """The run ends: tell each newcomer still waiting for a boundary why none will come,
        rather than leave it to find its connection closed."""
        while self.elastic:
            try:
                conn, raw, _ = self.transport.arrivals.get_nowait()
            except queue.Empty:
                return
            self.transport.refuse(conn, pack(Abort(SERVER, reason)))

    def first_step_of_joiner(self, step: int, max_steps: int, layout: LayoutSpec) -> int:
        """A joiner admitted after `step` applies the next update with the others (the next step's,
        or under local SGD the next outer step's, of any fragment) and computes from the step after it."""
        if not self.cfg.is_local_sgd:
            return step + 2
        # Streaming: a fragment per chunk of `layout` (a model with fewer compressed elements
        # than fragments has fewer chunks, trainer.algorithm.chunk_count).
        fragments = chunk_count(layout.sparse_numel, self.cfg.exchange_chunks) if self.cfg.streams else 1
        return next_sync(step, self.cfg.sync_every, max_steps, fragments) + 1

    def _welcome(self, rank: int, step: int, max_steps: int, *, donor: int, peers: dict | None = None,
                 catch_up: bool = False) -> Welcome:
        return Welcome(tuple(self.roster.batch_sizes), tuple(self.roster.densities), max_steps, step,
                       donor, catch_up, self.roster.source(rank), peers or {}, self.roster.forwards(rank))
