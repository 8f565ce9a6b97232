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
        self.delivered_reports: list[tuple[int, dict[str, Any]]] = []
        # (what, run_id) in the order it arrived: an event's name, or "report".
        self.order: list[tuple[str, int]] = []
        # Runs that ended: a "started" for one of them is answered "stop".
        self.finished_runs: set[int] = set()
        self.down = False
        self.lock = threading.Lock()

    def role_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ControlPlaneUnavailable("down")
        with self.lock:
            self.events.append((run_id, body))
            self.order.append((body["event"], run_id))
        if body["event"] == "started" and run_id in self.finished_runs:
            return {"run_status": "cancelled", "action": "stop", "reason": f"run {run_id} has cancelled"}
        return {}

    def logs(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ControlPlaneUnavailable("down")
        with self.lock:
            self.batches.append((run_id, body))
        return {}

    def reports(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise ControlPlaneUnavailable("down")
        with self.lock:
            self.delivered_reports.append((run_id, body))
            self.order.append(("report", run_id))
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
        stop_grace_s=2.0,
        log_flush_interval_s=0.1,
    )
    yield sup
    sup.stop_all("test teardown")
    sup.close()


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
    assert json.loads(argv[argv.index("--options-json") + 1])["strategy"] == "ps-bz-gc"
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
    # The exits are queued when stop_all returns; the outbox delivers them a moment later.
    exited = wait_until(lambda: reporter.event(17, "exited"), 20, "the exit event")
    assert exited["reason"] == "rank 1 (worker) stopped: agent stopping"
    with pytest.raises(LaunchError, match="stopping"):
        launch_role(19, 1, role_spec(19, 1), supervisor=supervisor)


def test_logs_written_while_the_control_plane_is_down_all_arrive_once_it_is_back(tmp_path, reporter):
    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND,
                     log_flush_interval_s=0.05)
    try:
        reporter.down = True
        launch_role(20, 1, role_spec(20, 1, lines=50), supervisor=sup)
        role = sup.roles()[0]
        wait_until(lambda: role.finished.is_set(), 20, "the role to end")
        assert reporter.lines(20, 1) == []

        reporter.down = False

        wait_until(lambda: reporter.event(20, "exited"), 20, "the exit event")
        lines = reporter.lines(20, 1)
        assert lines[2:] == [f"line {i}" for i in range(50)] + ["bye"]
        assert sum(b["dropped"] for _, b in reporter.batches) == 0
    finally:
        sup.stop_all()
        sup.close()


def test_logs_are_kept_bounded_when_the_outbox_is_full(tmp_path, reporter):
    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND,
                     log_buffer_lines=10, outbox_log_lines=5, log_flush_interval_s=0.05)
    try:
        reporter.down = True
        launch_role(20, 1, role_spec(20, 1, lines=50, sleep=1.0), supervisor=sup)
        role = sup.roles()[0]
        wait_until(lambda: role.finished.is_set(), 20, "the role to end")
        reporter.down = False
        wait_until(lambda: reporter.event(20, "exited"), 20, "the exit event")
        lines = reporter.lines(20, 1)
        # Only the newest lines survive, the rest are counted as dropped, none duplicated.
        assert lines[-1] == "bye" and len(lines) <= 5 + 10
        assert len(lines) == len(set(lines))
        dropped = sum(b["dropped"] for _, b in reporter.batches)
        assert dropped + len(lines) == role.next_seq
    finally:
        sup.stop_all()
        sup.close()


def test_reap_stale_kills_what_a_dead_agent_left_and_reports_each_role_exited(tmp_path, reporter):
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
        "run_id": 21, "rank": 1, "role": "worker", "pid": leftover.pid, "state": "running",
        "create_time": psutil.Process(leftover.pid).create_time(),
    }))
    # And a record whose pid now belongs to another process: its role is gone, the process
    # that has the pid now must be left alone.
    (records / "22-1.json").write_text(json.dumps({
        "run_id": 22, "rank": 1, "role": "worker", "pid": os.getpid(), "create_time": 1.0,
    }))

    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND)
    try:
        stale = sup.reap_stale()
        wait_until(lambda: reporter.event(22, "exited"), 10, "the exits to be reported")
    finally:
        sup.close()

    leftover.wait(timeout=5)
    assert {s["run_id"]: bool(s["killed"]) for s in stale} == {21: True, 22: False}
    wait_until(lambda: group_members(leftover.pid) == [], 5, "the leftover group to die")
    for run_id in (21, 22):
        exited = reporter.event(run_id, "exited")
        assert exited["reason"] == "rank 1 (worker) stopped: its agent restarted"
        assert exited["cause"] == "agent_restarted" and exited["cancelled"] is False
    assert all(json.loads(p.read_text())["state"] == "exited" for p in records.glob("*.json"))


def test_reap_stale_delivers_what_a_lost_role_wrote_to_its_metrics_file_since_its_launch(tmp_path, reporter):
    metrics = tmp_path / "s" / "runs" / "23" / "rank1" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    earlier = json.dumps({"rank": 1, "stream": "a", "seq": 0, "name": "loss", "value": 1.0, "step": 0}) + "\n"
    metrics.write_text(earlier + "".join(
        json.dumps({"rank": 1, "stream": "b", "seq": i, "name": "loss", "value": 1.0, "step": i}) + "\n"
        for i in range(3)
    ))
    records = tmp_path / "s" / "roles"
    records.mkdir(parents=True)
    (records / "23-1.json").write_text(json.dumps({
        "run_id": 23, "rank": 1, "role": "worker", "pid": os.getpid(), "create_time": 1.0, "state": "running",
        "metrics": str(metrics), "metrics_from": len(earlier),
    }))

    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND)
    try:
        sup.reap_stale()
        wait_until(lambda: reporter.event(23, "exited"), 10, "the exit to be reported")
    finally:
        sup.close()

    delivered = [(r["stream"], r["seq"]) for _, body in reporter.delivered_reports for r in body["records"]]
    assert delivered == [("b", 0), ("b", 1), ("b", 2)]
    assert reporter.order.index(("report", 23)) < reporter.order.index(("exited", 23))


def test_a_launch_of_a_rank_an_earlier_agent_ran_to_its_end_starts_nothing_and_reports_the_exit(
        tmp_path, reporter):
    first = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND)
    launch_role(32, 1, role_spec(32, 1), supervisor=first)
    wait_until(lambda: reporter.event(32, "exited"), 20, "the exit event")
    first.close()

    again = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND)
    try:
        result = launch_role(32, 1, role_spec(32, 1), supervisor=again)

        assert result["state"] == "exited"
        wait_until(lambda: len([b for r, b in reporter.events if r == 32 and b["event"] == "exited"]) == 2,
                   10, "the exit to be reported again")
        assert len([b for r, b in reporter.events if r == 32 and b["event"] == "started"]) == 1
        assert [r.snapshot()["state"] for r in again.roles()] == ["exited"]
    finally:
        again.close()


def test_a_role_whose_run_ended_while_it_launched_is_stopped_when_the_start_is_answered_stop(
        supervisor, reporter):
    reporter.finished_runs.add(40)

    launch_role(40, 1, role_spec(40, 1, sleep=60), supervisor=supervisor)

    exited = wait_until(lambda: reporter.event(40, "exited"), 20, "the role to be stopped")
    assert exited["reason"] == "rank 1 (worker) stopped: run 40 has cancelled"
    assert exited["cause"] == "cancel"


def test_a_launch_with_a_higher_attempt_starts_the_rank_again(supervisor, reporter):
    launch_role(38, 1, role_spec(38, 1), supervisor=supervisor)
    wait_until(lambda: reporter.event(38, "exited"), 20, "the first attempt's exit")

    result = launch_role(38, 1, {**role_spec(38, 1), "attempt": 1}, supervisor=supervisor)

    assert result["state"] == "running"
    wait_until(lambda: len([b for r, b in reporter.events if r == 38 and b["event"] == "started"]) == 2,
               20, "the second attempt's start")


def test_a_launch_with_a_higher_attempt_stops_the_earlier_attempt_still_running_first(supervisor, reporter):
    launch_role(39, 1, role_spec(39, 1, sleep=60), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(39, 1)), 20, "the first attempt's pids")

    result = launch_role(39, 1, {**role_spec(39, 1), "attempt": 1}, supervisor=supervisor)

    assert result["state"] == "running" and result["pid"] != pids["pgid"]
    assert group_members(pids["pgid"]) == []
    wait_until(lambda: len([b for r, b in reporter.events if r == 39 and b["event"] == "started"]) == 2,
               20, "the second attempt's start")
    events = [(b["event"], b.get("pid")) for r, b in reporter.events if r == 39]
    # The earlier attempt's exit is reported before the new attempt's start.
    assert events[:3] == [("started", pids["pgid"]), ("exited", pids["pgid"]), ("started", result["pid"])]
    assert reporter.event(39, "exited")["reason"] == "rank 1 (worker) stopped: relaunched as attempt 1"


def test_a_restarts_cancel_that_arrives_after_the_new_attempts_launch_leaves_it_running(supervisor, reporter):
    launch_role(41, 1, {**role_spec(41, 1, sleep=60), "attempt": 1}, supervisor=supervisor)
    wait_until(lambda: reporter.lines(41, 1), 20, "the new attempt to run")

    result = cancel_run(41, "restarting run 41", supervisor=supervisor, before_attempt=1)

    assert result["cancelled_ranks"] == []
    assert [r.snapshot()["state"] for r in supervisor.roles()] == ["running"]
    cancel_run(41, "test over", supervisor=supervisor)


def test_a_stopping_agent_reports_its_roles_as_stopped_by_it_not_cancelled_by_an_order(supervisor, reporter):
    launch_role(33, 1, role_spec(33, 1, sleep=60, leave_on_term=0.3), supervisor=supervisor)
    launch_role(34, 1, role_spec(34, 1, sleep=60, leave_on_term=0.3), supervisor=supervisor)
    wait_until(lambda: reporter.lines(33, 1) and reporter.lines(34, 1), 20, "both roles to run")

    cancel_run(33, "cancelled by the user", supervisor=supervisor)
    supervisor.stop_all("spot notice / agent stopping")

    cancelled = wait_until(lambda: reporter.event(33, "exited"), 10, "the cancelled exit")
    stopped = wait_until(lambda: reporter.event(34, "exited"), 10, "the stopped exit")
    assert cancelled["cause"] == "cancel"
    assert stopped["cause"] == "agent_stopping"
    assert stopped["reason"] == "rank 1 (worker) stopped: spot notice / agent stopping"
    # The worker left at its step boundary: a clean exit, not a kill.
    assert stopped["exit_code"] == 0 and stopped["signal"] is None
    assert "left" in reporter.lines(34, 1)


def test_a_stopping_agent_kills_a_role_still_running_after_the_stop_grace(supervisor, reporter):
    launch_role(35, 1, role_spec(35, 1, sleep=60, ignore_term=True), supervisor=supervisor)
    pids = wait_until(lambda: pids_from_logs(reporter.lines(35, 1)), 20, "the role's pids")

    start = time.monotonic()
    supervisor.stop_all("spot notice / agent stopping")

    assert 1.5 < time.monotonic() - start < 8  # stop_grace_s is 2 s here
    assert group_members(pids["pgid"]) == []
    exited = wait_until(lambda: reporter.event(35, "exited"), 10, "the exit event")
    assert exited["signal"] == signal.SIGKILL and exited["cause"] == "agent_stopping"


def run_to_exit(tmp_path, reporter: RecordingReporter, spec: dict[str, Any], **options: Any) -> None:
    """Run one role under a supervisor of its own (state dir `tmp_path/s`) until its exit is
    reported."""
    sup = Supervisor(reporter, state_dir=tmp_path / "s", trainer_command=STUB_COMMAND, **options)
    try:
        launch_role(spec["run_id"], spec["rank"], spec, supervisor=sup)
        wait_until(lambda: reporter.event(spec["run_id"], "exited"), 20, "the exit event")
    finally:
        sup.close()


def test_what_the_trainer_spooled_is_delivered_by_its_agent_before_its_exit(tmp_path, reporter):
    run_to_exit(tmp_path, reporter, role_spec(36, 1, spool_records=1201))

    assert [len(body["records"]) for _, body in reporter.delivered_reports] == [500, 500, 201]
    assert {run_id for run_id, _ in reporter.delivered_reports} == {36}
    assert [r["seq"] for _, body in reporter.delivered_reports for r in body["records"]] == list(range(1201))
    # The spooled records come before the exit that ends the run.
    assert reporter.order.index(("report", 36)) < reporter.order.index(("exited", 36))
    assert not (tmp_path / "s" / "runs" / "36" / "rank1" / "report-spool.jsonl").exists()


def test_a_crashed_trainers_metrics_file_is_delivered_by_its_agent_before_its_exit(tmp_path, reporter):
    # Killed or crashed, a trainer loses what its reporter still held; its file has it all.
    run_to_exit(tmp_path, reporter, role_spec(39, 1, metrics_records=700, exit_code=1))

    assert [r["seq"] for _, body in reporter.delivered_reports for r in body["records"]] == list(range(700))
    assert reporter.order.index(("report", 39)) < reporter.order.index(("exited", 39))


def test_a_clean_exit_leaves_the_metrics_file_to_the_trainers_own_reporter(tmp_path, reporter):
    run_to_exit(tmp_path, reporter, role_spec(40, 1, metrics_records=30))

    assert reporter.delivered_reports == []


def test_each_rank_writes_its_metrics_in_its_own_directory(tmp_path, reporter):
    run_to_exit(tmp_path, reporter, role_spec(41, 1, **{"metrics-out": "metrics.jsonl"}))

    argv = next(x for x in reporter.lines(41, 1) if x.startswith("argv ")).split()
    assert argv.count("--metrics-out") == 1
    assert argv[argv.index("--metrics-out") + 1] == str(tmp_path / "s" / "runs" / "41" / "rank1" / "metrics.jsonl")


def test_reports_and_checkpoints_go_to_the_control_plane_the_agent_reaches(tmp_path, reporter):
    spec = {**role_spec(37, 1), "checkpoint_url": "http://localhost:8000/api/v1/runs/37/checkpoints"}
    run_to_exit(tmp_path, reporter, spec, server_url="https://cp.internal:8443")

    argv = next(x for x in reporter.lines(37, 1) if x.startswith("argv ")).split()
    assert argv[argv.index("--report-url") + 1] == "https://cp.internal:8443/api/v1/runs/37/metrics"
    assert argv[argv.index("--checkpoint-url") + 1] == "https://cp.internal:8443/api/v1/runs/37/checkpoints"
    assert argv[argv.index("--report-spool") + 1] == str(tmp_path / "s" / "runs" / "37" / "rank1" / "report-spool.jsonl")


@pytest.mark.parametrize(("field", "flag"), [("report_token", "--report-token-file"),
                                           ("link_secret", "--link-secret-file")])
def test_a_runs_secret_reaches_the_role_in_an_owner_only_file(supervisor, reporter, field, flag):
    launch_role(38, 1, {**role_spec(38, 1), field: "run-secret"}, supervisor=supervisor)
    wait_until(lambda: reporter.event(38, "exited"), 20, "the exit event")

    argv = next(x for x in reporter.lines(38, 1) if x.startswith("argv ")).split()
    assert "--report-token" not in argv and "run-secret" not in " ".join(argv)
    secret_file = Path(argv[argv.index(flag) + 1])
    assert secret_file.read_text().strip() == "run-secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600


def test_a_role_gets_the_nodes_environment_without_the_agents_settings():
    from agents.roles import role_base_env

    node = {"PATH": "/usr/bin", "CUDA_HOME": "/cuda", "AWS_PROFILE": "data",
            "CELERY_BROKER_URL": "redis://:pw@cp:6379/0", "HYBRIDTRAIN_AGENT_TOKEN": "hta_x",
            "HYBRIDTRAIN_SECRET_KEY": "k", "DATABASE_URL": "postgresql://u:pw@db/x"}
    assert role_base_env(node) == {"PATH": "/usr/bin", "CUDA_HOME": "/cuda", "AWS_PROFILE": "data"}


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
        stop_grace_s=2.0,
        log_flush_interval_s=0.1,
        bundles=BundleCache(tmp_path / "state", http, retry_s=0),
    )
    yield sup
    sup.stop_all("test teardown")
    sup.close()
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
    argv = probe["argv"]
    assert argv[argv.index("--code-dir") + 1] == str(code) and argv[-3:] == ["--", "--epochs", "3"]
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
    from agents.role_files import with_code_dir

    # An agent started with a relative --state-dir (`hybridtrain local`): the role runs inside
    # the code dir, where the relative path would point below itself.
    monkeypatch.chdir(tmp_path)
    argv = with_code_dir(["python", "-m", "trainer", "--", "--epochs", "3"], Path("var/agent/runs/1/code"), after=3)
    assert argv == ["python", "-m", "trainer", "--code-dir", str(tmp_path / "var/agent/runs/1/code"),
                    "--", "--epochs", "3"]


def test_agent_flags_go_after_a_trainer_command_that_holds_its_own_double_dash():
    from agents.reports import with_flag

    # The testbed's trainer command: `python -m testbed.incgroup CG -- python -m trainer`.
    command = ["python", "-m", "testbed.incgroup", "/cg", "--", "python", "-m", "trainer"]
    argv = with_flag([*command, "--rank", "1", "--", "--epochs", "3"], "--report-spool", "/s.jsonl",
                     after=len(command))
    assert argv == [*command, "--report-spool", "/s.jsonl", "--rank", "1", "--", "--epochs", "3"]
