"""The parameter server's TCP transport (trainer.sockets) and the inbox over it: workers that
connect at any time, frames in order and counted, a lost peer noticed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from trainer.launch import free_port
from trainer.sockets import PeerLost, ServerSocketTransport, WorkerSocketTransport
from trainer.transport import InMemoryHub, Inbox

LATE_S = 1.5
# A frame whose kind byte (offset 3) reads LAST is a peer's final one: its inbox thread stops.
LAST = 255


def _hello(rank: int) -> torch.Tensor:
    """A first frame naming its sender (byte 0), as HELLO does."""
    return torch.full((16,), rank, dtype=torch.uint8)


def _adopt(server: ServerSocketTransport, n: int) -> None:
    """Adopt the next `n` connections under the rank their first frame names."""
    for _ in range(n):
        conn, first, _ = server.arrivals.get(timeout=30)
        server.adopt(int(first[0]), conn, first)


def _worker(rank: int, port: int, **kw) -> WorkerSocketTransport:
    worker = WorkerSocketTransport(rank, "127.0.0.1", port, timeout_s=30, **kw)
    worker.send(0, _hello(rank))
    return worker


def test_a_peers_send_completes_without_waiting_for_a_late_peer():
    server = ServerSocketTransport("127.0.0.1", 0, timeout_s=30)
    workers = {r: _worker(r, server.port) for r in (1, 2)}
    _adopt(server, 2)
    inbox = Inbox(server, [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
    took: dict[int, float] = {}

    def send(rank: int) -> None:
        if rank == 2:
            time.sleep(LATE_S)
        t0 = time.perf_counter()
        workers[rank].send(0, torch.full((2_000_000 * rank,), LAST, dtype=torch.uint8))
        took[rank] = time.perf_counter() - t0

    threads = [threading.Thread(target=send, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    frames = {p: inbox.get(p) for p in (1, 2)}
    for t in threads:
        t.join()
    assert {p: f.numel() for p, (f, _) in frames.items()} == {1: 2_000_000, 2: 4_000_000}
    # The early peer's send time is its own transfer over loopback, which the adaptive density
    # reads as its link's speed: it must not include the late peer's 1.5 s.
    assert took[1] < LATE_S / 3
    # The receiver times each frame from its length prefix on: lateness is not link time.
    assert max(t for _, t in frames.values()) < LATE_S / 3
    server.close()


def test_an_inbox_delivers_each_peers_frames_in_order_counting_their_bytes_when_consumed():
    rounds = 3
    server = ServerSocketTransport("127.0.0.1", 0, timeout_s=30)
    workers = {r: _worker(r, server.port) for r in (1, 2)}
    _adopt(server, 2)
    server.take_counts()
    inbox = Inbox(server, [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
    for rank, worker in workers.items():
        # Every round posted before any is waited on: the sends overlap the receiver's work.
        waits = [worker.post_many([0], torch.full((1000 * rank,), LAST if r == rounds - 1 else 10 * rank + r,
                                                  dtype=torch.uint8)) for r in range(rounds)]
        for wait in waits:
            wait()
    got = [{p: int(inbox.get(p)[0][0]) for p in (1, 2)} for _ in range(rounds)]
    assert got == [{1: 10 + r, 2: 20 + r} for r in range(rounds - 1)] + [{1: LAST, 2: LAST}]
    assert server.take_counts()[1] == {1: rounds * (8 + 1000), 2: rounds * (8 + 2000)}
    server.close()


def test_a_frame_said_to_come_at_once_returns_at_once_apart_and_does_not_start_the_silence_clock():
    # A leaver's BYE arrives as its peers start computing; they must not be held to the
    # deadline after the first frame (then_s) from it.
    hub = InMemoryHub(timeout_s=30)
    inbox = Inbox(hub.transport(0), [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
    hub.transport(1).send(0, torch.full((4,), 9, dtype=torch.uint8))
    threading.Timer(0.6, lambda: hub.transport(2).send(0, torch.full((4,), 5, dtype=torch.uint8))).start()
    t0 = time.monotonic()
    got, early, failed = inbox.collect([1, 2], first_s=10, then_s=0.3, at_once=lambda raw: int(raw[0]) == 9)
    assert (got, list(early), failed) == ({}, [1], {}) and time.monotonic() - t0 < 0.3
    got, early, failed = inbox.collect([2], first_s=10, then_s=0.3)
    assert (int(got[2][0][0]), early, failed) == (5, {}, {})


def test_a_frame_the_caller_consumes_is_replaced_by_the_peers_next_on_the_same_clock():
    # A straggler's late change is taken as it comes; the round still wants its next frame and
    # the deadline after the first frame is not restarted by it.
    hub = InMemoryHub(timeout_s=30)
    inbox = Inbox(hub.transport(0), [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
    taken: list[tuple[int, int]] = []

    def consume(peer: int, raw: torch.Tensor) -> bool:
        if int(raw[0]) == 8:
            taken.append((peer, int(raw[0])))
            return True
        return False

    hub.transport(1).send(0, torch.full((4,), 5, dtype=torch.uint8))
    hub.transport(2).send(0, torch.full((4,), 8, dtype=torch.uint8))
    hub.transport(2).send(0, torch.full((4,), 6, dtype=torch.uint8))
    got, early, failed = inbox.collect([1, 2], first_s=10, then_s=0.3, consume=consume)
    assert {p: int(v[0][0]) for p, v in got.items()} == {1: 5, 2: 6} and (early, failed) == ({}, {})
    assert taken == [(2, 8)]
    threading.Timer(0.2, lambda: hub.transport(2).send(0, torch.full((4,), 8, dtype=torch.uint8))).start()
    hub.transport(1).send(0, torch.full((4,), 5, dtype=torch.uint8))
    t0 = time.monotonic()
    got, _, failed = inbox.collect([1, 2], first_s=10, then_s=0.4, consume=consume)
    assert list(got) == [1] and isinstance(failed[2], TimeoutError) and time.monotonic() - t0 < 0.6
    assert taken == [(2, 8), (2, 8)]


def test_a_peer_marked_lost_ends_a_wait_on_it_once_its_frames_are_read():
    # A silent relay the server has dropped: its frames received so far are still read, then
    # the wait ends at once instead of at the timeout.
    hub = InMemoryHub(timeout_s=30)
    hub.transport(1).send(0, torch.full((4,), 7, dtype=torch.uint8))
    inbox = Inbox(hub.transport(0), [1], timeout_s=30, last_kinds=frozenset({LAST}))
    assert int(inbox.get(1)[0][0]) == 7
    inbox.fail(1, ConnectionError("dropped by the server"))
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="dropped by the server"):
        inbox.get(1)
    assert time.monotonic() - t0 < 1.0


def test_an_inbox_says_whether_a_frame_is_queued_without_waiting_or_taking_it():
    hub = InMemoryHub(timeout_s=30)
    inbox = Inbox(hub.transport(0), [1], timeout_s=30, last_kinds=frozenset({LAST}))
    sevens = lambda frame: int(frame[0]) == 7  # noqa: E731
    assert not inbox.holds(1, sevens)
    hub.transport(1).send(0, torch.full((4,), 5, dtype=torch.uint8))
    hub.transport(1).send(0, torch.full((4,), 7, dtype=torch.uint8))
    deadline = time.monotonic() + 5
    while not inbox.holds(1, sevens) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inbox.holds(1, sevens) and not inbox.holds(1, lambda frame: int(frame[0]) == 9)
    assert [int(inbox.get(1)[0][0]) for _ in range(2)] == [5, 7]  # both still there, in order
    inbox.fail(1, ConnectionError("gone"))
    assert inbox.holds(1, sevens)  # a lost peer: reading it ends at once


def test_a_worker_may_start_before_the_server_listens():
    port = free_port()
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(worker=_worker(1, port)))
    thread.start()
    time.sleep(1.0)
    server = ServerSocketTransport("127.0.0.1", port, timeout_s=30)
    _adopt(server, 1)
    thread.join(timeout=30)
    box["worker"].send(0, torch.tensor([7], dtype=torch.uint8))
    assert int(server.recv(1)[0]) == 7
    server.close()


def test_a_worker_gives_up_on_a_server_that_is_gone_after_its_connect_time_not_the_timeout():
    # A joiner (its run's server is up already, or gone): trainer.loop passes JOIN_CONNECT_S.
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="cannot reach the parameter server .* within 1 s"):
        _worker(5, free_port(), connect_s=1.0)
    assert time.monotonic() - t0 < 5.0


def test_a_killed_peer_is_noticed_at_once_as_lost(tmp_path):
    server = ServerSocketTransport("127.0.0.1", 0, timeout_s=30)
    code = ("import sys, time, torch; sys.path.insert(0, sys.argv[2]);"
            "from trainer.sockets import WorkerSocketTransport;"
            "w = WorkerSocketTransport(3, '127.0.0.1', int(sys.argv[1]), timeout_s=30);"
            "w.send(0, torch.full((16,), 3, dtype=torch.uint8)); time.sleep(60)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", code, str(server.port), root])
    try:
        _adopt(server, 1)
        inbox = Inbox(server, [3], timeout_s=30, last_kinds=frozenset({LAST}))
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        got, early, failed = inbox.collect([3], first_s=30, then_s=30)
        assert not got and not early and isinstance(failed[3], PeerLost)
        assert time.monotonic() - t0 < 2.0
    finally:
        proc.kill()
        proc.wait()
        server.close()


def test_a_relay_reaches_its_site_peer_at_the_address_the_server_passed_on():
    server = ServerSocketTransport("127.0.0.1", 0, timeout_s=30)
    relay = _worker(1, server.port)
    member = _worker(2, server.port, listen=True)
    relay.peer_addresses[2] = ("127.0.0.1", member.listen_port)
    relay.send(2, torch.tensor([42], dtype=torch.uint8))
    assert int(member.recv(1)[0]) == 42
    server.close()
