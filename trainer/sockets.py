"""The parameter server's wire: plain TCP that admits workers at any time (docs/elastic.md).

torch.distributed fixes the world size when the group forms, so a worker that joins later, or
one that is lost, ends the group. Here the server listens on master_addr:master_port and
workers connect whenever they start, naming themselves in their first frame (HELLO); the
server adopts a connection at a step boundary and drops it when its worker is lost or leaves.
A lost process shows as end-of-file or a reset on its connection (`PeerLost`); a silent node is
the server's deadline to notice (trainer.membership).

Frames are the same as over torch.distributed: an 8-byte little-endian length, then the bytes,
counted per peer. Each connection has one sender thread, so the server posts one update to all
workers at once and a slow link holds up only its own queue.

Site relays (trainer.relay): a worker that forwards or receives within its site also listens
on an ephemeral port, says which in HELLO, and learns its peers' addresses from the server's
WELCOME; worker-to-worker connections open on first send and carry one direction each.

With the run's link secret (trainer.linktls), a process without the secret is refused before
its first frame, and every connection between sites is mutual TLS; one within a site (the
ranks' `sites`) is plain TCP once both ends proved the secret. Each socket passes through
`_secure_accepted` or `_secure_connected` once connected; nothing else touches the raw socket.
"""

from __future__ import annotations

import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from trainer.linktls import LinkTls
from trainer.transport import Transport

SERVER = 0
_LEN = struct.Struct("<Q")
_RANK = struct.Struct("<q")
# A frame longer than this is garbage on the wire (or not our protocol): refuse to allocate it.
_MAX_FRAME = 1 << 34
_MAX_HELLO = 64 << 20


# A joiner's connect retries: its run's server is up already, so this covers a slow accept
# or a short network blip, not a server that is still importing torch.
JOIN_CONNECT_S = 30.0


class PeerLost(ConnectionError):
    """A peer's connection ended: its process exited or was killed, or its link broke."""


def _recv_exact(sock: socket.socket, n: int, buf: bytearray | memoryview | None = None) -> memoryview:
    out = memoryview(buf) if buf is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(out[got:], n - got)
        if k == 0:
            raise PeerLost("connection closed by the peer")
        got += k
    return out


def read_frame(sock: socket.socket, limit: int = _MAX_FRAME) -> tuple[torch.Tensor, float]:
    """One length-prefixed frame from `sock` and the seconds its bytes took after the prefix."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > limit:
        raise PeerLost(f"a frame of {n} bytes announced: not a hybridtrain peer")
    t0 = time.perf_counter()
    frame = torch.empty(n, dtype=torch.uint8)
    if n:
        _recv_exact(sock, n, frame.numpy().data.cast("B"))
    return frame, time.perf_counter() - t0


def write_frame(sock: socket.socket, frame: torch.Tensor) -> None:
    """The length prefix, then the frame's bytes."""
    data = np.ascontiguousarray(frame.detach().cpu().numpy())
    sock.sendall(_LEN.pack(data.nbytes))
    if data.nbytes:
        sock.sendall(data.data.cast("B"))


# struct tcp_info (linux/tcp.h) up to tcpi_delivery_rate, a u64 of bytes/s at offset 160
# (Linux 4.9 and later; an older kernel returns a shorter struct).
_TCP_INFO_LEN = 168
_DELIVERY_RATE = struct.Struct("<Q")
_DELIVERY_RATE_AT = 160


def delivery_rate(sock: socket.socket) -> float | None:
    """TCP's latest delivery-rate sample for `sock` in bytes/s (trainer.linkclock); None where
    the platform or kernel does not give one."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    if tcp_info is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    (rate,) = _DELIVERY_RATE.unpack_from(info, _DELIVERY_RATE_AT)
    return float(rate) if rate else None


def _tune(sock: socket.socket) -> None:
    # Frames are written whole; Nagle would hold a small tail back for an ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class _Link:
    """One connection's sending side: a thread writes queued frames in order."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name=f"send-{peer}").start()

    def post(self, frame: torch.Tensor) -> threading.Event:
        """Queue `frame`; the event is set once it is written (or the link has failed)."""
        done = threading.Event()
        if self.error is not None:
            done.set()
        else:
            self._queue.put((frame, done))
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            frame, done = item
            try:
                if self.error is None:
                    write_frame(self.sock, frame)
            except OSError as exc:
                self.error = exc
            finally:
                done.set()

    def close(self) -> None:
        """Stop the sender and close the socket (a blocked receive on it ends with PeerLost)."""
        self._queue.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SocketTransport(Transport):
    """What the server's and the workers' ends share: links per peer, receives, byte counts."""

    def __init__(self, rank: int, *, timeout_s: float, tls: LinkTls | None = None,
                 sites: Sequence[str] = ()) -> None:
        super().__init__(rank)
        self.timeout_s = timeout_s
        self.tls = tls
        self.sites = tuple(sites)
        self._send_links: dict[int, _Link] = {}
        self._recv_socks: dict[int, socket.socket] = {}
        self._cond = threading.Condition()
        self._closed = False

    def _secure_accepted(self, sock: socket.socket) -> socket.socket:
        """An accepted `sock` once its peer proved the run's secret (over TLS if it asked)."""
        return sock if self.tls is None else self.tls.accept(sock)  # type: ignore[return-value]

    def _secure_connected(self, sock: socket.socket, peer: int) -> socket.socket:
        """A connected `sock` to `peer`: TLS unless both ends are known to share a site."""
        if self.tls is None:
            return sock
        return self.tls.connect(sock, encrypt=not self._same_site(peer))  # type: ignore[return-value]

    def _same_site(self, peer: int) -> bool:
        if max(self.rank, peer) >= len(self.sites):
            return False
        return bool(self.sites[self.rank]) and self.sites[self.rank] == self.sites[peer]

    def _send_link(self, peer: int) -> _Link | None:
        with self._cond:
            return self._send_links.get(peer)

    def delivery_rate(self, peer: int) -> float | None:
        """TCP's latest delivery-rate sample on the link to `peer`, in bytes/s."""
        link = self._send_link(peer)
        return None if link is None else delivery_rate(link.sock)

    def post_many(self, peers: Iterable[int], frame: torch.Tensor) -> Callable[[], None]:
        """Queue `frame` on every peer's link; the returned function waits until all are written."""
        posted = []
        for p in peers:
            link = self._send_link(p)
            if link is None:
                self._missing(p)
                continue
            posted.append((p, link, link.post(frame)))
            self._count(self.bytes_sent, p, frame)

        def wait() -> None:
            for p, link, done in posted:
                done.wait()
                if link.error is not None:
                    self._failed(p, link.error)

        return wait

    def send(self, peer: int, frame: torch.Tensor) -> None:
        """Send one frame and wait until it is written."""
        self.post_many([peer], frame)()

    def send_many(self, peers: Iterable[int], frame: torch.Tensor) -> None:
        """The same frame to each of `peers`, written in parallel."""
        self.post_many(peers, frame)()

    def _missing(self, peer: int) -> None:
        """A send to a peer with no link: the server and relays skip it (its loss is the
        receiving side's to notice)."""

    def _failed(self, peer: int, exc: BaseException) -> None:
        """A send that failed: skipped likewise, unless a subclass must stop."""

    def recv(self, peer: int, *, count: bool = True) -> torch.Tensor:
        """The next frame from `peer`; PeerLost when its connection ends."""
        sock = self._recv_sock(peer)
        try:
            frame, wire_s = read_frame(sock)
        except PeerLost as exc:
            raise PeerLost(f"rank {peer}: {exc}") from None
        except OSError as exc:
            raise PeerLost(f"rank {peer}: {exc}") from exc
        self.wire_s[peer] = wire_s
        if count:
            self._count(self.bytes_recv, peer, frame)
        return frame

    def _recv_sock(self, peer: int) -> socket.socket:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while peer not in self._recv_socks:
                if self._closed:
                    raise PeerLost(f"rank {peer}: transport closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: rank {peer} never connected within {self.timeout_s:.0f} s")
                self._cond.wait(left)
            return self._recv_socks[peer]

    def forget(self, peer: int) -> None:
        """Close and forget `peer`'s connections (a dropped worker)."""
        with self._cond:
            link = self._send_links.pop(peer, None)
            sock = self._recv_socks.pop(peer, None)
        if link is not None:
            link.close()
        if sock is not None and (link is None or sock is not link.sock):
            sock.close()

    def close(self) -> None:
        """Close every connection."""
        with self._cond:
            self._closed = True
            peers = set(self._send_links) | set(self._recv_socks)
            self._cond.notify_all()
        for p in peers:
            self.forget(p)


class ServerSocketTransport(SocketTransport):
    """Rank 0: listens for workers; a new connection's first frame waits in `arrivals` until
    the server adopts (or refuses) it at a step boundary."""

    def __init__(self, host: str, port: int, *, timeout_s: float, tls: LinkTls | None = None) -> None:
        super().__init__(SERVER, timeout_s=timeout_s, tls=tls)
        self.arrivals: queue.Queue[tuple[socket.socket, torch.Tensor, str]] = queue.Queue()
        # Told each new connection's first frame once it waits in `arrivals`, on the greeting
        # thread: the server says whom it has heard while its own thread waits for a round.
        self.on_arrival: Callable[[torch.Tensor], None] | None = None
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((host, port))
        except OSError:
            # master_addr may be an address this host is reached by but does not own (NAT).
            self.listener.bind(("", port))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="accept").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn, addr[0]), daemon=True, name="greet").start()

    def _greet(self, conn: socket.socket, host: str) -> None:
        try:
            _tune(conn)
            # The deadline covers the handshake too: a silent connection never holds a thread.
            conn.settimeout(self.timeout_s)
            conn = self._secure_accepted(conn)
            # A HELLO is a few kilobytes of layout: anything far larger is not a worker.
            frame, _ = read_frame(conn, limit=_MAX_HELLO)
            conn.settimeout(None)
        except (OSError, PeerLost):
            conn.close()
            return
        self.arrivals.put((conn, frame, host))
        if self.on_arrival is not None:
            self.on_arrival(frame)

    def adopt(self, peer: int, conn: socket.socket, first: torch.Tensor) -> None:
        """Make `conn` rank `peer`'s connection (replacing an old one); its first frame counts."""
        self.forget(peer)
        with self._cond:
            self._send_links[peer] = _Link(conn, peer)
            self._recv_socks[peer] = conn
            self._cond.notify_all()
        self._count(self.bytes_recv, peer, first)

    @staticmethod
    def refuse(conn: socket.socket, frame: torch.Tensor) -> None:
        """Answer a connection the server will not adopt with `frame` (an ABORT), then close it."""
        try:
            write_frame(conn, frame)
        except OSError:
            pass
        conn.close()

    def close(self) -> None:
        """Stop listening and close every connection."""
        self.listener.close()
        super().close()


class WorkerSocketTransport(SocketTransport):
    """A worker: one connection to the server (opened by the worker, so only the server needs
    to be reachable); with `listen`, also a port for its site's relay traffic."""

    def __init__(self, rank: int, host: str, port: int, *, timeout_s: float, listen: bool = False,
                 tls: LinkTls | None = None, sites: Sequence[str] = (), connect_s: float | None = None) -> None:
        super().__init__(rank, timeout_s=timeout_s, tls=tls, sites=sites)
        # How long to retry reaching the server: a starting run's server may start after its
        # workers (the timeout); a joiner's is up already, and one that is gone (the run ended
        # as the joiner started) must not keep the joiner waiting out the timeout.
        self.connect_s = timeout_s if connect_s is None else min(connect_s, timeout_s)
        self.peer_addresses: dict[int, tuple[str, int]] = {}
        self.listen_port: int | None = None
        if listen:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("", 0))
            self.listener.listen(16)
            self.listen_port = self.listener.getsockname()[1]
            threading.Thread(target=self._accept, daemon=True, name="accept").start()
        sock = self._connect((host, port), what="the parameter server")
        self._send_links[SERVER] = _Link(sock, SERVER)
        self._recv_socks[SERVER] = sock

    def _connect(self, address: tuple[str, int], *, what: str) -> socket.socket:
        # The server may still be starting (or restarting): retry until `connect_s`.
        deadline = time.monotonic() + self.connect_s
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection(address, timeout=10)
                _tune(sock)
                sock = self._secure_connected(sock, SERVER)
                sock.settimeout(None)
                return sock
            except ssl.SSLError as exc:
                # Not worth retrying: the peer holds another run's secret (or is no hybridtrain peer).
                raise PeerLost(f"rank {self.rank}: {what} at {address[0]}:{address[1]} refused this "
                               f"rank's run key at the handshake: {exc}") from exc
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    raise PeerLost(f"rank {self.rank}: cannot reach {what} at {address[0]}:{address[1]} "
                                   f"within {self.connect_s:.0f} s: {exc}") from exc
                time.sleep(delay)
                delay = min(1.0, delay * 2)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            try:
                _tune(conn)
                conn.settimeout(self.timeout_s)
                conn = self._secure_accepted(conn)
                (peer,) = _RANK.unpack(_recv_exact(conn, _RANK.size))
                conn.settimeout(None)
            except (OSError, PeerLost):
                conn.close()
                continue
            with self._cond:
                old = self._recv_socks.get(peer)
                self._recv_socks[peer] = conn
                self._cond.notify_all()
            if old is not None:
                old.close()

    def _send_link(self, peer: int) -> _Link | None:
        link = super()._send_link(peer)
        if link is not None or peer == SERVER or peer not in self.peer_addresses:
            return link
        try:
            sock = socket.create_connection(self.peer_addresses[peer], timeout=10)
            _tune(sock)
            sock = self._secure_connected(sock, peer)
            sock.settimeout(None)
            sock.sendall(_RANK.pack(self.rank))
        except OSError:
            # A site peer that is gone: the server drops it; this worker stops trying.
            self.peer_addresses.pop(peer, None)
            return None
        link = _Link(sock, peer)
        with self._cond:
            self._send_links[peer] = link
        return link

    def _missing(self, peer: int) -> None:
        if peer == SERVER:
            raise PeerLost(f"rank {self.rank}: the connection to the parameter server is closed")

    def _failed(self, peer: int, exc: BaseException) -> None:
        if peer == SERVER:
            raise PeerLost(f"rank {self.rank}: lost the parameter server: {exc}")
        self.peer_addresses.pop(peer, None)

    def close(self) -> None:
        """Close the listener and every connection."""
        if self.listen_port is not None:
            self.listener.close()
        super().close()
