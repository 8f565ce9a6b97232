"""Process groups of roles: signal them, wait until they are empty, list their members.

A role's guard leads its group, so the group id is the guard's pid; Linux keeps that id
allocated while any member lives, which is what makes sweeping a group by id safe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import psutil


def killpg(pgid: int, signum: int) -> None:
    """Send `signum` to the group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def wait_group_empty(pgid: int, *, timeout_s: float) -> bool:
    """Poll until process group `pgid` has no live member left; False if some remain.

    Zombies do not count: an orphan killed by SIGKILL stays a zombie until PID 1 reaps it,
    which a container's PID 1 may never do. A loaded machine can take seconds to deliver a
    SIGKILL to a process in uninterruptible sleep, hence a bound of several seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if not group_members(pgid, live_only=True):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def group_members(pgid: int, *, live_only: bool = False) -> list[int]:
    """The pids whose process group is `pgid` (without zombies when `live_only`)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and not (live_only and proc.status() == psutil.STATUS_ZOMBIE):
                members.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return members


def create_time(pid: int | None) -> float | None:
    """The start time of `pid`, which tells it apart from a later process given the same pid."""
    if pid is None:
        return None
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def same_process(pid: int, created: float | None) -> bool:
    """Whether `pid` is still the process that started at `created`."""
    try:
        return created is not None and abs(psutil.Process(pid).create_time() - created) <= 0.01
    except psutil.NoSuchProcess:
        return False


class Spawner:
    """One thread that lives as long as the agent and does every fork."""

    def __init__(self) -> None:
        self._requests: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="role-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._requests.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)

    def run(self, fn: Callable[[], Any]) -> Any:
        future: Future[Any] = Future()
        self._requests.put((fn, future))
        return future.result()
