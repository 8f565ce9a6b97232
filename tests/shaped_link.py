"""A real shaped link for tests: a network namespace joined to the host by a veth pair whose
host end sends through a `tc tbf` shaper. Torn down on the way out, also when a test fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class ShapedLink:
    """The namespace, its address, a port free to listen on inside it, the host's end of the
    link (its device and address) and the namespace's end (its device)."""

    ns: str
    address: str
    port: int
    outside: str = ""
    host_address: str = ""
    inside: str = ""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


@contextmanager
def shaped_link(prefix: str, rate: str, burst: str) -> Iterator[ShapedLink]:
    """Traffic from the host into a fresh namespace runs at `rate` past a `burst` bucket."""
    # Fail, never skip: CI runs as root with iproute2, and a shaped link is these tests' point.
    if os.geteuid() != 0 or not shutil.which("tc"):
        pytest.fail("this test needs root and tc (iproute2) to shape a link in a network namespace")
    tag = uuid.uuid4().hex[:6]
    ns, outside, inside = f"{prefix}{tag}", f"{prefix[:3]}o{tag}", f"{prefix[:3]}i{tag}"
    # Outside the testbed's 10.213.0.0/16, so a running testbed is never disturbed.
    net = f"10.98.{int(tag[2:4], 16)}"
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        _sh("ip", "link", "set", inside, "netns", ns)
        _sh("ip", "addr", "add", f"{net}.1/30", "dev", outside)
        _sh("ip", "link", "set", outside, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net}.2/30", "dev", inside)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _sh("tc", "qdisc", "add", "dev", outside, "root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        yield ShapedLink(ns, f"{net}.2", 47000 + int(tag[:3], 16) % 1000, outside, f"{net}.1", inside)
    finally:
        subprocess.run(["ip", "link", "del", outside], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextmanager
def serving_inside(link: ShapedLink, code: str, cwd: str | os.PathLike[str]) -> Iterator[None]:
    """Run `python -c code ADDRESS PORT` in the link's namespace until it prints 'ready'; killed on
    the way out."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", link.ns, sys.executable, "-c", code, link.address, str(link.port)],
        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().strip()
        assert first == "ready", first
        yield
    finally:
        proc.kill()
        proc.wait()
