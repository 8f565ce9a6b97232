"""The torch.distributed transport and the inbox between real gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time

import torch
import torch.distributed as dist

from trainer.transport import Inbox, TorchTransport

LATE_S = 1.5
# A frame whose kind byte (offset 3) reads LAST is a peer's final one: its inbox thread stops.
LAST = 255


def _in_group(rank: int, port: int, out: "mp.Queue", role) -> None:
    """A spawned process: rank `rank` of a 3-rank gloo group, running `role(rank, out)`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    try:
        role(rank, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _role(rank: int, out: "mp.Queue") -> None:
    transport = TorchTransport(rank)
    if rank == 0:
        inbox = Inbox(transport, [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
        frames = {p: inbox.get(p) for p in (1, 2)}
        out.put((0, ({p: f.numel() for p, (f, _) in frames.items()}, {p: t for p, (_, t) in frames.items()})))
    else:
        if rank == 2:
            time.sleep(LATE_S)
        frame = torch.full((2_000_000 * rank,), LAST, dtype=torch.uint8)
        t0 = time.perf_counter()
        transport.send(0, frame)
        out.put((rank, time.perf_counter() - t0))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_roles(role) -> dict:
    """Run `role` as ranks 0-2 of a gloo group in spawned processes; {rank: what it reported}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_in_group, args=(r, port, out, role)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_a_peers_send_completes_without_waiting_for_a_late_peer():
    results = _run_roles(_role)

    sizes, wire_s = results[0]
    assert sizes == {1: 2_000_000, 2: 4_000_000}
    # The early peer's send time is its own transfer over loopback, which the adaptive density
    # reads as its link's speed: it must not include the late peer's 1.5 s.
    assert results[1] < LATE_S / 3
    # The receiver times each frame from its length prefix on: the late peer's lateness is not
    # its link's time either.
    assert set(wire_s) == {1, 2} and max(wire_s.values()) < LATE_S / 3


ROUNDS = 3


def _pipelined_role(rank: int, out: "mp.Queue") -> None:
    transport = TorchTransport(rank)
    if rank == 0:
        inbox = Inbox(transport, [1, 2], timeout_s=30, last_kinds=frozenset({LAST}))
        got, wire = [], {1: 0.0, 2: 0.0}
        for _ in range(ROUNDS):
            frames = {p: inbox.get(p) for p in (1, 2)}
            got.append({p: int(f[0]) for p, (f, _) in frames.items()})
            for p, (_, t) in frames.items():
                wire[p] += t
        out.put((0, (got, wire, transport.take_counts()[1])))
    else:
        # Every round posted before any is waited on: the sends overlap the receiver's work.
        waits = [transport.post_many([0], torch.full((1000 * rank,), LAST if r == ROUNDS - 1 else 10 * rank + r,
                                                     dtype=torch.uint8))
                 for r in range(ROUNDS)]
        for wait in waits:
            wait()
        out.put((rank, None))


def test_an_inbox_delivers_each_peers_frames_in_order_counting_their_bytes_when_consumed():
    rounds, wire_s, received = _run_roles(_pipelined_role)[0]
    assert rounds == [{1: 10 + r, 2: 20 + r} for r in range(ROUNDS - 1)] + [{1: LAST, 2: LAST}]
    assert received == {1: ROUNDS * (8 + 1000), 2: ROUNDS * (8 + 2000)}
    assert set(wire_s) == {1, 2} and all(s >= 0 for s in wire_s.values())
