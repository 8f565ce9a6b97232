"""Starting processes inside an endpoint (its namespace and its cgroup) and stopping them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from testbed import cgroups, netns
from testbed.state import ProcessRecord, TestbedState, save
from testbed.topology import NODE_IFACE

# The checkout that holds this package (and app/, agents/, trainer/): every process the testbed
# starts runs this same code, as it runs this same interpreter, whatever its working directory
# (an agent starts a role in its bundle's directory) and whether an editable install made before
# testbed/ existed maps this package or not.
CODE_ROOT = str(Path(__file__).resolve().parent.parent)


def endpoint_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on an emulated node: one thread, gloo on the node's link,
    this checkout's code."""
    env = dict(os.environ)
    env.update(cgroups.PINNED_THREADS_ENV)
    env["GLOO_SOCKET_IFNAME"] = NODE_IFACE
    env["TP_SOCKET_IFNAME"] = NODE_IFACE
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CODE_ROOT, env.get("PYTHONPATH")) if p)
    # Nothing inside a namespace can reach a proxy of the host.
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(key, None)
    env["NO_PROXY"] = env["no_proxy"] = "*"
    env.update(extra or {})
    return env


def spawn(
    state: TestbedState,
    state_dir: Path,
    *,
    name: str,
    argv: Sequence[str],
    netns_name: str | None,
    cgroup: Path,
    env: Mapping[str, str] | None = None,
) -> ProcessRecord:
    """Start `argv` in `netns_name` (None: the root namespace) and `cgroup`, in its own session.

    Its output goes to var/testbed/<testbed>/logs/<name>.log; the record is saved in the state
    before this returns, so `down` stops it even if the caller dies right after.
    """
    log_dir = state_dir / state.name / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"

    def enter() -> None:
        # In the child, before exec, so that every descendant is in the cgroup and the
        # namespace too. setns rather than `ip netns exec`: that one also remounts /sys for the
        # namespace, which hides /sys/fs/cgroup, and the agents' trainer command needs it to
        # move each role onto its node's quota (incgroup.py).
        cgroups.join(cgroup)
        if netns_name:
            netns.enter(netns_name)

    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=endpoint_env(env),
            start_new_session=True,
            preexec_fn=enter,  # noqa: PLW1509 - only setns and a write before exec
        )
    try:
        created = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        created = 0.0
    record = ProcessRecord(
        name=name, pid=proc.pid, create_time=created, netns=netns_name or "", log=str(log_path)
    )
    state.processes.append(record)
    save(state, state_dir)
    return record


def is_alive(record: ProcessRecord) -> bool:
    """Whether the recorded process still runs (and is the same process, not a reused pid)."""
    try:
        proc = psutil.Process(record.pid)
        return (
            abs(proc.create_time() - record.create_time) < 0.5
            and proc.status() != psutil.STATUS_ZOMBIE
        )
    except psutil.NoSuchProcess:
        return False


def wait_for_exit(records: Sequence[ProcessRecord], *, timeout_s: float, poll_s: float = 0.5) -> list[ProcessRecord]:
    """Wait up to `timeout_s` for recorded processes this process started to end, reaping each
    (none is left a zombie for the rest of a long benchmark); returns those still running."""
    deadline = time.monotonic() + timeout_s
    pending = list(records)
    while True:
        # Only the ones not reaped yet: a reaped pid may be reused by a process not theirs.
        for r in pending:
            _reap(r.pid)
        pending = [r for r in pending if is_alive(r)]
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(poll_s)


def stop(record: ProcessRecord, *, grace_s: float = 5.0) -> None:
    """SIGTERM the process group of `record`, then SIGKILL it after `grace_s`."""
    stop_all([record], grace_s=grace_s)


def stop_all(records: Sequence[ProcessRecord], *, grace_s: float = 5.0) -> None:
    """Stop several process groups at once: SIGTERM to all, then SIGKILL to those left."""
    alive = [r for r in records if is_alive(r)]
    for r in records:
        _reap(r.pid)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for r in alive:
            try:
                os.killpg(r.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        alive = wait_for_exit(alive, timeout_s=wait, poll_s=0.05)


def _reap(pid: int) -> None:
    # Processes started by this very process stay zombies until waited for.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def kill_pids(pids: Sequence[int], *, grace_s: float = 2.0) -> None:
    """SIGTERM then SIGKILL a set of processes (used for stragglers found in namespaces)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            for pid in alive:
                _reap(pid)
            alive = [p for p in alive if psutil.pid_exists(p) and _not_zombie(p)]
            time.sleep(0.05)
        pids = alive


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
