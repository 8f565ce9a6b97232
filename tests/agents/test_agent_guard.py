"""The role guard: exit status passed through, and no survivors when its agent dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from agent_testing import ROLE_STUB, alive, group_members, wait_until


def _guard(*command: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "agents.guard", str(os.getpid()), "--", *command],
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_guard_exits_with_the_roles_code():
    proc = _guard(sys.executable, "-c", "import sys; print('hi'); sys.exit(7)")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 7 and out == b"hi\n"


def test_guard_dies_by_the_signal_that_killed_the_role():
    proc = _guard(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGSEGV


def test_guard_dies_by_sigkill_when_the_role_is_killed_by_sigkill():
    # Issue 15: the guard crashed with EINVAL installing a handler for SIGKILL.
    proc = _guard(sys.executable, str(ROLE_STUB), "--sleep", "60")
    assert proc.stdout is not None
    pids = {k: int(v) for k, v in (p.split("=") for p in proc.stdout.readline().decode().split()[1:])}

    os.kill(pids["role"], signal.SIGKILL)

    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGKILL
    assert b"Traceback" not in out and b"Errno" not in out


def test_guard_reports_a_command_that_cannot_run():
    proc = _guard("/nonexistent/trainer")
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 127 and b"cannot execute" in out


def test_sigterm_to_the_group_reaches_the_role_not_the_guard():
    proc = _guard(sys.executable, str(ROLE_STUB), "--sleep", "60")
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("PIDS")
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=20)
    # The guard survived the SIGTERM long enough to report how the role ended.
    assert proc.returncode == -signal.SIGTERM


def test_guard_kills_its_whole_group_when_the_agent_is_killed():
    # A stand-in agent starts the guard the way the supervisor does, then is SIGKILLed.
    agent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys, time
            guard = subprocess.Popen(
                [sys.executable, "-m", "agents.guard", str(os.getpid()), "--",
                 sys.executable, {str(ROLE_STUB)!r}, "--sleep", "600", "--spawn-child"],
                start_new_session=True, stdout=subprocess.PIPE)
            print(guard.pid, guard.stdout.readline().decode().strip(), flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE,
    )
    assert agent.stdout is not None
    first = agent.stdout.readline().decode().split()
    guard_pid = int(first[0])
    pids = {k: int(v) for k, v in (p.split("=") for p in first[2:])}
    assert pids["pgid"] == guard_pid and alive(pids["role"]) and alive(pids["child"])

    agent.kill()
    agent.wait()

    wait_until(lambda: group_members(guard_pid) == [], 10, "the role's group to die with its agent")
    assert not alive(pids["role"]) and not alive(pids["child"])
