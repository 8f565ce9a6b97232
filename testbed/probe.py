"""Measure the TCP throughput between two endpoints of a testbed with plain Python sockets.

`python -m testbed.probe recv --bind A --port P` prints one JSON line with the bytes it
received and the rate between its first and last byte; `send --to A --port P --seconds S`
streams for S seconds. `measure()` runs both inside their namespaces.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from typing import Any

from testbed import netns

_CHUNK = 1 << 20


def _recv(bind: str, port: int, timeout_s: float) -> dict[str, Any]:
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((bind, port))
        srv.listen(1)
        srv.settimeout(timeout_s)
        print("ready", flush=True)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(timeout_s)
            total, first, last = 0, None, None
            while chunk := conn.recv(_CHUNK):
                now = time.perf_counter()
                if first is None:
                    first = now
                total += len(chunk)
                last = now
    # The first chunk arrived at `first`; the rate counts only what came after it.
    seconds = (last - first) if first is not None and last is not None else 0.0
    return {
        "bytes": total,
        "seconds": seconds,
        "mbit_s": (total * 8 / seconds / 1e6) if seconds > 0 else 0.0,
    }


def _send(to: str, port: int, seconds: float) -> None:
    payload = b"\0" * _CHUNK
    with socket.create_connection((to, port), timeout=10) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.sendall(payload)


def measure(
    src_netns: str, dst_netns: str, dst_address: str, *, seconds: float = 2.0, port: int = 5201
) -> float:
    """Stream TCP from `src_netns` to `dst_address` (in `dst_netns`) and return Mbit/s received."""
    recv = subprocess.Popen(
        netns.exec_argv(dst_netns, [sys.executable, "-m", "testbed.probe", "recv",
                                    "--bind", dst_address, "--port", str(port)]),
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert recv.stdout is not None
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError("probe receiver did not start")
        subprocess.run(
            netns.exec_argv(src_netns, [sys.executable, "-m", "testbed.probe", "send",
                                        "--to", dst_address, "--port", str(port),
                                        "--seconds", str(seconds)]),
            check=True,
            timeout=seconds + 30,
        )  # fmt: skip
        out, _ = recv.communicate(timeout=30)
        return float(json.loads(out)["mbit_s"])
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the probe's two halves."""
    parser = argparse.ArgumentParser(prog="python -m testbed.probe")
    sub = parser.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", required=True)
    r.add_argument("--port", type=int, default=5201)
    r.add_argument("--timeout", type=float, default=60.0)
    s = sub.add_parser("send")
    s.add_argument("--to", required=True)
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args(argv)
    if args.mode == "recv":
        print(json.dumps(_recv(args.bind, args.port, args.timeout)), flush=True)
    else:
        _send(args.to, args.port, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
