"""A worker's place in a parameter-server run: how it starts (the common weights, or the run's
state when it joins or the run resumes), how it hears the server (a FETCH for its state may
come whenever it waits), how it reads a step's updates, and how it leaves (docs/elastic.md). A
mixin of `trainer.ps.PSClient`, which provides the model, optimizer, transport, inbox and step;
its site's relays are `trainer.site_relay`'s."""

from __future__ import annotations

import torch

from trainer.algorithm import float_buffers
from trainer.frames import (
    Bye,
    Fetch,
    Hello,
    ProtocolError,
    State,
    Update,
    Welcome,
    check,
    expect,
    pack,
    unpack,
)
from trainer.relay import SERVER


class Session:
    """Start, the server's frames, the updates, leaving and the goodbye."""

    def start(self) -> None:
        """HELLO, then the server's plan, then the run's state: the replicas' common starting
        weights, or (joining, resuming) the run's current model and optimizer state."""
        listen = getattr(self.transport, "listen_port", None)
        site = self.cfg.sites[self.rank] if self.rank < len(self.cfg.sites) else None
        speed = self.cfg.speeds[self.index] if self.index < len(self.cfg.speeds) else None
        hello = Hello(self.rank, self.layout.spec, self.train_samples, self.cfg.join, speed, site, listen)
        self.transport.send(SERVER, pack(hello))
        welcome = expect(self.inbox.get(SERVER)[0], Welcome, peer=SERVER)
        self.batch_sizes = list(welcome.batch_sizes)
        self.densities = list(welcome.densities)
        self.max_steps = welcome.max_steps
        self.step = welcome.start_step
        self._route(welcome)
        if welcome.donor == self.rank:
            self.transport.send(SERVER, pack(self.state_frame()))
            return
        state = self._from_server(State)
        if state is None:
            return
        self.load_state(state)
        if welcome.catch_up:
            # A joiner has the state of the last step; the next step's update, which the others
            # are computing now, brings it level with them (under local SGD, the next outer step's).
            upto = self.next_round(self.step)
            self._read_updates(upto)
            if not self.ended_by_server:
                self.step = upto

    def next_round(self, step: int) -> int:
        """The step of the next update after `step`: the next step, or local SGD's next outer step."""
        return step + 1 if self.local is None else self.local.next(step, self.max_steps)

    def state_frame(self) -> State:
        """This replica's weights, float buffers and optimizer state (a joiner's or a checkpoint's).
        Under local SGD the weights are the common ones of the last outer step, and the optimizer
        state holds the outer optimizer's beside the inner one's."""
        from trainer.checkpoint import to_bytes

        buffers = float_buffers(self.model)
        flat = torch.cat([b.reshape(-1).float().cpu() for b in buffers]) if buffers else torch.zeros(0)
        if self.local is None:
            return State(self.rank, self._flat_params().cpu(), flat, self.step, to_bytes(self.optimizer.state_dict()))
        optimizer = {"inner": self.optimizer.state_dict(), "outer": self.local.state_dict()}
        return State(self.rank, self.local.common.cpu(), flat, self.local.synced_step, to_bytes(optimizer))

    def _answer_fetch(self) -> None:
        # Posted, not waited for: the sender thread writes it while this worker applies the
        # update and computes (a checkpoint's state is tens of MB); a failed write shows at the
        # next send on the link.
        self.transport.post_many([SERVER], pack(self.state_frame()))

    def load_state(self, state: State) -> None:
        """Take the run's weights, buffers and (when sent) optimizer state."""
        from trainer.checkpoint import from_bytes

        with torch.no_grad():
            for name, off, n in zip(self.layout.names, self.layout.offsets, self.layout.numels):
                p = self._params[name]
                p.copy_(state.params[off : off + n].view_as(p))
            off = 0
            for b in float_buffers(self.model):
                b.copy_(state.buffers[off : off + b.numel()].view_as(b))
                off += b.numel()
        optimizer = from_bytes(state.optimizer) if state.optimizer else None
        if self.local is not None:
            self.local.reset(state.params.to(self.local.common.device), state.step)
            if isinstance(optimizer, dict) and "outer" in optimizer:
                self.local.load_state_dict(optimizer["outer"])
                optimizer = optimizer["inner"]
        if optimizer:
            # Written by an adapted optimizer (decay already moved into the gradient).
            self.optimizer.load_state_dict(optimizer)

    def _from_server(self, cls: type, step: int | None = None):
        """The server's next frame, a `cls`; a FETCH on the way is answered with this worker's
        state. None when the server has ended the run first (its BYE)."""
        while True:
            raw = self.inbox.get(SERVER)[0]
            frame = unpack(raw)
            if isinstance(frame, Fetch):
                self._answer_fetch()
                continue
            if isinstance(frame, Bye) and cls is not Bye:
                self.ended_by_server = True
                self.max_steps = min(self.max_steps, self.step)
                return None
            if isinstance(frame, cls) and (step is None or frame.step == step):
                return frame
            return expect(raw, cls, step, peer=SERVER)

    def _read_updates(self, step: int, *, start: int = 0, stop: int | None = None) -> None:
        """Apply every chunk of `step`'s update (from chunk `start`, before chunk `stop`), from the
        server or this worker's relay.

        If the relay is lost, the server sends to this worker itself, starting again with the
        latest step it sent: chunks already applied are skipped. A FETCH from the server (this
        worker's state for a joiner or a checkpoint) is answered on the way.
        """
        c, stop = start, len(self.bounds) if stop is None else stop
        while c < stop:
            source = self._update_source
            try:
                raw, _ = self.inbox.get(source)
            except (ConnectionError, TimeoutError) as exc:
                # The relay's connection ended, or the server dropped it (its ROUTE): the server
                # has taken over.
                if source == SERVER:
                    raise
                self._relay_lost(source, exc)
                continue
            frame = unpack(raw)
            if isinstance(frame, Fetch):
                self._answer_fetch()
                continue
            if isinstance(frame, Bye) and source == SERVER and not c:
                # The run ended while this worker was joining: nothing more to apply.
                self.ended_by_server = True
                self.max_steps = min(self.max_steps, self.step)
                return
            if isinstance(frame, Update) and (frame.step, frame.chunk) < (step, c):
                continue  # a lost relay's step, sent again by the server
            update = check(frame, Update, step, peer=source)
            if update.chunk != c:
                raise ProtocolError(f"rank {self.rank}: expected chunk {c} of step {step}, got {update.chunk}")
            self.apply(update)
            c += 1
        if c == len(self.bounds):
            self.unacked = [(s, f) for s, f in self.unacked if s > step]

    def close(self) -> None:
        """BYE to the server; returns once the server has said BYE too."""
        if self.left or self.ended_by_server:
            return
        self.transport.send(SERVER, pack(Bye(self.step, self.rank)))
        if self.up != SERVER:  # ends the relay's wait on this worker's chunks
            self.transport.send(self.up, pack(Bye(self.step, self.rank)))
        # A relay forwards the server's BYE to its peers from the inbox thread, which ends theirs.
        self._from_server(Bye)
        # Every other receiving thread ends with its peer's BYE too (the relay's forward of the
        # server's; each site member's own): wait for them all, so none is cut off mid-frame.
        for peer in sorted({self._update_source, *self.site} - {SERVER}):
            try:
                expect(self.inbox.get(peer)[0], Bye, peer=peer)
            except (ConnectionError, TimeoutError):
                pass  # a relay or site peer gone meanwhile: the server has the run's BYE
        self.flush_bytes()

    def leave(self) -> None:
        """Leave a run that goes on (a spot notice): BYE with `leaving` at this step boundary;
        returns once the server has let this worker go."""
        if self.left:
            return
        self.left = True
        self.transport.send(SERVER, pack(Bye(self.step, self.rank, leaving=True)))
        if self.up != SERVER:  # its relay stops waiting for this worker's chunks at once
            self.transport.send(self.up, pack(Bye(self.step, self.rank, leaving=True)))
        self._from_server(Bye)
        self.flush_bytes()

