"""A node's threads beside its GPU: every thread but a process's main one moves to the host group.

A node's quota stands for its GPU. The trainer computes on its main thread (torch runs one
thread here, `cgroups.PINNED_THREADS_ENV`, and a CPU backward pass runs on the calling thread),
while its other threads only move bytes: the sockets' senders and inboxes (TLS included), the
relay that forwards the server's update inside a site, the metrics reporter, the checkpoint
upload, gloo's. On a real GPU machine those run on the host's CPUs beside the GPU; on the quota
they took the forward pass's time (0.04-0.06 s a step on a 0.157-core node, docs/BENCHMARKS.md,
"Thread placer and apply-in-forward, A/B"), which the standalone measurement of the ideal never
pays.

cgroups place single threads: a thread id written to a group's `tasks` (v1; `cgroup.threads`
of a threaded group on v2, testbed/cgroup_fs.py) moves that thread alone, and a new thread
starts in its creator's group. So a process's main thread stays on the
quota with whatever it creates later, and the placer sweeps the quota every `PERIOD_S` for
threads that are not a process's main one. The server's pod and the control plane are not
swept: the paper limits the server to its 3 cores, all its work included.

`python -m testbed.thread_placer --move QUOTA_GROUP:HOST_GROUP ... [--pause-file F]` runs it
until SIGTERM or until every quota group is gone; while `F` exists it leaves threads where they
are (the bench's `+quotaio` variant measures the emulation without it).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

from testbed import cgroups

PERIOD_S = 0.2
# In the testbed's work directory (var/testbed/<name>/): while it exists the placer moves nothing.
PAUSE_FILE = "threads_on_quota"


def stray_threads(quota_group: Path) -> list[int]:
    """Thread ids in `quota_group` that are not the main thread of their process."""
    # cgroup.procs lists the thread-group ids of the group's threads; a main thread's id is its
    # thread-group id, so what is left are the threads a process started. Threads first: a
    # process that starts between the two reads is then missing from both.
    tids = cgroups.threads(quota_group)
    main = set(cgroups.pids(quota_group))
    return [t for t in tids if t not in main]


def place_once(moves: Sequence[tuple[Path, Path]], refused: set[int] | None = None) -> int:
    """Move every stray thread of each quota group to its host group; how many moved.

    A thread the kernel refuses to move is said once on stderr, added to `refused` and left
    where it is: the emulation is then off for that thread, never the run stopped for it."""
    refused = set() if refused is None else refused
    moved = 0
    for quota_group, host_group in moves:
        for tid in stray_threads(quota_group):
            if tid in refused:
                continue
            try:
                cgroups.move_thread(host_group, tid)
            except (ProcessLookupError, FileNotFoundError):  # ESRCH, ENOENT
                continue  # the thread (or the testbed) ended since the sweep read it
            except OSError as exc:
                refused.add(tid)
                print(f"thread placer: thread {tid} stays on {quota_group}: {exc}", file=sys.stderr, flush=True)
                continue
            moved += 1
    return moved


class ThreadPlacer:
    """Sweeps the quota groups every `period_s` until stopped, or until all of them are gone."""

    def __init__(self, moves: Sequence[tuple[Path, Path]], *, pause_file: Path | None = None,
                 period_s: float = PERIOD_S) -> None:
        self.moves = list(moves)
        self.pause_file = pause_file
        self.period_s = period_s
        self.moved = 0
        self.refused: set[int] = set()
        self._stop = threading.Event()

    def run(self) -> None:
        """Sweep until `stop()` or until no quota group exists any more."""
        while not self._stop.is_set():
            if not any(q.exists() for q, _ in self.moves):
                return
            if self.pause_file is None or not self.pause_file.exists():
                self.moved += place_once(self.moves, self.refused)
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """End `run()` after the sweep under way."""
        self._stop.set()


@contextlib.contextmanager
def paused(pause_file: Path | None) -> Iterator[None]:
    """Leave new threads on their quotas inside the block (None: nothing to pause)."""
    if pause_file is None:
        yield
        return
    pause_file.touch()
    try:
        yield
    finally:
        pause_file.unlink(missing_ok=True)


def _parse_move(text: str) -> tuple[Path, Path]:
    quota, sep, host = text.partition(":")
    if not sep or not quota or not host:
        raise argparse.ArgumentTypeError(f"--move takes QUOTA_GROUP:HOST_GROUP, got {text!r}")
    return Path(quota), Path(host)


def main(argv: list[str] | None = None) -> int:
    """The placer as a process of the testbed (services.py starts it, `down` stops it)."""
    parser = argparse.ArgumentParser(prog="python -m testbed.thread_placer", description=__doc__.splitlines()[0])
    parser.add_argument("--move", type=_parse_move, action="append", required=True,
                        help="a node's quota group and the host group its other threads go to")
    parser.add_argument("--pause-file", type=Path, help="while this file exists, move nothing")
    parser.add_argument("--period-s", type=float, default=PERIOD_S)
    args = parser.parse_args(argv)
    placer = ThreadPlacer(args.move, pause_file=args.pause_file, period_s=args.period_s)

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        placer.stop()

    signal.signal(signal.SIGTERM, on_term)
    print(f"thread placer: {len(placer.moves)} quota groups, a sweep every {placer.period_s:g} s", flush=True)
    placer.run()
    print(f"thread placer: stopped, {placer.moved} threads moved", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
