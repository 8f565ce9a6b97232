"""The density rule's clock (trainer.linkclock): a worker's upload timed at the rate TCP
measured for its link, on hand cases and on a real 20 Mbit/s shaped link."""

from __future__ import annotations

import socket
import time

import pytest
from shaped_link import serving_inside, shaped_link

from trainer.linkclock import RATE_WINDOW, LinkClock
from trainer.sockets import delivery_rate

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_before_any_rate_the_clock_is_the_writes_own_time():
    assert LinkClock().send_s(1_000_000, write_s=0.003) == 0.003


def test_the_send_time_is_the_bytes_at_the_best_recent_rate():
    clock = LinkClock(window=4)
    for rate in (2.5e6, 1e6, 2.5e6, 0.5e6):  # the lower samples were app- or window-limited
        clock.note(rate)
    assert clock.send_s(1_000_000, write_s=0.003) == pytest.approx(0.4)


def test_one_sample_far_above_the_rest_is_outvoted():
    # ACKs processed in a burst on a loaded host make one sample read above the link.
    clock = LinkClock()
    for rate in (2.4e6, 3.9e6, 2.5e6):
        clock.note(rate)
    assert clock.rate == 2.5e6


def test_with_two_samples_the_larger_counts():
    clock = LinkClock()
    for rate in (1e6, 2.5e6):
        clock.note(rate)
    assert clock.rate == 2.5e6


def test_a_write_slower_than_the_rate_implies_keeps_its_own_time():
    # A link emulated in-process (--link-mbps) sleeps in the write; TCP sees loopback.
    clock = LinkClock()
    clock.note(5e9)
    assert clock.send_s(1_000_000, write_s=0.08) == 0.08


def test_missing_and_zero_samples_are_skipped():
    clock = LinkClock()
    clock.note(None)
    clock.note(0.0)
    assert clock.rate is None


def test_the_window_forgets_a_rate_the_link_no_longer_has():
    clock = LinkClock(window=3)
    for rate in (10e6, 1e6, 1e6, 1e6):
        clock.note(rate)
    assert clock.rate == 1e6


def test_a_window_must_hold_a_sample():
    with pytest.raises(ValueError, match="window"):
        LinkClock(window=0)


SINK = (
    "import socket, sys; s = socket.create_server((sys.argv[1], int(sys.argv[2]))); print('ready', flush=True); "
    "c, _ = s.accept()\nwhile c.recv(1 << 20): pass"
)


def test_a_1_mb_upload_on_a_20_mbit_link_is_clocked_at_the_links_rate_though_its_write_returns_at_once():
    with shaped_link("p1clock", "20mbit", "32kb") as link, serving_inside(link, SINK, ROOT):
        sock = socket.create_connection((link.address, link.port), timeout=10)
        clock, payload = LinkClock(), b"\0" * 1_000_000
        writes = []
        # As many steps as the clock's window: one sample in three or four reads a tail of the
        # flight below the link (11-17 Mbit/s here), and with three, two such once failed CI.
        for _ in range(RATE_WINDOW):  # a worker's steps: upload, then the reply (here: a pause)
            t0 = time.perf_counter()
            sock.sendall(payload)
            writes.append(time.perf_counter() - t0)
            time.sleep(0.6)  # the upload drains and is acknowledged
            clock.note(delivery_rate(sock))
        sock.close()

    # Goodput under a 20 Mbit/s shaper: the headers take ~3 %; 1 MB then takes 0.41 s.
    assert clock.rate is not None and clock.rate * 8 / 1e6 == pytest.approx(20 * 0.97, rel=0.10)
    assert clock.send_s(len(payload), write_s=min(writes)) == pytest.approx(0.41, rel=0.10)
    # What the write alone reads once TCP has grown the socket's buffer: the old clock.
    assert min(writes) < 0.2
