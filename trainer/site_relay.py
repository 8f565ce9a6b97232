"""A worker's part in its site's relays, a helper `trainer.ps.PSClient` holds: the server's
updates it forwards to its site's peers (and the server's ROUTE, which changes who those are),
the site's gradient chunks it combines for the server under per-site aggregation, and where its
updates come from and its chunks go when its own relay is lost. The plan is `trainer.relay`'s
and `trainer.membership.Roster`'s; the combining is `trainer.site_combine`'s (docs/elastic.md).
Under site replicas the same relay combines its site's outer-step changes, and the site's joiners
become its members at their first inner step (`trainer.site_replica` averages through it)."""

from __future__ import annotations

import sys
import threading

import torch

from trainer.codec_state import codec
from trainer.config import TrainConfig
from trainer.frames import BYE, ROUTE, UPDATE, Route, Welcome, unpack
from trainer.relay import SERVER
from trainer.site_combine import SiteCombiner
from trainer.transport import Inbox, Transport
from trainer.wire import peek_kind


class SiteRelay:
    """Forward the updates down, combine the site's chunks up, and take over from a lost relay.

    No relay at first: the server's WELCOME says where updates come from and go. The inbox is
    attached once built, since the inbox's thread calls `on_frame`.
    """

    def __init__(self, cfg: TrainConfig, rank: int, transport: Transport,
                 bounds: tuple[tuple[int, int], ...]) -> None:
        self.cfg, self.rank, self.transport, self.bounds = cfg, rank, transport, bounds
        self.inbox: Inbox | None = None
        # Once this worker has left, a frame it hears is not its site's any more.
        self.left = False
        self.update_source = SERVER
        self.forwards: tuple[int, ...] = ()
        # Per-site aggregation: a remote site's workers send their chunks to the site's relay
        # (`up`), whose `combiner` makes one frame of them for the server (trainer.site_combine);
        # a member keeps the frames it sent up until their step's update is applied, to send
        # them to the server itself if its relay is lost.
        self.up = SERVER
        self.combiner: SiteCombiner | None = None
        self.unacked: list[tuple[int, torch.Tensor]] = []
        # Site replicas: workers the server routed behind this one (joiners), each with the
        # first inner step it computes; they join the site's exchanges from that step.
        self._joining: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def site(self) -> tuple[int, ...]:
        """The site members whose chunks this worker combines (empty unless it is their relay)."""
        return self.combiner.members if self.combiner is not None else ()

    def acked(self, step: int) -> None:
        """`step`'s update is applied: the chunks sent up for it need no second sending."""
        self.unacked = [(s, f) for s, f in self.unacked if s > step]

    def note_sent(self, step: int, frame: torch.Tensor) -> None:
        """Keep a chunk sent to the site's relay until its step's update is applied."""
        if self.up != SERVER:
            self.unacked.append((step, frame))

    def _relay_site(self, members: tuple[int, ...]) -> None:
        """Combine `members`' chunks with this worker's own from now on (none: stop)."""
        self.combiner = (SiteCombiner(self.rank, members, self.bounds, codec(self.cfg, "topk"), seed=self.cfg.seed)
                         if members else None)  # fmt: skip

    def take_welcome(self, welcome: Welcome) -> None:
        """Take the WELCOME's plan: whom this worker hears its updates from, whom it forwards them
        to, and (per-site aggregation) where its chunks go and whose it combines."""
        if hasattr(self.transport, "peer_addresses"):
            self.transport.peer_addresses.update(welcome.peers)
        self.update_source = welcome.source
        self.forwards = welcome.forwards
        if self.cfg.combines_at_sites:
            self.up = welcome.source
            self._relay_site(welcome.forwards)
        for peer in sorted({welcome.source, *self.site} - {SERVER}):
            self.inbox.add(peer)

    def on_frame(self, peer: int, frame: torch.Tensor) -> bool:
        """On the inbox thread: a relay forwards each update (and the final BYE) to its site's
        peers before anything reads it, since they wait on it, and takes the server's ROUTE
        (True: the frame is taken here), which comes before the first update it changes."""
        if peer != SERVER:
            return False
        kind = peek_kind(frame)
        if kind == ROUTE:
            route = unpack(frame)
            assert isinstance(route, Route)
            if hasattr(self.transport, "peer_addresses"):
                self.transport.peer_addresses.update(route.peers)
            before, self.forwards = self.forwards, route.forwards
            if self.combiner is not None:
                # Members the server dropped (or let go): the relay stops waiting for their chunks.
                with self._lock:
                    gone = self.combiner.keep(route.forwards)
                for m in gone:
                    self.inbox.fail(m, ConnectionError(f"worker {m} is out of the run (the server's word)"))
            if self.cfg.site_replicas:
                self._route_joiners(route, before)
            old = self.update_source
            if route.source is not None and old != route.source:
                # The server dropped this worker's relay, which may be silent rather than closed:
                # stop sending to it and waiting on it (`_relay_lost` takes over).
                if hasattr(self.transport, "peer_addresses"):
                    self.transport.peer_addresses.pop(old, None)
                if hasattr(self.transport, "forget"):
                    self.transport.forget(old)
                self.inbox.fail(old, ConnectionError(f"relay {old} was dropped by the server"))
            return True
        forwards = self.forwards
        # A leaving relay's BYE is its own: its peers hear from the server from then on.
        if not forwards or self.left or kind not in (UPDATE, BYE):
            return False
        self.transport.send_many(forwards, frame)
        return False

    def _route_joiners(self, route: Route, before: tuple[int, ...]) -> None:
        """Site replicas: a worker the server newly routed behind this one (not among `before`)
        is a joiner of its site, which computes from the inner step after the next outer step;
        one no longer routed is gone. (A member this relay left out stays routed to it until the
        server drops it, and is no joiner.)"""
        if self.combiner is None and route.forwards:
            self._relay_site(())
        first = (route.step // self.cfg.sync_every + 1) * self.cfg.sync_every + 1
        with self._lock:
            for m in route.forwards:
                if m not in before and m not in self._joining:
                    self._joining[m] = first
                    self.inbox.add(m)
            for m in [m for m in self._joining if m not in route.forwards]:
                del self._joining[m]

    def admit_joiners(self, step: int) -> None:
        """Site replicas: the joiners whose first inner step is `step` or earlier become members."""
        with self._lock:
            due = sorted(m for m, first in self._joining.items() if first <= step)
            for m in due:
                del self._joining[m]
            if due and self.combiner is not None:
                self.combiner.members = tuple(sorted({*self.combiner.members, *due}))

    def leave_out(self, member: int) -> None:
        """Combine `member`'s frames no more (its relay found it gone, silent or leaving)."""
        with self._lock:
            if self.combiner is not None:
                self.combiner.keep([m for m in self.combiner.members if m != member])

    def relay_lost(self, relay: int, exc: BaseException) -> None:
        """Hear the server directly from now on; under per-site aggregation, also send to it
        directly, starting with the chunks sent up that no update has answered yet (the server
        keeps those the relay passed on already and drops their copies)."""
        self.update_source = SERVER
        again = ""
        if self.up == relay:
            self.up = SERVER
            for _, frame in self.unacked:
                self.transport.send(SERVER, frame)
            steps = sorted({s for s, _ in self.unacked})
            again = f"; its gradient chunks of step(s) {steps} go to the server again" if steps else ""
        print(f"[worker rank {self.rank}] relay {relay} lost ({exc}); the server sends to this worker directly "
              f"now{again}", file=sys.stderr, flush=True)
