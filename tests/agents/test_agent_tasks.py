"""The task bodies called directly (no broker), starting and stopping real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.bundles import BundleCache
from agents.client import ControlPlaneClient
from agents.errors import ControlPlaneUnavailable, LaunchError
from agents.supervisor import Supervisor
from agents.tasks import cancel_run, launch_role
from agent_testing import (
    STUB_COMMAND,
    alive,
    group_members,
    make_bundle,
    pids_from_logs,
    role_spec,
    sha256_of,
    wait_until,
)


class RecordingReporter:
    """Collects what the supervisor reports; can pretend the control plane is down."""

    def __init__(self) -> None:
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.batches: list[tuple[int, dict[str, Any]]] = []
        self.down = False
        self.lock = threading.Lock()

    def role_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ControlPlaneUnavailable("down")
        with self.lock:
            self.events.append((run_id, body))
        return {}

    def logs(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ControlPlaneUnavailable("down")
        with self.lock:
            self.batches.append((run_id, body))
        return {}

    def event(self, run_id: int, kind: str) -> dict[str, Any] | None:
        with self.lock:
            return next((b for r, b in self.events if r == run_id and b["event"] == kind), None)

    def lines(self, run_id: int, rank: int) -> list[str]:
        with self.lock:
            items = [x for r, b in self.batches if r == run_id and b["rank"] == rank for x in b["lines"]]
        return [x["line"] for x in sorted(items, key=lambda x: x["seq"])]


@pytest.fixture
def reporter() -> RecordingReporter:
    return RecordingReporter()


@pytest.fixture
def supervisor(tmp_path: Path, reporter: RecordingReporter) -> Supervisor:
    sup = Supervisor(
        reporter,
        state_dir=tmp_path / "state",
        trainer_command=STUB_COMMAND,
        kill_grace_s=2.0,
        log_flush_interval_s=0.1,
        event_retry_s=0.0,
    )
    yield sup
    sup.stop_all("test teardown")


def test_launch_role_runs_the_role_and_reports_start_exit_and_logs(supervisor, reporter):
    result = launch_role(11, 1, role_spec(11, 1, lines=5), supervisor=supervisor)

    exited = wait_until(lambda: reporter.event(11, "exited"), 20, "the exit event")
    started = reporter.event(11, "started")
    assert started["pid"] == result["pid"] and started["rank"] == 1
    assert exited["exit_code"] == 0 and exited["signal"] is None and exited["reason"] is None
    assert exited["cancelled"] is False
    lines = reporter.lines(11, 1)
    assert lines[2:] == ["line 0", "line 1", "line 2", "line 3", "line 4", "bye"]
    assert exited["tail"][-1] == "bye"
    argv = lines[1].split()
    assert argv[argv.index("--batch-sizes") + 1] == "20,8,4"
    assert argv[argv.index("--strategy") + 1] == "ps-bz-gc"
    log_file = supervisor.state_dir / "runs" / "11" / "rank1.log"
    assert log_file.read_text().endswith("bye\n")


def test_failing_role_reports_its_code_and_last_line(supervisor, reporter):
    launch_role(12, 2, role_spec(12, 2, exit_code=3), supervisor=supervisor)

    exited = wait_until(lambda: reporter.event(12, "exited"), 20, "the exit event")
    assert exited["exit_code"] == 3
    assert exited["reason"] == "rank 2 (worker) exited with code 3: bye"


def test_cancel_run_kills_the_role_and_its_children(supervisor, reporter):
    launch_role(13, 1, role_spec(13, 1, sleep=60, spawn_child=True), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(13, 1)), 20, "the role's pids")
    assert alive(pids["role"]) and alive(pids["child"])

    result = cancel_run(13, "user asked", supervisor=supervisor)

    assert result == {"run_id": 13, "cancelled_ranks": [1]}
    # cancel returns once the group is gone: the child ignores SIGTERM, so only the sweep
    # with SIGKILL after the role's exit can have ended it.
    assert not alive(pids["role"]) and not alive(pids["child"])
    assert group_members(pids["pgid"]) == []
    exited = wait_until(lambda: reporter.event(13, "exited"), 10, "the exit event")
    assert exited["cancelled"] is True
    assert exited["signal"] == signal.SIGTERM
    assert exited["reason"] == "rank 1 (worker) stopped: user asked"


def test_cancel_escalates_to_sigkill_after_the_grace(supervisor, reporter):
    launch_role(14, 1, role_spec(14, 1, sleep=60, ignore_term=True), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(14, 1)), 20, "the role's pids")

    start = time.monotonic()
    cancel_run(14, "stop", supervisor=supervisor)

    assert 1.5 < time.monotonic() - start < 8
    assert group_members(pids["pgid"]) == []
    exited = wait_until(lambda: reporter.event(14, "exited"), 10, "the exit event")
    assert exited["signal"] == signal.SIGKILL


def test_repeated_launch_of_a_rank_starts_nothing_new(supervisor, reporter):
    first = launch_role(15, 1, role_spec(15, 1, sleep=60), supervisor=supervisor)
    second = launch_role(15, 1, role_spec(15, 1, sleep=60), supervisor=supervisor)

    assert second["pid"] == first["pid"]
    assert len([r for r in supervisor.roles() if r.spec.run_id == 15]) == 1


def test_launch_rejects_an_invalid_order(supervisor):
    with pytest.raises(LaunchError, match="rank 9 is outside world_size 4"):
        launch_role(16, 9, role_spec(16, 9), supervisor=supervisor)
    with pytest.raises(LaunchError, match="carries a spec for run 99"):
        launch_role(16, 1, {**role_spec(16, 1), "run_id": 99}, supervisor=supervisor)
    bad = role_spec(16, 1)
    bad["env"] = {"LD_PRELOAD": "/tmp/evil.so"}
    with pytest.raises(LaunchError, match="LD_PRELOAD"):
        launch_role(16, 1, bad, supervisor=supervisor)
    assert supervisor.roles() == []


def test_cancel_of_a_run_with_nothing_running_is_a_no_op(supervisor):
    assert cancel_run(404, "nothing", supervisor=supervisor) == {"run_id": 404, "cancelled_ranks": []}


def test_stop_all_ends_every_role(supervisor, reporter):
    launch_role(17, 1, role_spec(17, 1, sleep=60), supervisor=supervisor)
    launch_role(18, 2, role_spec(18, 2, sleep=60), supervisor=supervisor)
    pids = [
        wait_until(lambda r=r, k=k: pids_from_logs(reporter.lines(r, k)), 20, "pids")["pgid"]
        for r, k in ((17, 1), (18, 2))
    ]

    stopped = supervisor.stop_all("agent stopping")

    assert sorted(stopped) == [(17, 1), (18, 2)]
    assert all(group_members(p) == [] for p in pids)
    assert reporter.event(17, "exited")["reason"] == "rank 1 (worker) stopped: agent stopping"
    with pytest.raises(LaunchError, match="stopping"):
        launch_role(19, 1, role_spec(19, 1), supervisor=supervisor)


def test_logs_are_kept_bounded_while_the_control_plane_is_down(tmp_path, reporter):
    sup = Supervisor(
        reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND,
        log_buffer_lines=10, log_flush_interval_s=0.05, event_retry_s=0.0,
    )
    try:
        reporter.down = True
        launch_role(20, 1, role_spec(20, 1, lines=50, sleep=1.0), supervisor=sup)
        role = sup.roles()[0]
        wait_until(lambda: role.next_seq >= 50, 20, "the output to be read")
        reporter.down = False
        wait_until(lambda: reporter.event(20, "exited"), 20, "the exit event")
        lines = reporter.lines(20, 1)
        # Only the newest lines survive, the rest are counted as dropped, none duplicated.
        assert lines[-1] == "bye" and len(lines) <= 10 + 1
        assert len(lines) == len(set(lines))
        dropped = sum(b["dropped"] for _, b in reporter.batches)
        assert dropped + len(lines) == role.next_seq
    finally:
        sup.stop_all()


def test_reap_stale_kills_what_a_dead_agent_left_behind(tmp_path, reporter):
    # A "previous agent" started a role group and died without cleaning up; its record stays.
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(600)']); time.sleep(600)"],
        start_new_session=True,
    )
    wait_until(lambda: len(group_members(leftover.pid)) == 2, 10, "the leftover group")
    records = tmp_path / "s" / "roles"
    records.mkdir(parents=True)
    import psutil

    (records / "21-1.json").write_text(json.dumps({
        "run_id": 21, "rank": 1, "role": "worker", "pid": leftover.pid,
        "create_time": psutil.Process(leftover.pid).create_time(),
    }))
    # And a record whose pid now belongs to another process: must be left alone.
    (records / "22-1.json").write_text(json.dumps({
        "run_id": 22, "rank": 1, "role": "worker", "pid": os.getpid(), "create_time": 1.0,
    }))

    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND)
    try:
        stale = sup.reap_stale()
    finally:
        sup.close()

    leftover.wait(timeout=5)
    assert [s["run_id"] for s in stale] == [21]
    wait_until(lambda: group_members(leftover.pid) == [], 5, "the leftover group to die")
    assert list(records.glob("*.json")) == []


def test_role_killed_by_sigkill_is_reported_with_the_oom_hint(supervisor, reporter):
    launch_role(23, 1, role_spec(23, 1, sleep=60), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(23, 1)), 20, "the role's pids")

    # What the kernel's OOM killer does: SIGKILL to the role alone, not to its group.
    os.kill(pids["role"], signal.SIGKILL)

    exited = wait_until(lambda: reporter.event(23, "exited"), 20, "the exit event")
    assert exited["signal"] == signal.SIGKILL and exited["exit_code"] is None
    assert exited["cancelled"] is False
    assert exited["reason"] == (
        "rank 1 (worker) was killed by SIGKILL "
        "(likely the kernel's out-of-memory killer: check `dmesg`)"
    )


def test_role_killed_by_sigsegv_is_reported_without_the_oom_hint(supervisor, reporter):
    launch_role(24, 1, role_spec(24, 1, sleep=60), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(24, 1)), 20, "the role's pids")

    os.kill(pids["role"], signal.SIGSEGV)

    exited = wait_until(lambda: reporter.event(24, "exited"), 20, "the exit event")
    assert exited["signal"] == signal.SIGSEGV
    assert exited["reason"] == "rank 1 (worker) was killed by SIGSEGV"


# -- roles running the user's code from a bundle ------------------------------------------------

# The role of these tests: it reports where it runs and what it can import, like a user's
# script would need to; as the trainer does, it puts --code-dir first on its import path.
PROBE = (
    "import json, os, sys; safe = '' not in sys.path and os.getcwd() not in sys.path; "
    "sys.path.insert(0, sys.argv[sys.argv.index('--code-dir') + 1]); import usercode; "
    "print('PROBE ' + json.dumps({'cwd': os.getcwd(), 'sys_path': sys.path, 'safe': safe, "
    "'safe_path': os.environ.get('PYTHONSAFEPATH'), 'user': usercode.VALUE, "
    "'argv': sys.argv[1:]}), flush=True)"
)


@pytest.fixture
def bundle_supervisor(tmp_path: Path, reporter: RecordingReporter, control_plane):
    http = ControlPlaneClient(control_plane.url, timeout_s=5)
    sup = Supervisor(
        reporter,
        state_dir=tmp_path / "state",
        trainer_command=[sys.executable, "-c", PROBE],
        kill_grace_s=2.0,
        log_flush_interval_s=0.1,
        event_retry_s=0.0,
        bundles=BundleCache(tmp_path / "state", http, retry_s=0),
    )
    yield sup
    sup.stop_all("test teardown")
    http.close()


def _bundle_order(control_plane, run_id: int, rank: int, files: dict[str, str] | None = None, **extra) -> dict[str, Any]:
    path = f"/api/v1/runs/{run_id}/bundle"
    data = make_bundle(files or {"usercode.py": "VALUE = 42\n", "train.py": "pass\n"})
    control_plane.files[path] = ("run-secret", data)
    return {**role_spec(run_id, rank), "bundle": {"sha256": sha256_of(data), "path": path}, **extra}


def _probe(reporter: RecordingReporter, run_id: int, rank: int) -> dict[str, Any]:
    line = wait_until(
        lambda: next((x for x in reporter.lines(run_id, rank) if x.startswith("PROBE ")), None),
        20, "the probe's report",
    )
    return json.loads(line[len("PROBE "):])


def test_bundle_role_runs_in_the_unpacked_code_which_it_imports_after_its_own_packages(
        bundle_supervisor, reporter, control_plane):
    order = _bundle_order(control_plane, 25, 1, script_args=["--epochs", "3"])

    launch_role(25, 1, order, supervisor=bundle_supervisor)

    probe = _probe(reporter, 25, 1)
    code = bundle_supervisor.state_dir / "runs" / "25" / "code"
    assert probe["cwd"] == str(code)
    # The working directory was not on the import path before the role added --code-dir:
    # a user's own `trainer/` there cannot replace the trainer that `-m trainer` starts.
    assert probe["safe"] and probe["safe_path"] == "1"
    assert probe["argv"][-5:] == ["--code-dir", str(code), "--", "--epochs", "3"]
    assert probe["sys_path"][0] == str(code) and probe["user"] == 42
    exited = wait_until(lambda: reporter.event(25, "exited"), 20, "the exit event")
    assert exited["exit_code"] == 0


def test_ranks_of_one_run_share_one_download_and_one_unpacked_tree(bundle_supervisor, reporter, control_plane):
    order1 = _bundle_order(control_plane, 26, 1)
    order2 = {**order1, "rank": 2}

    launch_role(26, 1, order1, supervisor=bundle_supervisor)
    launch_role(26, 2, order2, supervisor=bundle_supervisor)

    assert _probe(reporter, 26, 1)["cwd"] == _probe(reporter, 26, 2)["cwd"]
    assert control_plane.downloads_of("/api/v1/runs/26/bundle") == 1


def test_bundle_that_cannot_be_fetched_fails_the_role_with_the_reason(bundle_supervisor, reporter, control_plane):
    order = _bundle_order(control_plane, 27, 1)
    order["bundle"] = {"sha256": "3f2a" + "0" * 60, "path": "/api/v1/runs/999/bundle"}

    result = launch_role(27, 1, order, supervisor=bundle_supervisor)

    assert result["pid"] is None
    exited = wait_until(lambda: reporter.event(27, "exited"), 20, "the exit event")
    assert reporter.event(27, "started") is None
    assert exited["exit_code"] == 1 and exited["cancelled"] is False and exited["pid"] is None
    assert exited["reason"] == (
        "rank 1 (worker) not started: bundle 3f2a00000000\u2026: HTTP 404 from the control plane"
    )
    # The heartbeat carries it too, in case the event is lost.
    [snap] = [r for r in bundle_supervisor.snapshot() if r["run_id"] == 27]
    assert snap["state"] == "exited" and snap["reason"] == exited["reason"]


def test_bundle_with_a_wrong_digest_fails_the_role_without_running_it(bundle_supervisor, reporter, control_plane):
    order = _bundle_order(control_plane, 28, 1)
    order["bundle"] = {**order["bundle"], "sha256": "0" * 64}

    launch_role(28, 1, order, supervisor=bundle_supervisor)

    exited = wait_until(lambda: reporter.event(28, "exited"), 20, "the exit event")
    assert "sha256 mismatch" in exited["reason"]
    assert not (bundle_supervisor.state_dir / "runs" / "28" / "code").exists()


def test_bundle_with_an_unsafe_member_fails_the_role(bundle_supervisor, reporter, control_plane):
    order = _bundle_order(control_plane, 29, 1, files={"../escape.py": "x = 1\n"})

    launch_role(29, 1, order, supervisor=bundle_supervisor)

    exited = wait_until(lambda: reporter.event(29, "exited"), 20, "the exit event")
    assert "'../escape.py' is not a safe relative path" in exited["reason"]
    assert not (bundle_supervisor.state_dir / "runs" / "escape.py").exists()


def test_cancel_of_a_role_that_failed_before_starting_is_a_no_op(bundle_supervisor, reporter, control_plane):
    order = _bundle_order(control_plane, 30, 1)
    order["bundle"] = {**order["bundle"], "path": "/api/v1/runs/404/bundle"}
    launch_role(30, 1, order, supervisor=bundle_supervisor)
    wait_until(lambda: reporter.event(30, "exited"), 20, "the exit event")

    assert cancel_run(30, "user asked", supervisor=bundle_supervisor)["cancelled_ranks"] == []


def test_the_code_dir_reaches_the_trainer_absolute_before_a_scripts_arguments(tmp_path, monkeypatch):
    from agents.supervisor import with_code_dir

    # An agent started with a relative --state-dir (`hybridtrain local`): the role runs inside
    # the code dir, where the relative path would point below itself.
    monkeypatch.chdir(tmp_path)
    argv = with_code_dir(["python", "-m", "trainer", "--", "--epochs", "3"], Path("var/agent/runs/1/code"))
    assert argv == ["python", "-m", "trainer", "--code-dir", str(tmp_path / "var/agent/runs/1/code"),
                    "--", "--epochs", "3"]
