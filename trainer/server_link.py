"""What a worker hears from the server, a helper `trainer.ps.PSClient` holds: the next frame of
a kind, and a step's update chunk by chunk, from the server or the worker's site relay
(`trainer.site_relay`). Whenever the worker waits, the server may ask for its state (a FETCH,
for a joiner or a checkpoint) or end the run (its BYE): both are taken here, on the way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.frames import ABORT, BYE, UPDATE, Bye, Fetch, ProtocolError, Update, check, expect, unpack
from trainer.relay import SERVER
from trainer.site_relay import SiteRelay
from trainer.transport import Inbox
from trainer.wire import peek_head


class ServerLink:
    """The server's frames as the worker reads them; `ended` once the server has said BYE."""

    def __init__(self, rank: int, inbox: Inbox, relay: SiteRelay, chunks: int, *,
                 answer_fetch: Callable[[], None], on_end: Callable[[], None]) -> None:
        self.rank, self.inbox, self.relay, self.chunks = rank, inbox, relay, chunks
        self._answer_fetch, self._on_end = answer_fetch, on_end
        self.ended = False

    def _end(self) -> None:
        self.ended = True
        self._on_end()

    def expect(self, cls: type, step: int | None = None) -> Any:
        """The server's next frame, a `cls` (of `step`, when given); None when the server has
        ended the run first."""
        while True:
            raw = self.inbox.get(SERVER)[0]
            frame = unpack(raw)
            if isinstance(frame, Fetch):
                self._answer_fetch()
                continue
            if isinstance(frame, Bye) and cls is not Bye:
                self._end()
                return None
            if isinstance(frame, cls) and (step is None or frame.step == step):
                return frame
            return expect(raw, cls, step, peer=SERVER)

    def update_arrived(self, step: int, last: int) -> bool:
        """Whether reading `step`'s update would not wait for the wire: its round's last chunk
        `last` is here (streaming: the last of its fragments', not the exchange's), or the run's
        end or a lost link is (reading it then ends at once). Never waits."""

        def ends_the_wait(raw: torch.Tensor) -> bool:
            kind, at, first = peek_head(raw)
            return (kind == UPDATE and at == step and first == last) or kind in (BYE, ABORT)

        return self.inbox.holds(self.relay.update_source, ends_the_wait)

    def read_update(self, step: int, take: Callable[[Update], None], *, start: int = 0,
                    stop: int | None = None) -> None:
        """Hand `take` every chunk of `step`'s update (from chunk `start`, before chunk `stop`).

        If the relay is lost, the server sends to this worker itself, starting again with the
        latest step it sent: chunks already taken are skipped.
        """
        c, stop = start, self.chunks if stop is None else stop
        while c < stop:
            source = self.relay.update_source
            try:
                raw, _ = self.inbox.get(source)
            except (ConnectionError, TimeoutError) as exc:
                # The relay's connection ended, or the server dropped it (its ROUTE): the server
                # has taken over.
                if source == SERVER:
                    raise
                self.relay.relay_lost(source, exc)
                continue
            frame = unpack(raw)
            if isinstance(frame, Fetch):
                self._answer_fetch()
                continue
            if isinstance(frame, Bye) and source == SERVER and c == start:
                # The run ended before this round's update (a joiner's, or an outer step still on
                # its way, whose round may begin at a later fragment's chunk): nothing to apply.
                self._end()
                return
            if isinstance(frame, Update) and (frame.step, frame.chunk) < (step, c):
                continue  # a lost relay's step, sent again by the server
            update = check(frame, Update, step, peer=source)
            if update.chunk != c:
                raise ProtocolError(f"rank {self.rank}: expected chunk {c} of step {step}, got {update.chunk}")
            take(update)
            c += 1
        if c == self.chunks:
            self.relay.acked(step)

    def wait_for_byes(self, own_peers: set[int]) -> None:
        """After the server's BYE: every other receiving thread ends with its peer's BYE too (the
        relay's forward of the server's; each site member's own), so none is cut off mid-frame."""
        for peer in sorted(own_peers - {SERVER}):
            try:
                expect(self.inbox.get(peer)[0], Bye, peer=peer)
            except (ConnectionError, TimeoutError):
                pass  # a relay or site peer gone meanwhile: the server has the run's BYE
