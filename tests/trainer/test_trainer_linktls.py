"""A run's links keyed by its secret (trainer.linktls): the same identity on every rank, TLS
between sites with frames unchanged both ways at once, plain TCP within a site once both ends
proved the secret, and a process without the secret refused, on real sockets and in a run of
real processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from trainer_testing import DIGITS, Role, events, series, start_ps_run, stop_all

from hybridtrain.contract import EVENT_WORKER_JOINED

from trainer.linktls import LinkTls, TlsSocket, run_identity
from trainer.sockets import PeerLost, ServerSocketTransport, WorkerSocketTransport

SECRET = "run-7-attempt-0-secret"


def _hello(rank: int) -> torch.Tensor:
    return torch.full((16,), rank, dtype=torch.uint8)


def _server(secret: str | None = SECRET) -> ServerSocketTransport:
    return ServerSocketTransport("127.0.0.1", 0, timeout_s=30, tls=LinkTls.given(secret))


def test_every_rank_derives_the_same_identity_from_the_run_secret_and_another_run_a_different_one():
    assert run_identity(SECRET) == run_identity(SECRET)
    assert run_identity(SECRET)[0] != run_identity("another run")[0]


def test_no_secret_means_plain_tcp():
    assert LinkTls.given(None) is None and LinkTls.given("") is None


def test_frames_cross_a_tls_link_both_ways_at_once_unchanged_and_counted_as_plaintext():
    server = _server()
    worker = WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30, tls=LinkTls(SECRET))
    worker.send(0, _hello(1))
    conn, first, _ = server.arrivals.get(timeout=30)
    server.adopt(1, conn, first)
    server.take_counts()
    worker.take_counts()
    up = torch.randint(0, 256, (3_000_001,), dtype=torch.uint8)
    down = torch.randint(0, 256, (2_000_003,), dtype=torch.uint8)
    got: dict[str, torch.Tensor] = {}
    reader = threading.Thread(target=lambda: got.update(down=worker.recv(0)))
    reader.start()
    wait_down = server.post_many([1], down)
    wait_up = worker.post_many([0], up)
    got["up"] = server.recv(1)
    wait_down()
    wait_up()
    reader.join(timeout=30)
    assert torch.equal(got["up"], up) and torch.equal(got["down"], down)
    # The bill counts the run's own bytes (length prefix and frame), as over plain TCP.
    assert server.take_counts() == ({1: 8 + down.numel()}, {1: 8 + up.numel()})
    server.close()
    worker.close()


# Without sites, across sites, within the server's site: TLS, TLS, the secret proved then plain.
SITE_LAYOUTS = [(), ("onprem", "cloud"), ("onprem", "onprem")]


@pytest.mark.parametrize("sites", SITE_LAYOUTS)
def test_a_worker_holding_another_runs_secret_is_refused_at_once_and_never_adopted(sites):
    server = _server()
    t0 = time.monotonic()
    with pytest.raises(PeerLost, match="refused this rank's run key"):
        WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30, tls=LinkTls("another run"), sites=sites)
    assert time.monotonic() - t0 < 5
    assert server.arrivals.empty()
    server.close()


def test_a_plain_tcp_worker_is_never_adopted_by_a_server_with_a_secret():
    server = _server()
    worker = WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30)
    try:
        worker.send(0, _hello(1))
    except PeerLost:
        pass  # the server may already have hung up
    with pytest.raises(PeerLost):
        worker.recv(0)
    assert server.arrivals.empty()
    worker.close()
    server.close()


def _adopted(server: ServerSocketTransport, rank: int):
    """Adopt the next arrival as `rank` and return its connection."""
    conn, first, _ = server.arrivals.get(timeout=30)
    server.adopt(rank, conn, first)
    return conn


@pytest.mark.parametrize(("sites", "encrypted"), list(zip(SITE_LAYOUTS, [True, True, False])))
def test_a_worker_talks_tls_unless_it_shares_the_servers_site(sites, encrypted):
    server = _server()
    worker = WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30, tls=LinkTls(SECRET), sites=sites)
    worker.send(0, _hello(1))
    assert isinstance(_adopted(server, 1), TlsSocket) is encrypted
    worker.send(0, torch.tensor([5], dtype=torch.uint8))
    assert int(server.recv(1)[0]) == 5
    worker.close()
    server.close()


def test_a_relays_link_to_its_site_peer_is_tls_and_refuses_another_key():
    server = _server()
    relay = WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30, tls=LinkTls(SECRET))
    member = WorkerSocketTransport(2, "127.0.0.1", server.port, timeout_s=30, listen=True, tls=LinkTls(SECRET))
    stranger = WorkerSocketTransport(3, "127.0.0.1", server.port, timeout_s=30, tls=LinkTls(SECRET))
    stranger.tls = LinkTls("another run")
    relay.peer_addresses[2] = stranger.peer_addresses[2] = ("127.0.0.1", member.listen_port)
    relay.send(2, torch.tensor([42], dtype=torch.uint8))
    assert int(member.recv(1)[0]) == 42
    # The stranger's handshake fails: it gives the peer up; the member never hears rank 3.
    stranger.send(2, torch.tensor([13], dtype=torch.uint8))
    assert 2 not in stranger.peer_addresses
    for transport in (relay, member, stranger, server):
        transport.close()


def test_a_run_with_a_link_secret_trains_to_the_end_and_a_worker_with_another_is_turned_away(tmp_path):
    steps = 30
    secret, wrong = tmp_path / "link.key", tmp_path / "other.key"
    secret.write_text(SECRET + "\n")
    wrong.write_text("another run\n")
    # Dense frames over emulated 10 Mbit/s links: the run lasts while the intruder tries.
    args = [*DIGITS, "--strategy", "ps", "--eval-every", "1000", "--timeout-s", "60", "--max-steps", str(steps),
            "--link-mbps", "10,10", "--link-secret-file"]
    server, workers, port = start_ps_run(tmp_path, 2, [*args, str(secret)])
    intruder = Role("worker", 3, 3, port, [*args, str(wrong), "--join"], metrics=tmp_path / "rank3.jsonl")
    try:
        assert intruder.wait() != 0
        assert server.wait() == 0, server.output[-3000:]
        for role in workers.values():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *workers.values(), intruder)
    assert "refused this rank's run key" in intruder.output, intruder.output
    assert max(series(server.records(), "loss")) == steps
    assert 3 not in [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)]
