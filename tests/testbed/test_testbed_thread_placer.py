"""A node's main thread stays on its GPU quota; the threads it starts move to its host group."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import cgroups, processes, thread_placer
from testbed.state import ProcessRecord, TestbedState

# Starts one thread, prints "<main id> <thread id>", then idles until killed.
THREADED = (
    "import os, threading, time\n"
    "ids = []\n"
    "t = threading.Thread(target=lambda: (ids.append(threading.get_native_id()), time.sleep(60)), daemon=True)\n"
    "t.start()\n"
    "while not ids: time.sleep(0.01)\n"
    "print(os.getpid(), ids[0], flush=True)\n"
    "time.sleep(60)\n"
)


def tasks(group: Path) -> set[int]:
    return set(cgroups.threads(group))


def groups(state: TestbedState, node: str) -> tuple[Path, Path]:
    ep = state.endpoints[node]
    return Path(ep["cgroup"]), Path(ep["host_cgroup"])


@pytest.fixture
def threaded(two_sites: TestbedState, state_dir: Path) -> Iterator[tuple[ProcessRecord, int, int]]:
    """A process with one extra thread on cloud-a's quota: (record, main id, thread id)."""
    quota, _ = groups(two_sites, "cloud-a")
    record = processes.spawn(two_sites, state_dir, name="threaded", argv=[sys.executable, "-c", THREADED],
                             netns_name=two_sites.endpoints["cloud-a"]["netns"], cgroup=quota)
    try:
        deadline = time.monotonic() + 30
        while not Path(record.log).read_text().strip():
            assert processes.is_alive(record) and time.monotonic() < deadline, Path(record.log).read_text()
            time.sleep(0.05)
        main_id, thread_id = (int(x) for x in Path(record.log).read_text().split()[:2])
        yield record, main_id, thread_id
    finally:
        processes.stop(record)


def wait_for(check: object, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_thread_a_process_started_is_a_stray_and_its_main_thread_is_not(
    two_sites: TestbedState, threaded: tuple[ProcessRecord, int, int]
) -> None:
    quota, _ = groups(two_sites, "cloud-a")
    _, main_id, thread_id = threaded
    strays = thread_placer.stray_threads(quota)
    assert thread_id in strays
    assert main_id not in strays


def test_a_sweep_moves_the_thread_to_the_host_group_and_leaves_the_main_thread_on_the_quota(
    two_sites: TestbedState, threaded: tuple[ProcessRecord, int, int]
) -> None:
    quota, host = groups(two_sites, "cloud-a")
    _, main_id, thread_id = threaded
    assert thread_placer.place_once([(quota, host)]) == 1
    assert main_id in tasks(quota) and thread_id not in tasks(quota)
    assert thread_id in tasks(host)
    assert thread_placer.stray_threads(quota) == []


def test_the_placer_process_moves_nothing_while_paused_and_stops_on_sigterm(
    two_sites: TestbedState, state_dir: Path, threaded: tuple[ProcessRecord, int, int], tmp_path: Path
) -> None:
    quota, host = groups(two_sites, "cloud-a")
    _, main_id, thread_id = threaded
    pause = tmp_path / thread_placer.PAUSE_FILE
    pause.touch()
    placer = processes.spawn(two_sites, state_dir, name="placer", argv=[
        sys.executable, "-m", "testbed.thread_placer", "--move", f"{quota}:{host}", "--pause-file", str(pause),
        "--period-s", "0.05"], netns_name=None, cgroup=Path(two_sites.cgroup))  # fmt: skip
    try:
        assert wait_for(lambda: "a sweep every" in Path(placer.log).read_text(), 30)
        time.sleep(0.5)
        assert thread_id in tasks(quota)
        pause.unlink()
        assert wait_for(lambda: thread_id in tasks(host))
        assert main_id in tasks(quota)
    finally:
        processes.stop(placer)  # SIGTERM first: the placer ends its sweep and says what it did
    assert "stopped, 1 threads moved" in Path(placer.log).read_text()


def test_paused_touches_the_file_for_the_block_only(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    with thread_placer.paused(pause):
        assert pause.exists()
    assert not pause.exists()


def test_a_move_needs_both_groups() -> None:
    with pytest.raises(SystemExit):
        thread_placer.main(["--move", "/sys/fs/cgroup/cpu/x"])
