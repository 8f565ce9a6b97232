"""Point-to-point transports that carry encoded frames between ranks, counting every byte.

The protocol (`trainer.ps`) only sees this interface, so a test fake (`InMemoryHub`) replaces
the TCP one (`trainer.sockets`) without touching it. An `Inbox` keeps one receive posted per peer on its
own thread, so frames travel (and are timed) while the caller works on earlier ones.
Bytes are counted as they go on the wire: the 8-byte length prefix plus the frame.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

import torch

_LEN_BYTES = 8


class Transport(ABC):
    """Sends and receives uint8 frames to and from peers; counts bytes per peer."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.bytes_sent: defaultdict[int, int] = defaultdict(int)
        self.bytes_recv: defaultdict[int, int] = defaultdict(int)
        # Seconds each peer's last frame took to arrive, from its length prefix to its last
        # byte; empty where the transport cannot tell (in-memory queues).
        self.wire_s: dict[int, float] = {}

    @abstractmethod
    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Send one frame to `peer`; returns once the frame is handed over."""

    @abstractmethod
    def recv(self, peer: int, *, count: bool = True) -> torch.Tensor:
        """Receive the next frame from `peer`; `count=False` leaves its bytes to the caller (an
        Inbox counts a frame when it is consumed, so a step's record holds that step's frames)."""

    def send_many(self, peers: Iterable[int], frame: torch.Tensor) -> None:
        """The same frame to each of `peers` (the server's reply; a relay may fan it out)."""
        for p in peers:
            self.send(p, frame)

    def post_many(self, peers: Iterable[int], frame: torch.Tensor) -> Callable[[], None]:
        """Start sending `frame` to each of `peers`; the returned function waits for the sends.

        Here the sends complete before it returns (queues, emulated links that sleep); a
        transport with asynchronous sends overrides it so the caller works while bytes travel.
        """
        self.send_many(peers, frame)
        return lambda: None

    def delivery_rate(self, peer: int) -> float | None:
        """The link to `peer`'s rate as its protocol last measured it, in bytes/s; None where
        the transport cannot tell (queues, and links emulated by sleeping: their write time is
        their clock)."""
        return None

    def take_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes sent and received per peer since the last call, and reset the counters."""
        sent, recv = dict(self.bytes_sent), dict(self.bytes_recv)
        self.bytes_sent.clear()
        self.bytes_recv.clear()
        return sent, recv

    def _count(self, counter: defaultdict[int, int], peer: int, frame: torch.Tensor) -> None:
        counter[peer] += _LEN_BYTES + frame.numel()


class ThrottledTransport(Transport):
    """Wraps a worker's transport to emulate its link: sleeps bytes*8/bandwidth per frame.

    Applied on the worker for both directions of its own link, so the server never serialises
    the sleeps of several workers. Used by `--link-mbps` and the wire benchmark. With `peer`
    set, only traffic with that rank (the server) is shaped: a relay's forwards to its site's
    peers stay on the fast local network.
    """

    def __init__(self, inner: Transport, mbps: float, latency_s: float = 0.0, peer: int | None = None) -> None:
        super().__init__(inner.rank)
        if mbps <= 0:
            raise ValueError(f"link bandwidth must be > 0 Mbit/s, got {mbps}")
        self.inner = inner
        self.bytes_sent = inner.bytes_sent
        self.bytes_recv = inner.bytes_recv
        self.wire_s = inner.wire_s
        self.seconds_per_byte = 8.0 / (mbps * 1e6)
        self.latency_s = latency_s
        self.peer = peer

    def __getattr__(self, name: str):
        # The wrapped transport's own parts (a socket transport's listen port, peer addresses).
        return getattr(self.inner, name)

    def _delay(self, peer: int, nbytes: int) -> None:
        if self.peer is not None and peer != self.peer:
            return
        time.sleep(self.latency_s + (nbytes + _LEN_BYTES) * self.seconds_per_byte)

    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Send, then wait out the emulated transmission time."""
        self.inner.send(peer, frame)
        self._delay(peer, frame.numel())

    def recv(self, peer: int, *, count: bool = True) -> torch.Tensor:
        """Receive, then wait out the emulated transmission time."""
        frame = self.inner.recv(peer, count=count)
        self._delay(peer, frame.numel())
        return frame


class InMemoryHub:
    """Queues between in-process ranks (threads), for tests that fake the network seam."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._queues: defaultdict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)
        self.sent: defaultdict[tuple[int, int], int] = defaultdict(int)  # frames per (src, dst)
        self._lock = threading.Lock()

    def queue(self, src: int, dst: int) -> queue.Queue:
        """The queue of frames from `src` to `dst`."""
        with self._lock:
            return self._queues[(src, dst)]

    def transport(self, rank: int) -> InMemoryTransport:
        """A transport endpoint for `rank`."""
        return InMemoryTransport(rank, self)


class InMemoryTransport(Transport):
    """One rank's end of an `InMemoryHub`."""

    def __init__(self, rank: int, hub: InMemoryHub) -> None:
        super().__init__(rank)
        self.hub = hub

    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Enqueue a copy of the frame for `peer`."""
        self._count(self.bytes_sent, peer, frame)
        self.hub.sent[(self.rank, peer)] += 1
        self.hub.queue(self.rank, peer).put(frame.clone())

    def recv(self, peer: int, *, count: bool = True) -> torch.Tensor:
        """Dequeue the next frame from `peer`, or raise TimeoutError."""
        try:
            frame = self.hub.queue(peer, self.rank).get(timeout=self.hub.timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(f"rank {self.rank}: no frame from rank {peer}") from exc
        if count:
            self._count(self.bytes_recv, peer, frame)
        return frame


class Inbox:
    """One thread per peer receives that peer's frames back to back into a queue.

    A receive is always posted for every peer: a server that read one peer only after a slower
    peer's frame made the early peer's send time include the slow peer's compute (gloo
    completed a send only at the matching receive; over TCP a frame larger than the socket
    buffers waits the same way), and the adaptive density then read a fast link as a slow one
    (docs/trainer.md, "Transmission time"). A peer's thread stops after a frame of a kind in `last_kinds` (its goodbye), or
    when its connection fails: the error is queued after the peer's last frame, so a lost peer
    is noticed where its next frame was expected. Peers can be added while it runs (a worker
    admitted into the run). `on_frame(peer, frame)` runs on the receiving thread before the
    frame is queued: a relay forwards the server's update there, unread; a frame for which it
    returns True is taken there and never queued (a relay's ROUTE).
    """

    def __init__(
        self,
        transport: Transport,
        peers: Iterable[int],
        *,
        timeout_s: float,
        last_kinds: frozenset[int],
        on_frame: Callable[[int, torch.Tensor], bool | None] | None = None,
    ) -> None:
        from trainer.wire import peek_kind

        self.transport = transport
        self.timeout_s = timeout_s
        self._peek = peek_kind
        self._last = last_kinds
        self._on_frame = on_frame
        self._queues: dict[int, deque] = {}
        self._cond = threading.Condition()
        for p in peers:
            self.add(p)

    def add(self, peer: int) -> None:
        """Start receiving from `peer` (a fresh queue: whatever an earlier connection of the same
        rank left unread is dropped)."""
        q: deque = deque()
        with self._cond:
            self._queues[peer] = q
        # Daemon threads: a peer that never sends must not keep the process alive once the
        # caller has given up on it.
        threading.Thread(target=self._receive, args=(peer, q), daemon=True, name=f"inbox-{peer}").start()

    def _put(self, peer: int, q: deque, item: object) -> None:
        with self._cond:
            q.append(item)
            self._cond.notify_all()

    def _receive(self, peer: int, q: deque) -> None:
        while True:
            try:
                frame = self.transport.recv(peer, count=False)
                taken = self._on_frame is not None and self._on_frame(peer, frame)
            except BaseException as exc:  # handed to the caller, raised there
                self._put(peer, q, exc)
                return
            if taken:
                with self._cond:  # the byte counts are the caller's otherwise, under this lock
                    self.transport._count(self.transport.bytes_recv, peer, frame)  # noqa: SLF001
                continue
            self._put(peer, q, (frame, self.transport.wire_s.get(peer, 0.0)))
            if self._peek(frame) in self._last:
                return

    def _take(self, peer: int) -> tuple[torch.Tensor, float]:
        item = self._queues[peer].popleft()
        if isinstance(item, BaseException):
            self._queues[peer].appendleft(item)  # a lost peer stays lost
            raise item
        self.transport._count(self.transport.bytes_recv, peer, item[0])  # noqa: SLF001 - the counter's owner
        return item

    def get(self, peer: int, timeout_s: float | None = None) -> tuple[torch.Tensor, float]:
        """The next frame from `peer` and the seconds its bytes took to arrive."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        with self._cond:
            while not self._queues[peer]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.transport.rank}: nothing from rank {peer} within "
                                       f"{wait:.0f} s (--timeout-s)") from None
                self._cond.wait(left)
            return self._take(peer)

    @property
    def peers(self) -> list[int]:
        """Every peer this inbox has received from."""
        with self._cond:
            return sorted(self._queues)

    def holds(self, peer: int, match: Callable[[torch.Tensor], bool]) -> bool:
        """Whether `peer`'s queue holds a frame `match` says yes to, or the error that ended its
        thread; never waits, and takes nothing."""
        with self._cond:
            q = self._queues.get(peer)
            return bool(q) and any(isinstance(item, BaseException) or match(item[0]) for item in q)

    def unget(self, peer: int, item: tuple[torch.Tensor, float]) -> None:
        """Put a frame back at the front of `peer`'s queue (read early, handled later)."""
        self.transport.bytes_recv[peer] -= 8 + item[0].numel()
        with self._cond:
            self._queues[peer].appendleft(item)
            self._cond.notify_all()

    def fail(self, peer: int, exc: BaseException) -> None:
        """Mark `peer` lost from outside (the server said so): a wait on it ends with `exc` once
        the frames already received from it are read."""
        with self._cond:
            q = self._queues.get(peer)
            if q is not None and not (q and isinstance(q[-1], BaseException)):
                q.append(exc)
                self._cond.notify_all()

    def failed(self, peer: int) -> BaseException | None:
        """The error that ended `peer`'s receiving thread, if it has ended with one."""
        with self._cond:
            q = self._queues.get(peer)
            return q[-1] if q and isinstance(q[-1], BaseException) else None

    def collect(self, peers: Iterable[int], *, first_s: float, then_s: float,
                at_once: Callable[[torch.Tensor], bool] | None = None,
                consume: Callable[[int, torch.Tensor], bool] | None = None,
                ) -> tuple[dict[int, tuple[torch.Tensor, float]], dict[int, tuple[torch.Tensor, float]],
                           dict[int, BaseException]]:
        """The next frame of each of `peers`: waits up to `first_s` for the first to arrive and
        `then_s` after it for the rest. Returns the frames, the frames `at_once` said yes to (a
        worker leaving: these return at once and do not start the `then_s` clock) and, for peers
        that failed or stayed silent, why (a connection error, or TimeoutError); returns early
        at a failure, leaving the frames of peers still to come in their queues. A frame
        `consume(peer, frame)` takes (True; a late change) is the caller's, and the peer's next
        frame is read in its place, on the same clock."""
        want = list(peers)
        got: dict[int, tuple[torch.Tensor, float]] = {}
        early: dict[int, tuple[torch.Tensor, float]] = {}
        failed: dict[int, BaseException] = {}
        deadline = time.monotonic() + first_s
        first = True
        with self._cond:
            while True:
                for p in want:
                    item: tuple[torch.Tensor, float] | None = None
                    while p not in got and p not in early and p not in failed and self._queues[p]:
                        try:
                            item = self._take(p)
                        except BaseException as exc:  # noqa: BLE001 - reported per peer
                            failed[p] = exc
                            break
                        if consume is None or not consume(p, item[0]):
                            break
                        item = None
                    if item is None:
                        continue
                    if at_once is not None and at_once(item[0]):
                        # A leaver's BYE comes as its peers start computing: timing them from
                        # it would hold them to the loss deadline a whole step early.
                        early[p] = item
                        continue
                    got[p] = item
                    if first:
                        first = False
                        deadline = time.monotonic() + then_s
                pending = [p for p in want if p not in got and p not in early and p not in failed]
                # A failure returns at once: the caller may have to act on it before the others
                # can send (a lost relay's peers wait for the server to take over).
                if not pending or failed or early:
                    return got, early, failed
                left = deadline - time.monotonic()
                if left <= 0:
                    for p in pending:
                        failed[p] = TimeoutError(f"rank {p} sent nothing within {first_s if first else then_s:.1f} s")
                    return got, early, failed
                self._cond.wait(left)
