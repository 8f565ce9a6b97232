"""Plain heartbeats that arrive together are written together (a group commit).

A thousand agents beating every 5 s are 200 beats a second; written one by one each is a pool
checkout, a transaction and a commit. Here the first plain beat to find no batch being written
writes at once, alone; beats that arrive while a batch is being written wait for it to end and
then go in the next one, written by the first of them, in its own request's session. So a lone
beat waits for nothing, and under load the batches grow by themselves, without a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio.to_thread
from sqlalchemy.orm import Session

from app.queries.agents import PlainBeat, record_plain_beats

# One UPDATE of this many rows stays a few milliseconds; more wait for the next batch.
MAX_BATCH = 500


@dataclass
class _Waiting:
    beat: PlainBeat
    node_id: asyncio.Future[int | None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BeatBatches:
    """The plain beats of one process waiting to be written; `record` is called on the event loop."""

    def __init__(self, write: Callable[[Session, list[PlainBeat]], dict[str, int]] | None = None) -> None:
        self._write = write or _write
        self._waiting: list[_Waiting] = []
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def record(self, session: Session, beat: PlainBeat, limiter: anyio.CapacityLimiter | None = None) -> int | None:
        """Write `beat` with the others waiting; its node's id, or None if its node did not take it
        (the beat has work to do, or its token is unknown: `apply_heartbeat` decides). A batch is
        written in a thread of `limiter` (the default one without)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # A lock and futures belong to one loop; an app served again (tests) starts afresh.
            self._loop, self._lock, self._waiting = loop, asyncio.Lock(), []
        mine = _Waiting(beat)
        self._waiting.append(mine)
        # Beats ahead of it whose requests were cancelled still fill a batch: it may lead one, then its own.
        while not mine.node_id.done():
            async with self._lock:
                if not mine.node_id.done():
                    batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
                    await self._lead(session, batch, limiter)
        return mine.node_id.result()

    async def _lead(self, session: Session, batch: list[_Waiting], limiter: anyio.CapacityLimiter | None) -> None:
        try:
            found = await anyio.to_thread.run_sync(self._write, session, [w.beat for w in batch], limiter=limiter)
        except Exception as exc:
            # Each beat's request (this one's too) raises it as a failed write of its own would:
            # 503 for a database that is unavailable.
            for waiting in batch:
                waiting.node_id.set_exception(exc)
            return
        except BaseException:
            for waiting in batch:  # the server is stopping: no beat of the batch is left waiting
                waiting.node_id.cancel()
            raise
        for waiting in batch:
            waiting.node_id.set_result(found.get(waiting.beat.token_hash))


def _write(session: Session, beats: list[PlainBeat]) -> dict[str, int]:
    found = record_plain_beats(session, beats)
    session.commit()
    return found
