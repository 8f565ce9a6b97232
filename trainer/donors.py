"""Asking a live worker for the run's state: a FETCH, which the worker answers with a STATE
holding its weights, buffers and optimizer state as of its last step (the replicas are equal).
A joiner starts from it, and a checkpoint holds it."""

from __future__ import annotations

from trainer.config import TrainConfig
from trainer.departures import Departures
from trainer.frames import Abort, Bye, Fetch, ProtocolError, State, pack, unpack
from trainer.membership import Roster
from trainer.transport import Inbox, Transport


class Donors:
    """Fetches a donor's state; a donor lost on the way is dropped (`Departures.lose`)."""

    def __init__(self, cfg: TrainConfig, roster: Roster, transport: Transport, inbox: Inbox,
                 departures: Departures) -> None:
        self.cfg, self.roster, self.transport, self.inbox, self.departures = cfg, roster, transport, inbox, departures

    def pick(self, site: str | None = None) -> int | None:
        """The worker to ask (`Roster.donor`, for a joiner of `site`); None if no live worker
        reads the server's frames."""
        return self.roster.donor(site)

    def ask(self, donor: int, step: int) -> bool:
        """FETCH to `donor`; False, and it is lost, if its connection has ended."""
        try:
            self.transport.send(donor, pack(Fetch(step)))
        except (ConnectionError, OSError) as exc:
            self.departures.lose(donor, exc, step)
            return False
        return True

    def fetch(self, donor: int, step: int, *, after_bye: bool = False, ask: bool = True) -> State | None:
        """Ask `donor` for its weights and optimizer state (as of the last step); None if it is
        lost meanwhile. Its frames that come first are kept for their round. `after_bye`: the
        donor has said BYE, so the inbox no longer reads it (it answers FETCH while it waits for
        the server's BYE): read its reply from the transport directly. A BYE met on the way (the
        last step's checkpoint, taken before the goodbye round is read) switches to that too.
        `ask=False`: it was asked already (a scheduled checkpoint); wait for the answer."""
        if ask and not self.ask(donor, step):
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
            self.departures.lose(donor, exc, step)
            return None
        finally:
            for item in reversed(held):
                self.inbox.unget(donor, item)

    def any_state(self, step: int, *, after_bye: bool = False, site: str | None = None) -> tuple[int, State] | None:
        """(donor, its state) from the first live worker that answers FETCH (for a joiner of
        `site`, one of its site's if it can); None if none is left."""
        while (donor := self.pick(site)) is not None:
            state = self.fetch(donor, step, after_bye=after_bye)
            if state is not None:
                return donor, state
        return None
