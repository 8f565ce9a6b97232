"""Link probes between nodes: a small TCP server every agent runs, and the client that measures
a link's round-trip time and bandwidth against another node's server (docs/architecture.md,
"Link probes").

The protocol is newline-delimited JSON on one connection:

1. `{"op": "begin"}` -> `{"op": "ready"}` once it is this probe's turn (one probe at a time
   per server, so two probes of one node never share its link; `{"op": "queued"}` comes first
   when it must wait). A node's own outgoing probe holds its server's turn too, so a node is
   in one probe at a time, sending or receiving: a link is measured one direction at a time.
2. `{"op": "ping"}` -> `{"op": "pong"}`; the client times five of these (median RTT).
3. `{"op": "bulk", "seconds": s}` -> `{"op": "go"}`; the client
   then streams bytes for `s` seconds and shuts its side down; the server reads to the end of
   the stream and answers `{"bytes", "timed_bytes", "seconds", "steady_bytes",
   "steady_seconds", "steady_mbps"}`: what it received between its first and last byte by its
   own clock, in the second half of that time, and the median rate of the windows after the
   head (`steady_window_mbps`). A sender's clock would stop when the last byte enters its
   socket buffer, which on a slow link is long before the bytes arrive; the head holds TCP's
   slow start and a token bucket's burst (the first bytes of a tbf-shaped link arrive at line
   rate), and the median over windows ignores a stall of either end's CPU.

The server is bounded: at most `max_connections` at once (others get `{"error": "busy"}`),
each bulk send at most `max_seconds` + DRAIN_S long and `max_bytes` received.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from agents.errors import AgentError
from agents.probe_rate import bulk_answer

log = logging.getLogger(__name__)

PINGS = 5
CHUNK_BYTES = 64 * 1024
MAX_LINE_BYTES = 4096
# Extra time a connection gets beyond its bulk seconds: the pings, the handshake, the reply.
SLACK_S = 5.0
# How long a receiver keeps reading after the asked seconds (the sender's buffered bytes still
# draining over a slow link), and the longest silence it waits through.
DRAIN_S = 10.0
IDLE_S = 5.0
# The shortest second half of a transfer whose rate is trusted over the whole transfer's.
MIN_STEADY_S = 0.02
# How long a bulk request waits for the server's one bulk slot before it gives up.
BULK_WAIT_S = 60.0
# A prober whose own node is busy (its server serves another probe) gives its target's turn
# back and tries again after a random pause in this range (seconds), so two nodes probing each
# other never both wait while holding a turn.
RETRY_PAUSE_S = (0.05, 0.4)

_servers: list[ProbeServer] = []
_servers_lock = threading.Lock()


class ProbeError(AgentError):
    """A probe could not measure a link (refused, timed out, or the peer answered nonsense)."""


@dataclass(frozen=True)
class Measurement:
    """One link as measured from the sender: Mbit/s received, median RTT, receiver's count."""

    mbps: float
    rtt_ms: float
    bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """The fields as the control plane's link report takes them."""
        return {"mbps": self.mbps, "rtt_ms": self.rtt_ms, "bytes": self.bytes, "seconds": self.seconds}


# -- the server ---------------------------------------------------------------------------------


class ProbeServer:
    """A TCP probe server on a daemon thread; `start()` binds, `port` is then the bound port."""

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        max_connections: int = 32,
        max_seconds: float = 30.0,
        max_bytes: int = 8 << 30,
    ) -> None:
        self.host = host
        self.requested_port = port
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        self._slots = threading.BoundedSemaphore(max_connections)
        self._turn = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port the server listens on (after `start`)."""
        if self._sock is None:
            raise RuntimeError("the probe server is not started")
        return int(self._sock.getsockname()[1])

    def start(self) -> ProbeServer:
        """Bind and start accepting; raises OSError when the address cannot be bound."""
        sock = socket.create_server((self.host, self.requested_port), reuse_port=False)
        # Accept wakes up now and then to notice `close()`.
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="probe-server", daemon=True)
        self._thread.start()
        with _servers_lock:
            _servers.append(self)
        log.info("probe server listening on %s:%d", self.host, self.port)
        return self

    def close(self) -> None:
        """Stop accepting and release the port; connections in progress end on their deadline."""
        self._stop.set()
        with _servers_lock:
            if self in _servers:
                _servers.remove(self)
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> ProbeServer:
        return self.start() if self._sock is None else self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.sendall(b'{"error": "busy"}\n')
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn,), name="probe-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.max_seconds + DRAIN_S + SLACK_S + BULK_WAIT_S
        reader = _LineReader(conn)
        holding = False
        try:
            while True:
                # A prober says its next line at once; one that goes quiet gives its place up.
                conn.settimeout(max(0.01, min(IDLE_S, deadline - time.monotonic())))
                line = reader.readline()
                if line is None:
                    return
                try:
                    header = json.loads(line)
                    op = header["op"]
                except (ValueError, KeyError, TypeError):
                    conn.sendall(b'{"error": "expected a JSON line with an op"}\n')
                    return
                if op == "begin" and not holding:
                    holding = self._take_turn(conn, deadline)
                    if not holding:
                        return
                    conn.sendall(b'{"op": "ready"}\n')
                elif op == "ping":
                    conn.sendall(b'{"op": "pong"}\n')
                elif op == "bulk":
                    if not holding:
                        holding = self._take_turn(conn, deadline)
                        if not holding:
                            return
                    self._receive_bulk(conn, reader, header, deadline)
                    return
                else:
                    conn.sendall(json.dumps({"error": f"unknown op {op!r}"}).encode() + b"\n")
                    return
        except OSError as exc:  # a peer that vanished or overstayed: nothing to answer
            log.debug("probe connection ended: %s", exc)
        finally:
            if holding:
                self._turn.release()
            conn.close()
            self._slots.release()

    def try_own_turn(self) -> bool:
        """Take this node's probe turn for an outgoing probe, if free (release with
        `release_own_turn`)."""
        return self._turn.acquire(blocking=False)

    def release_own_turn(self) -> None:
        """Give back the turn `try_own_turn` took."""
        self._turn.release()

    def serves(self, host: str, port: int) -> bool:
        """Whether a probe of host:port reaches this server (a node probing itself). A server
        bound to every address is only recognised by a loopback host: nodes often share one
        fixed probe port, so the port alone does not tell."""
        return port == self.port and (host == self.host or host in ("127.0.0.1", "localhost", "::1"))

    def _take_turn(self, conn: socket.socket, deadline: float) -> bool:
        """Wait for this server's one probe turn (saying "queued" first when it must wait), so
        that neither the pings nor the bulk of one probe share the link with another's."""
        if self._turn.acquire(blocking=False):
            return True
        conn.sendall(b'{"op": "queued"}\n')
        if self._turn.acquire(timeout=max(0.0, min(BULK_WAIT_S, deadline - time.monotonic()))):
            return True
        conn.sendall(b'{"error": "busy: other probes of this node took too long"}\n')
        return False

    def _receive_bulk(
        self, conn: socket.socket, reader: _LineReader, header: dict[str, Any], deadline: float
    ) -> None:
        try:
            seconds = min(float(header.get("seconds", 1.0)), self.max_seconds)
        except (TypeError, ValueError):
            conn.sendall(b'{"error": "seconds must be a number"}\n')
            return
        conn.sendall(b'{"op": "go"}\n')
        # Read to the sender's end of stream: what sat in its socket buffer when it stopped
        # still crosses the link at the link's rate. Bounded by the asked seconds plus
        # DRAIN_S, an idle gap of IDLE_S, and max_bytes.
        end = min(deadline, time.monotonic() + seconds + DRAIN_S)
        samples: list[tuple[float, int]] = []
        count = 0
        pending = reader.drain()
        while count < self.max_bytes:
            if pending:
                data, pending = pending, b""
            else:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                conn.settimeout(min(remaining, IDLE_S))
                try:
                    data = conn.recv(1 << 20)
                except TimeoutError:
                    break
                if not data:
                    break
            count += len(data)
            samples.append((time.monotonic(), count))
        answer = bulk_answer(samples)
        conn.settimeout(5)
        conn.sendall(json.dumps(answer).encode() + b"\n")


class _LineReader:
    """Reads newline-terminated lines from a socket, keeping what follows for the caller."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def readline(self) -> bytes | None:
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_LINE_BYTES:
                raise OSError("probe header line too long")
            data = self.conn.recv(MAX_LINE_BYTES)
            if not data:
                return None
            self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def drain(self) -> bytes:
        data, self.buffer = self.buffer, b""
        return data


# -- the client ---------------------------------------------------------------------------------


def measure(host: str, port: int, *, seconds: float, timeout_s: float = 5.0) -> Measurement:
    """Measure the link to the probe server at host:port: 5 pings (median RTT), then a bulk
    send of `seconds`, rated by the receiver's median over steady windows after the head (or
    the second half of its first-to-last-byte time, or the whole, from an older server).

    While it runs it holds this process's probe server's turn too (when the agent runs one, and
    it is not the target), so the node neither receives nor sends another probe meanwhile; when
    that turn is taken it gives the target's turn back and tries again after a short random
    pause, up to BULK_WAIT_S.

    Raises ProbeError, naming the address, when the connection is refused or any step takes
    longer than `timeout_s` (beyond the bulk's own seconds and drain; a probe told "queued"
    waits up to BULK_WAIT_S for its turn).
    """
    where = f"{host}:{port}"
    own = _own_server(host, port)
    deadline = time.monotonic() + BULK_WAIT_S
    while True:
        conn = _connect(host, port, timeout_s, where)
        try:
            with conn:
                reader = _wait_for_turn(conn, where, timeout_s)
                if own is not None and not own.try_own_turn():
                    if time.monotonic() > deadline:
                        raise ProbeError(f"probe of {where}: this node stayed busy with other probes "
                                         f"for {BULK_WAIT_S:g} s")
                    conn.close()  # gives the target's turn back
                    time.sleep(random.uniform(*RETRY_PAUSE_S))
                    continue
                try:
                    return _probe(conn, reader, where, seconds, timeout_s)
                finally:
                    if own is not None:
                        own.release_own_turn()
        except TimeoutError:
            raise ProbeError(f"probe of {where}: no answer within {timeout_s:g} s") from None
        except OSError as exc:
            raise ProbeError(f"probe of {where} failed: {exc}") from None


# The longest an agent waits for a scheduled probe slot (a clock far off, or an order that
# waited in the queue, must not hold the agent's probes for long).
MAX_SLOT_WAIT_S = 300.0


def wait_for_slot(start_at: Any, *, now: float | None = None, sleep: Any = time.sleep) -> float:
    """Sleep until `start_at` (epoch seconds, from the control plane's probe schedule), at most
    MAX_SLOT_WAIT_S; a missing, invalid or past time waits not at all. Returns the seconds slept."""
    try:
        at = float(start_at)
    except (TypeError, ValueError):
        return 0.0
    delay = min(MAX_SLOT_WAIT_S, at - (time.time() if now is None else now))
    if not delay > 0:
        return 0.0
    sleep(delay)
    return delay


def _own_server(host: str, port: int) -> ProbeServer | None:
    """This process's probe server (the agent's), unless there are several (tests) or the
    probe is of that server itself."""
    with _servers_lock:
        running = list(_servers)
    if len(running) != 1 or running[0].serves(host, port):
        return None
    return running[0]


def _connect(host: str, port: int, timeout_s: float, where: str) -> socket.socket:
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        raise ProbeError(f"probe of {where} refused: no probe server listens there") from None
    except TimeoutError:
        raise ProbeError(f"probe of {where}: no connection within {timeout_s:g} s") from None
    except OSError as exc:
        raise ProbeError(f"probe of {where} failed to connect: {exc}") from None
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _wait_for_turn(conn: socket.socket, where: str, timeout_s: float) -> _LineReader:
    """Ask for the target's turn and wait for it (pings timed while another probe fills the
    link would time its queue)."""
    reader = _LineReader(conn)
    conn.sendall(b'{"op": "begin"}\n')
    answer = _answer(reader, where)
    if answer.get("op") == "queued":
        conn.settimeout(BULK_WAIT_S + timeout_s)
        answer = _answer(reader, where)
        conn.settimeout(timeout_s)
    if answer.get("op") != "ready":
        raise ProbeError(f"probe of {where}: expected 'ready', got {answer!r}")
    return reader


def _probe(conn: socket.socket, reader: _LineReader, where: str, seconds: float, timeout_s: float) -> Measurement:
    """The pings and the bulk send, on a connection that holds the target's turn."""
    rtts = []
    for _ in range(PINGS):
        start = time.perf_counter()
        _expect(conn, reader, {"op": "ping"}, "pong", where)
        rtts.append((time.perf_counter() - start) * 1000.0)
    _expect(conn, reader, {"op": "bulk", "seconds": seconds}, "go", where)
    conn.settimeout(seconds + timeout_s)
    chunk = b"\0" * CHUNK_BYTES
    stop = time.monotonic() + seconds
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        # A receiver at its byte cap closes early; its answer is still waiting.
        while time.monotonic() < stop:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
    # The receiver answers once the buffered bytes have drained (at most DRAIN_S).
    conn.settimeout(timeout_s + DRAIN_S)
    answer = _answer(reader, where)
    try:
        received = int(answer["bytes"])
        timed = int(answer.get("timed_bytes", received))
        elapsed = float(answer["seconds"])
        steady = int(answer.get("steady_bytes", 0))
        steady_s = float(answer.get("steady_seconds", 0.0))
        windowed = float(answer.get("steady_mbps") or 0.0)
    except (KeyError, TypeError, ValueError):
        raise ProbeError(f"probe of {where}: unexpected answer {answer!r}") from None
    if windowed > 0 and steady_s >= MIN_STEADY_S:
        mbps = windowed
    elif steady > 0 and steady_s >= MIN_STEADY_S:
        mbps = steady * 8 / steady_s / 1e6
    else:
        mbps = timed * 8 / elapsed / 1e6 if elapsed > 0 else 0.0
    return Measurement(
        mbps=round(mbps, 3), rtt_ms=round(statistics.median(rtts), 3),
        bytes=received, seconds=round(elapsed, 6),
    )


def _expect(conn: socket.socket, reader: _LineReader, request: dict[str, Any], op: str, where: str) -> None:
    conn.sendall(json.dumps(request).encode() + b"\n")
    answer = _answer(reader, where)
    if answer.get("op") != op:
        raise ProbeError(f"probe of {where}: expected {op!r}, got {answer!r}")


def _answer(reader: _LineReader, where: str) -> dict[str, Any]:
    line = reader.readline()
    if line is None:
        raise ProbeError(f"probe of {where}: the server closed the connection")
    try:
        answer = json.loads(line)
    except ValueError:
        raise ProbeError(f"probe of {where}: not a probe server (answered {line[:80]!r})") from None
    if not isinstance(answer, dict):
        raise ProbeError(f"probe of {where}: unexpected answer {answer!r}")
    if "error" in answer:
        raise ProbeError(f"probe of {where}: the server answered {answer['error']}")
    return answer
