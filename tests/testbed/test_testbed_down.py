"""`down` leaves nothing behind: after a clean `up`, a failed one, a killed one, and without root."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml

from testbed import cgroups, lifecycle, netns, processes, shaping, state
from testbed.errors import NEEDS_ROOT_MESSAGE, NeedsRootError
from testbed.topology import PREFIX, name_prefix

QUIET = {"log": lambda _m: None}
REPO = Path(__file__).resolve().parents[2]


def _name(path: Path) -> str:
    return str(yaml.safe_load(path.read_text())["name"])


def _leftovers(name: str, state_dir: Path) -> list[str]:
    prefix = name_prefix(name)
    found = netns.list_namespaces(prefix) + netns.root_links(prefix)
    found += [str(p) for p in cgroups.list_testbed_groups() if p.name == f"{PREFIX}{name}"]
    if state.load(state_dir, name) is not None:
        found.append("state file")
    return found


def test_down_removes_namespaces_links_cgroups_and_processes(
    needs_root: None, write_config: Callable[..., Path], state_dir: Path
) -> None:
    path = write_config()
    name = _name(path)
    try:
        tb = lifecycle.up(path, state_dir=state_dir, services=False, **QUIET)
        ep = tb.endpoints["cloud-a"]
        recorded = processes.spawn(
            tb, state_dir, name="sleeper", argv=["sleep", "300"],
            netns_name=ep["netns"], cgroup=Path(ep["cgroup"]),
        )  # fmt: skip
        # A process nobody recorded, as a trainer an agent forgot would be.
        stray = subprocess.Popen(netns.exec_argv(ep["netns"], ["sleep", "300"]))
        assert _leftovers(name, state_dir)
    finally:
        lifecycle.down(name, state_dir=state_dir, **QUIET)
    assert _leftovers(name, state_dir) == []
    assert not processes.is_alive(recorded)
    stray.wait(timeout=10)  # `down` may have reaped it already, as it reaps its own children
    assert not psutil.pid_exists(stray.pid)


def test_failed_up_removes_what_it_built(
    needs_root: None,
    write_config: Callable[..., Path],
    state_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_config()
    name = _name(path)

    def broken(_plan: object) -> None:
        raise RuntimeError("tc exploded")

    monkeypatch.setattr(shaping, "shape_wan", broken)
    try:
        with pytest.raises(RuntimeError, match="tc exploded"):
            lifecycle.up(path, state_dir=state_dir, services=False, **QUIET)
        assert _leftovers(name, state_dir) == []
    finally:
        lifecycle.down(name, state_dir=state_dir, **QUIET)


def _start_up(path: Path, state_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", "testbed", "up", "--config", str(path),
         "--no-services", "--state-dir", str(state_dir)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait_for_namespaces(name: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not netns.list_namespaces(name_prefix(name)):
        assert time.monotonic() < deadline and proc.poll() is None, "up never started"
        time.sleep(0.01)


def test_down_cleans_up_after_a_killed_up(
    needs_root: None, write_config: Callable[..., Path], state_dir: Path
) -> None:
    path = write_config()
    name = _name(path)
    proc = _start_up(path, state_dir)
    try:
        _wait_for_namespaces(name, proc)
        proc.send_signal(signal.SIGKILL)  # no handler runs: only the state file and the prefix
        proc.wait(timeout=10)
        assert _leftovers(name, state_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
        lifecycle.down(name, state_dir=state_dir, **QUIET)
    assert _leftovers(name, state_dir) == []


def test_interrupted_up_tears_itself_down(
    needs_root: None, write_config: Callable[..., Path], state_dir: Path
) -> None:
    path = write_config()
    name = _name(path)
    proc = _start_up(path, state_dir)
    try:
        _wait_for_namespaces(name, proc)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        # Either the signal came during `up` (which then tore down) or after it finished.
        if proc.returncode != 0:
            assert _leftovers(name, state_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        lifecycle.down(name, state_dir=state_dir, **QUIET)
    assert _leftovers(name, state_dir) == []


def test_without_root_the_command_says_it_needs_root(
    write_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NeedsRootError, match="needs root"):
        lifecycle.up(write_config(), services=False, **QUIET)
    from app.cli import main

    assert main(["testbed", "up", "--config", str(write_config())]) == 2
    assert NEEDS_ROOT_MESSAGE in capsys.readouterr().err
