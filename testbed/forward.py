"""A TCP port forwarder from loopback into a namespace: how the host reaches the control plane.

The root namespace has no route into the testbed (by design: no testbed address lives there),
so `python -m testbed.forward --listen-port P --netns NS --to A:PORT` accepts on
127.0.0.1:P and dials A:PORT from a thread that has entered NS. A socket belongs to the
namespace of the thread that created it, so one dialing thread serves every connection.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from testbed import netns

_CHUNK = 1 << 16


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(_CHUNK):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        # Half-close so the other direction can finish; then both ends are closed by the peer.
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _bridge(client: socket.socket, dialer: ThreadPoolExecutor, target: tuple[str, int]) -> None:
    try:
        upstream = dialer.submit(socket.create_connection, target, 10).result()
    except OSError:
        client.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def serve(listen_port: int, netns_name: str, target: tuple[str, int]) -> None:
    """Forward 127.0.0.1:`listen_port` to `target` inside `netns_name`, forever."""
    dialer = ThreadPoolExecutor(max_workers=1, initializer=netns.enter, initargs=(netns_name,))
    with socket.create_server(("127.0.0.1", listen_port), reuse_port=False) as server:
        while True:
            client, _ = server.accept()
            threading.Thread(target=_bridge, args=(client, dialer, target), daemon=True).start()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """Entry point: `python -m testbed.forward`."""
    parser = argparse.ArgumentParser(prog="python -m testbed.forward")
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--netns", required=True)
    parser.add_argument("--to", required=True, help="ADDRESS:PORT inside the namespace")
    args = parser.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    serve(args.listen_port, args.netns, (host, int(port)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
