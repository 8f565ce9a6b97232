"""What a run's link security costs per frame: plain TCP, the secret proved then plain (within a
site), and TLS (between sites), side by side over loopback.

    .venv/bin/python bench/links.py --out results-links.json

Each mode sends `--rounds` frames of each size from a worker transport to a server transport
(trainer.sockets, the PS strategies' real transport) while the server sends the same back, as
a step's gradient and update cross at once. It reports MB/s per direction and CPU seconds per
GB moved (this process's user + system time, both ends included), and each as a ratio to plain.
"""

from __future__ import annotations

import argparse
import json
import resource
import threading
import time
from pathlib import Path

import torch

from trainer.linktls import LinkTls
from trainer.sockets import ServerSocketTransport, WorkerSocketTransport

MODES = ("plain", "proved", "tls")
SIZES_MB = (0.25, 1.0, 8.0)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(mode: str, size_mb: float, rounds: int) -> dict[str, float]:
    """Frames of `size_mb` both ways at once, `rounds` times, over one connection in `mode`."""
    tls = None if mode == "plain" else LinkTls("bench-links-secret")
    sites = ("here", "here") if mode == "proved" else ()
    server = ServerSocketTransport("127.0.0.1", 0, timeout_s=30, tls=tls)
    worker = WorkerSocketTransport(1, "127.0.0.1", server.port, timeout_s=30, tls=tls, sites=sites)
    worker.send(0, torch.zeros(16, dtype=torch.uint8))
    conn, first, _ = server.arrivals.get(timeout=30)
    server.adopt(1, conn, first)
    frame = torch.randint(0, 256, (int(size_mb * 1e6),), dtype=torch.uint8)

    def downlink() -> None:
        for _ in range(rounds):
            worker.recv(0)

    cpu0, t0 = _cpu_s(), time.perf_counter()
    reader = threading.Thread(target=downlink)
    reader.start()
    for _ in range(rounds):
        # Both directions posted before either is read: neither end waits on the other's reads.
        waits = (server.post_many([1], frame), worker.post_many([0], frame))
        server.recv(1)
        for wait in waits:
            wait()
    reader.join()
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    worker.close()
    server.close()
    moved_gb = 2 * rounds * frame.numel() / 1e9
    return {"mb_per_s": round(rounds * frame.numel() / 1e6 / wall, 1), "cpu_s_per_gb": round(cpu / moved_gb, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("results-links.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in SIZES_MB:
        measured = {mode: measure(mode, size, args.rounds) for mode in MODES}
        for mode in MODES:
            plain = measured["plain"]
            rows.append({"frame_mb": size, "mode": mode, **measured[mode],
                         "throughput_vs_plain": round(measured[mode]["mb_per_s"] / plain["mb_per_s"], 3),
                         "cpu_vs_plain": round(measured[mode]["cpu_s_per_gb"] / plain["cpu_s_per_gb"], 2)})
    print("| frame (MB) | mode | MB/s each way | CPU s per GB | throughput vs plain | CPU vs plain |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['frame_mb']} | {r['mode']} | {r['mb_per_s']} | {r['cpu_s_per_gb']} "
              f"| {r['throughput_vs_plain']} | {r['cpu_vs_plain']} |")
    args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
