"""Point-to-point transports that carry encoded frames between ranks, counting every byte.

The algorithm (`trainer.ps`) only sees this interface, so a test fake replaces the
torch.distributed one without touching it.
Bytes are counted as they go on the wire: the 8-byte length prefix plus the frame.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

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
    def recv(self, peer: int) -> torch.Tensor:
        """Receive the next frame from `peer`."""

    def recv_many(self, peers: Iterable[int]) -> dict[int, torch.Tensor]:
        """The next frame from each of `peers`."""
        return {p: self.recv(p) for p in peers}

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

    def recv_rounds(self, peers: Iterable[int], rounds: int) -> Iterator[dict[int, torch.Tensor]]:
        """`rounds` frames from each of `peers`, yielded round by round (a pipelined step)."""
        peers = list(peers)
        for _ in range(rounds):
            yield self.recv_many(peers)

    def take_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes sent and received per peer since the last call, and reset the counters."""
        sent, recv = dict(self.bytes_sent), dict(self.bytes_recv)
        self.bytes_sent.clear()
        self.bytes_recv.clear()
        return sent, recv

    def _count(self, counter: defaultdict[int, int], peer: int, frame: torch.Tensor) -> None:
        counter[peer] += _LEN_BYTES + frame.numel()


class TorchTransport(Transport):
    """torch.distributed isend/irecv (gloo) with a length prefix; receives from many at once."""

    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Length prefix, then the frame."""
        self.send_many([peer], frame)

    def send_many(self, peers: Iterable[int], frame: torch.Tensor) -> None:
        """Post every send before waiting, so the links run in parallel."""
        self.post_many(peers, frame)()

    def post_many(self, peers: Iterable[int], frame: torch.Tensor) -> Callable[[], None]:
        """Post the length prefix and the frame to every peer; the sends complete in the background."""
        length = torch.tensor([frame.numel()], dtype=torch.int64)
        works = []
        for p in peers:
            works.append(dist.isend(length, p))
            works.append(dist.isend(frame, p))
            self._count(self.bytes_sent, p, frame)

        def wait() -> None:
            # `length` and `frame` stay referenced here until gloo is done with them.
            for w in works:
                w.wait()

        return wait

    def recv(self, peer: int) -> torch.Tensor:
        """The next frame from `peer`."""
        return self.recv_many([peer])[peer]

    def recv_many(self, peers: Iterable[int]) -> dict[int, torch.Tensor]:
        """The next frame from each of `peers`, each received on its own thread (`recv_rounds`)."""
        return next(self.recv_rounds(peers, 1))

    def recv_rounds(self, peers: Iterable[int], rounds: int) -> Iterator[dict[int, torch.Tensor]]:
        """Each peer's receives run back to back on its own thread, so round r+1's bytes travel
        (and are counted into `wire_s`, summed over the rounds) while the caller works on round r.

        A peer's frame receive is posted as soon as its own length prefix arrives. gloo
        completes a send only once the receiver has posted the matching receive, so posting
        every frame receive after the slowest peer's prefix (as one wait-all would) made an
        early peer's send time include the slowest peer's compute: the adaptive density then
        read a fast link as a slow one (docs/trainer.md, "Transmission time").
        """
        peers = list(peers)
        if len(peers) == 1 and rounds == 1:
            frame = self._recv_one(peers[0])
            self._count(self.bytes_recv, peers[0], frame)
            yield {peers[0]: frame}
            return
        done: queue.Queue[tuple[int, int, torch.Tensor | BaseException, float]] = queue.Queue()

        def receive(peer: int) -> None:
            for r in range(rounds):
                try:
                    frame = self._recv_one(peer)
                except BaseException as exc:  # handed to the caller, raised there
                    done.put((peer, r, exc, 0.0))
                    return
                done.put((peer, r, frame, self.wire_s[peer]))

        # Daemon threads: a peer that never sends must not keep the process alive once the
        # caller has given up on it (gloo's own timeout ends the wait).
        for p in peers:
            threading.Thread(target=receive, args=(p,), daemon=True, name=f"recv-{p}").start()
        pending: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        wire = dict.fromkeys(peers, 0.0)
        for r in range(rounds):
            while len(pending[r]) < len(peers):
                peer, at, result, seconds = done.get()
                if isinstance(result, BaseException):
                    raise result
                pending[at][peer] = result
                wire[peer] += seconds
                self._count(self.bytes_recv, peer, result)
            if r == rounds - 1:
                self.wire_s.update(wire)
            yield pending.pop(r)

    def _recv_one(self, peer: int) -> torch.Tensor:
        length = torch.zeros(1, dtype=torch.int64)
        dist.irecv(length, peer).wait()
        t0 = time.perf_counter()
        frame = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.irecv(frame, peer).wait()
        # The sender's own clock stops once the frame sits in its socket buffer, which holds
        # megabytes: on a shaped link only the receiver sees how long the bytes took.
        self.wire_s[peer] = time.perf_counter() - t0
        return frame


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
        self.seconds_per_byte = 8.0 / (mbps * 1e6)
        self.latency_s = latency_s
        self.peer = peer

    def _delay(self, peer: int, nbytes: int) -> None:
        if self.peer is not None and peer != self.peer:
            return
        time.sleep(self.latency_s + (nbytes + _LEN_BYTES) * self.seconds_per_byte)

    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Send, then wait out the emulated transmission time."""
        self.inner.send(peer, frame)
        self._delay(peer, frame.numel())

    def recv(self, peer: int) -> torch.Tensor:
        """Receive, then wait out the emulated transmission time."""
        frame = self.inner.recv(peer)
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

    def recv(self, peer: int) -> torch.Tensor:
        """Dequeue the next frame from `peer`, or raise TimeoutError."""
        try:
            frame = self.hub.queue(peer, self.rank).get(timeout=self.hub.timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(f"rank {self.rank}: no frame from rank {peer}") from exc
        self._count(self.bytes_recv, peer, frame)
        return frame
