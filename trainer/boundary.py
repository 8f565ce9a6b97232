"""What the parameter server does between rounds: losses, leaves, joins, the min_workers
wait, checkpoints and preemption (docs/elastic.md). `trainer.server` answers the rounds
themselves; this mixin changes who takes part in them, only at a step boundary. The start is
`trainer.handshake`'s; the checkpoints' conversation is `trainer.checkpointing.Checkpointing`'s.

1. A worker is lost when its connection ends (a killed process: end-of-file) or when it sends
   nothing for `Roster.loss_deadline_s()` after its peers' frames of a round (a silent node, a
   link down). It is dropped, the batch is split over the others, and the next update carries
   the new shares; what its error-feedback residual held is gone.
2. A worker that leaves (BYE with `leaving`, on SIGTERM) is let go the same way, and told BYE.
3. A newcomer's HELLO waits for the next boundary. The server asks a live worker for its
   state (FETCH; the worker answers with its weights and optimizer state as of its last
   step), hands it to the newcomer with a WELCOME, sends it the next step's update to apply,
   and from the step after it computes with its share. A newcomer in a remote site hears the
   update from a worker of its site, told so with a ROUTE, as the start's relay plan would
   have had it: one WAN copy per site, not one per worker (`Roster.relay_for`).
4. Below --min-workers the server waits for joiners up to --min-workers-wait-s, then fails.
5. Checkpoints: at a boundary every --checkpoint-every steps or --checkpoint-every-s seconds,
   one file from the server's state and a live worker's, asked for and written by
   `trainer.checkpointing`; on SIGTERM one last checkpoint, then the run stops.
   A scheduled one does not hold the run up: the server keeps a copy of its own state, asks
   the worker (FETCH) and goes on with the next round; the worker answers after that step's
   gradient (its state is still the boundary's), and the file is written on a thread as the
   answer arrives. If that worker is lost first, the next boundary asks another.
"""

from __future__ import annotations

import queue
import sys
import time

import torch

from hybridtrain.contract import (
    EVENT_WAITING,
    EVENT_WORKER_JOINED,
    EVENT_WORKER_LEFT,
    EVENT_WORKER_LOST,
    next_sync,
)
from trainer.checkpointing import Checkpointer, Checkpointing
from trainer.frames import (
    BYE,
    GRAD,
    SERVER,
    STATE,
    Abort,
    Bye,
    Fetch,
    Hello,
    ProtocolError,
    Route,
    State,
    expect,
    pack,
    unpack,
)
from trainer.handshake import Handshake
from trainer.membership import Member
from trainer.wire import peek_kind

RESIDUAL_GONE = "its error-feedback residual (the part of its gradient not sent yet) is gone"


# A worker its site's relay left out of the site's frame is read this long for a BYE it sent
# on leaving (it says so to the server before its relay) before it counts as lost.
LEAVE_GRACE_S = 2.0


def _is_leaving(raw: torch.Tensor) -> bool:
    """Whether `raw` is a worker's BYE leaving a run that goes on (a spot notice)."""
    return peek_kind(raw) == BYE and unpack(raw).leaving


def _out_of_round(raw: torch.Tensor) -> bool:
    """Whether `raw` is handled as it arrives, outside the round: a leaver's BYE, or a worker's
    STATE answering a scheduled checkpoint's FETCH."""
    return peek_kind(raw) == STATE or _is_leaving(raw)


class Preempted(ProtocolError):
    """The server got SIGTERM (a spot notice): it checkpointed and stops the run."""


class TooFewWorkers(ProtocolError):
    """Fewer than --min-workers for --min-workers-wait-s: the run fails (no restart)."""


class Boundary(Handshake, Checkpointing):
    """The membership side of `trainer.server.ParameterServer` (which provides cfg, roster,
    transport, inbox, metrics, layout, step, configure(), state_dict()); its start is
    `trainer.handshake`'s, its checkpoints' conversation `trainer.checkpointing`'s."""

    def __init__(self) -> None:
        self.elastic = hasattr(self.transport, "arrivals")
        self.preempted = False
        self.last_updates: list[torch.Tensor] = []
        self._gone: set[int] = set()
        # Per-site aggregation: the last (step, chunk) each worker's frame brought (a relay's
        # carries its site's gradients), and, for a lost relay's site, the last (step, chunk)
        # of each worker's gradient that reached the server through it: what such a worker sends
        # again itself up to there is dropped, the rest is its own frames from then on.
        self._relayed: dict[int, tuple[int, int]] = {}
        self._covered: dict[int, tuple[int, int]] = {}
        self.checkpoints = Checkpointer(self.cfg)

    def say(self, text: str) -> None:
        """One line on stderr (the run's log)."""
        print(f"[ps] {text}", file=sys.stderr, flush=True)

    # -- between rounds ------------------------------------------------------------------------------
    def boundary(self) -> None:
        """Drop the lost, admit newcomers, wait below --min-workers, checkpoint when due."""
        self._drop_failed()
        self._require_a_worker()
        self._log_checkpoints()
        if self.elastic:
            self._admit_arrivals()
        if len(self.roster) < max(1, self.cfg.min_workers):
            self._wait_for_workers()
        if self.checkpoints.wanted(self.step):
            self._ask_for_checkpoint()
        if self.preempted:
            self._preempt()

    def _collect(self, ranks: list[int], *, first_s: float, then_s: float | None = None) -> dict:
        """The next frame of each of `ranks`; the ones that fail or stay silent are lost."""
        then = self.roster.loss_deadline_s() if then_s is None else then_s
        got: dict = {}
        want = list(ranks)
        while want:
            more, early, failed = self.inbox.collect(want, first_s=then if got else first_s, then_s=then,
                                                     at_once=_out_of_round)
            # Losses first: a relay's loss says which of its workers' frames came through it.
            for w, exc in failed.items():
                self.lose(w, exc)
            for w in [w for w in more if w in self._covered and self._came_through_relay(w, more[w][0])]:
                del more[w]
            # A leaver goes as its BYE arrives, not when the round's last frame does: a spot
            # notice's grace is short, and the run's events say when it left.
            for w, (raw, _) in early.items():
                if peek_kind(raw) == STATE:
                    self._take_state(w, unpack(raw))
                else:
                    self.leave(w)
            got.update(more)
            want = [w for w in want if w not in got and w not in failed and w in self.roster]
        # Rank order, whatever the arrival order: sums in floating point must not vary.
        return dict(sorted(got.items()))

    def _came_through_relay(self, rank: int, raw: torch.Tensor) -> bool:
        """Whether `raw` is a gradient chunk of `rank` that its lost relay passed on already."""
        if peek_kind(raw) != GRAD:
            return False
        frame = unpack(raw)
        return (frame.step, frame.chunk) <= self._covered[rank]

    def settle_site(self, relay: int, combined: tuple[int, ...]) -> None:
        """A relay's site frame combined `combined`: a worker of its site left out was lost or
        left on the way (the relay waits only so long), and is dropped or let go now."""
        for m in self.roster.forwards(relay):
            if m in combined or self.roster.members[m].joining:
                continue
            try:
                item = self.inbox.get(m, timeout_s=LEAVE_GRACE_S)
            except TimeoutError:
                item = None
            except (ConnectionError, OSError) as exc:
                self.lose(m, exc)
                continue
            if item is not None:
                frame = unpack(item[0])
                if isinstance(frame, Bye) and frame.leaving:
                    self.leave(m)
                    continue
                self.inbox.unget(m, item)
            self.lose(m, TimeoutError(), why=f"its site's relay {relay} went on without it")

    def _drop_failed(self) -> None:
        for w in self.roster.ranks():
            exc = self.inbox.failed(w)
            if exc is not None:
                self.lose(w, exc)

    def _let_leavers_go(self, frames: dict) -> dict:
        out = {}
        for w, f in frames.items():
            if isinstance(f, Bye) and f.leaving:
                self.leave(w)
            else:
                out[w] = f
        return out

    def lose(self, rank: int, exc: BaseException, *, why: str | None = None) -> None:
        """Drop a worker whose connection ended or that stayed silent; the others train on."""
        if rank not in self.roster:
            return
        silent = isinstance(exc, TimeoutError)
        why = why or (f"silent for {self.roster.loss_deadline_s():.1f} s after its peers' frames" if silent
                      else f"its connection ended ({exc})")
        self._drop(rank, f"worker {rank} lost at step {self.step}: {why}")
        self.metrics.event(self.step, EVENT_WORKER_LOST, subject=rank,
                           detail=f"{why}; {self._what_is_gone()}; the batch is split over {len(self.roster)} workers")
        if self.elastic:
            self.transport.forget(rank)

    def leave(self, rank: int) -> None:
        """Let a worker go that said it is leaving (a spot notice); it gets BYE."""
        self._drop(rank, f"worker {rank} left at step {self.step}")
        self.metrics.event(self.step, EVENT_WORKER_LEFT, subject=rank,
                           detail=f"left cleanly after step {self.step}; {self._what_is_gone()}; the batch is "
                                  f"split over {len(self.roster)} workers")
        try:
            self.transport.send(rank, pack(Bye(self.step, SERVER)))
        except (ConnectionError, OSError):
            pass

    def _what_is_gone(self) -> str:
        """What a worker that leaves or is lost takes with it."""
        if not self.cfg.is_local_sgd:
            return RESIDUAL_GONE
        # Under local SGD a worker that goes between outer steps takes its inner steps with it:
        # the next outer step averages the others' changes only.
        return (f"its inner steps since the outer step of step {self.step} are dropped (never averaged)"
                + (f" and {RESIDUAL_GONE}" if self.cfg.compresses else ""))

    def _drop(self, rank: int, what: str) -> None:
        self.checkpoints.lost(rank)
        relay = self.roster.source(rank)
        orphans = self.roster.remove(rank)
        self._gone.add(rank)
        self._covered.pop(rank, None)
        upto = self._relayed.pop(rank, (-1, -1))
        if relay != SERVER and relay in self.roster:
            # Its relay stops forwarding to it (and trying to connect to a peer that is gone);
            # under per-site aggregation it stops waiting for its gradients too.
            self._reroute(relay)
        self.roster.resplit()
        self.say(f"{what}; training on with {len(self.roster)} workers, batch shares "
                 f"{[n for n in self.roster.batch_sizes if n]}")
        for w in orphans:
            if self.cfg.site_aggregation:
                # Its gradients went up through the relay: what reached the server counts once,
                # and it sends the rest again itself (PSClient keeps them until applied).
                self._covered[w] = upto
            # It hears the server from now on, without waiting out a relay that went silent.
            self._reroute(w, source=SERVER)
            # Whatever of the latest step the relay may not have passed on goes to it again
            # (it skips what it already has).
            for frame in self.last_updates:
                self.transport.send(w, frame)

    # -- joins ---------------------------------------------------------------------------------------------
    def _admit_arrivals(self) -> None:
        while True:
            try:
                conn, raw, host = self.transport.arrivals.get_nowait()
            except queue.Empty:
                return
            self._arrive(conn, raw, host)

    def _arrive(self, conn, raw: torch.Tensor, host: str) -> None:
        try:
            hello = expect(raw, Hello)
        except ProtocolError as exc:
            self.transport.refuse(conn, pack(Abort(SERVER, str(exc))))
            return
        rank = hello.sender
        diff = self.layout.difference(hello.layout) if rank >= 1 else "rank 0 is the server's"
        if diff:
            self.transport.refuse(conn, pack(Abort(SERVER, f"worker {rank} cannot join: its model differs "
                                                           f"from the run's ({diff})")))
            return
        if rank in self.roster:
            # The same rank again: a restarted process whose old one the server has not missed yet.
            self.lose(rank, ConnectionError("replaced by a new process of the same rank"))
        self._settle_checkpoint()
        answer = self._state_of_a_live_worker()
        if answer is None:
            self.transport.refuse(conn, pack(Abort(SERVER, f"worker {rank} cannot join: no live worker "
                                                           "holds the model")))
            return
        donor, state = answer
        self.transport.adopt(rank, conn, raw)
        self.inbox.add(rank)
        self._gone.discard(rank)
        address = (host, hello.listen_port) if host and hello.listen_port else None
        relay = self.roster.relay_for(hello.site) if address else None
        self.roster.add(Member(rank, hello.speed, hello.site, address, direct=relay is None, joining=True,
                               relay=relay))
        self.roster.resplit()
        if relay is not None:
            # Before the update the joiner catches up with: the relay reads frames in order.
            self._reroute(relay, peers={rank: address})
        self.transport.send(rank, pack(self._welcome(rank, donor=SERVER, catch_up=True)))
        self.transport.send(rank, pack(state))
        share = self.roster.batch_sizes[rank - 1]
        self.metrics.event(self.step, EVENT_WORKER_JOINED, subject=rank,
                           detail=f"admitted after step {self.step} with the state of worker {donor}; from "
                                  f"step {self._first_step_of_joiner()} its share is {share} of "
                                  f"{self.cfg.global_batch}")
        self.say(f"worker {rank} joined after step {self.step}; batch shares "
                 f"{[n for n in self.roster.batch_sizes if n]}")

    def _first_step_of_joiner(self) -> int:
        """A joiner applies the next update with the others (the next step's, or under local SGD the
        next outer step's) and computes from the step after it."""
        if not self.cfg.is_local_sgd:
            return self.step + 2
        return next_sync(self.step, self.cfg.sync_every, self.max_steps) + 1

    def _reroute(self, relay: int, *, peers: dict | None = None, source: int | None = None) -> None:
        """Tell `relay` whom it forwards the update to now (a ROUTE; with `source`, where its own
        updates come from); a relay lost meanwhile is the loss detection's to notice."""
        try:
            self.transport.send(relay, pack(Route(self.step, self.roster.forwards(relay), peers or {}, source)))
        except (ConnectionError, OSError):
            pass

    def fetch_state(self, donor: int, *, after_bye: bool = False, ask: bool = True) -> State | None:
        """Ask `donor` for its weights and optimizer state (as of the last step); None if it is
        lost meanwhile. Its frames that come first are kept for their round. `after_bye`: the
        donor has said BYE, so the inbox no longer reads it (it answers FETCH while it waits for
        the server's BYE): read its reply from the transport directly. A BYE met on the way (the
        last step's checkpoint, taken before the goodbye round is read) switches to that too.
        `ask=False`: it was asked already (a scheduled checkpoint); wait for the answer."""
        if ask and not self._send_fetch(donor):
            return None
        held = []
        try:
            while True:
                item = ((self.transport.recv(donor), 0.0) if after_bye
                        else self.inbox.get(donor, timeout_s=self.cfg.timeout_s))
                frame = unpack(item[0])
                if isinstance(frame, State):
                    return frame
                if isinstance(frame, Abort):
                    raise ProtocolError(frame.reason)
                held.append(item)
                after_bye = after_bye or isinstance(frame, Bye)
        except (ConnectionError, TimeoutError, OSError) as exc:
            held = []
            self.lose(donor, exc)
            return None
        finally:
            for item in reversed(held):
                self.inbox.unget(donor, item)

    def _send_fetch(self, donor: int) -> bool:
        """FETCH to `donor`; False, and it is lost, if its connection has ended."""
        try:
            self.transport.send(donor, pack(Fetch(self.step)))
        except (ConnectionError, OSError) as exc:
            self.lose(donor, exc)
            return False
        return True

    def _state_of_a_live_worker(self, *, after_bye: bool = False) -> tuple[int, State] | None:
        """(donor, its state) from the first live worker that answers FETCH; None if none is left."""
        while (donor := self.roster.donor()) is not None:
            state = self.fetch_state(donor, after_bye=after_bye)
            if state is not None:
                return donor, state
        return None

    def _require_a_worker(self) -> None:
        # A joiner still catching up holds only the state of a step the run cannot finish.
        if not self.roster.active():
            raise ProtocolError(f"every worker has left or been lost at step {self.step}: no live worker holds "
                                "the model; the run restarts from its latest checkpoint")

    def _wait_for_workers(self) -> None:
        need = max(1, self.cfg.min_workers)
        wait = self.cfg.min_workers_wait_s
        self.metrics.event(self.step, EVENT_WAITING, detail=f"{len(self.roster)} workers, --min-workers {need}: "
                           f"training paused for up to {wait:.0f} s")
        self.say(f"{len(self.roster)} of the {need} workers --min-workers asks for: waiting up to {wait:.0f} s "
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
                self._drop_failed()
                self._require_a_worker()
                continue
            self._arrive(conn, raw, host)

    # -- the end ------------------------------------------------------------------------------------------
    def _preempt(self) -> None:
        ckpts = self.checkpoints
        self._settle_checkpoint()
        self._log_checkpoints(wait=True)
        saved = self.checkpoint() if self.step > ckpts.step else ckpts.step > 0
        uploaded = ckpts.close(60.0)
        where = "written and uploaded" if uploaded else "written"
        raise Preempted(f"the parameter server was preempted (SIGTERM) after step {self.step}; "
                        + (f"checkpoint of step {ckpts.step} {where}: the run resumes from it" if saved
                           else "no checkpoint could be written"))

    def finish(self) -> None:
        """Every worker said BYE: the last checkpoint, then BYE to all."""
        self._settle_checkpoint(after_bye=True)
        self._log_checkpoints(wait=True)
        if self.checkpoints.scheduled and self.step > self.checkpoints.step:
            self.checkpoint(after_bye=True)
        self.transport.send_many(self.roster.ranks(), pack(Bye(self.step, SERVER)))
        self.flush_bytes()
