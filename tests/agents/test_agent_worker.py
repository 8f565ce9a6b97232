"""Real agent processes running real Celery workers, on the real Redis and on the embedded
SQLite broker: launch and cancel through the broker, and no role outliving its agent."""

from __future__ import annotations

import json
import signal
import stat
import sys
import time

from agent_testing import (
    send_launch,
    wait_registered,
    AgentProcess,
    FakeControlPlane,
    alive,
    group_members,
    make_bundle,
    pids_from_logs,
    publish,
    role_spec,
    sha256_of,
    wait_until,
)

from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE
from hybridtrain.contract import PROFILE_TASK


def _cancel(broker_url: str, plane: FakeControlPlane, run_id: int) -> None:
    publish(broker_url, plane, CANCEL_RUN, [run_id, "cancelled by the user"])


def _launch_then_cancel(broker_url: str, plane: FakeControlPlane, agent: AgentProcess) -> float:
    sent = send_launch(broker_url, plane, 31, sleep=120, spawn_child=True)
    started = wait_until(lambda: plane.events_of(31, "started"), 30, "the role to start")[0]
    pids = wait_until(lambda: pids_from_logs(plane.lines_of(31, 1)), 15, "the role's first log lines")
    assert started["pid"] == pids["pgid"]
    assert alive(pids["role"]) and alive(pids["child"])

    _cancel(broker_url, plane, 31)

    exited = wait_until(lambda: plane.events_of(31, "exited"), 30, "the cancelled role's exit")[0]
    assert exited["cancelled"] is True
    assert exited["reason"] == "rank 1 (worker) stopped: cancelled by the user"
    assert group_members(pids["pgid"]) == []
    assert not alive(pids["role"]) and not alive(pids["child"])
    return started["t"] - sent


def test_agent_on_redis_launches_and_cancels_a_role(agent_redis_url, control_plane, start_agent, tmp_path):
    agent = start_agent(control_plane, agent_redis_url)
    wait_registered(control_plane, agent)

    _launch_then_cancel(agent_redis_url, control_plane, agent)

    assert agent.stop(signal.SIGTERM) == 0
    registration = control_plane.registrations[0]
    assert registration["hardware"]["cpu_cores"] >= 1
    assert registration["agent_token"].startswith("hta_")
    state_file = tmp_path / "agent-state" / "agent.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600


def test_agent_on_the_embedded_sqlite_broker_launches_and_cancels_fast(
    sqlite_broker, control_plane, start_agent
):
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)

    latency = _launch_then_cancel(sqlite_broker, control_plane, agent)

    # kombu's 1 s default polling would make this about a second; 50 ms polling plus the
    # guard's and the role's start leave it well under half of that.
    assert latency < 0.5, f"launch took {latency:.3f} s from publish to the role's start"
    assert agent.stop(signal.SIGTERM) == 0


def test_a_spot_notice_lets_each_role_leave_then_reports_its_exit_and_stops_the_agent(
    agent_redis_url, control_plane, start_agent
):
    agent = start_agent(control_plane, agent_redis_url, extra=["--stop-grace", "20"])
    wait_registered(control_plane, agent)
    send_launch(agent_redis_url, control_plane, 41, sleep=120, spawn_child=True, leave_on_term=1.0)
    pids = wait_until(lambda: pids_from_logs(control_plane.lines_of(41, 1)), 30, "the role to run")

    start = time.monotonic()
    assert agent.stop(signal.SIGTERM) == 0

    # The worker left at its step boundary, well inside the grace, and nothing of it is left.
    assert time.monotonic() - start < 15
    assert group_members(pids["pgid"]) == []
    [exited] = control_plane.events_of(41, "exited")
    assert exited["reason"] == "rank 1 (worker) stopped: spot notice / agent stopping"
    assert exited["cause"] == "agent_stopping" and exited["exit_code"] == 0
    assert "left" in control_plane.lines_of(41, 1)


def test_a_killed_agent_leaves_no_orphans_and_its_successor_reports_the_roles_exit(
    sqlite_broker, control_plane, start_agent
):
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)
    send_launch(sqlite_broker, control_plane, 51, sleep=120, spawn_child=True)
    pids = wait_until(lambda: pids_from_logs(control_plane.lines_of(51, 1)), 30, "the role to run")

    agent.stop(signal.SIGKILL)

    wait_until(lambda: group_members(pids["pgid"]) == [], 10, "the role's group to die with the agent")
    assert not alive(pids["child"])

    assert control_plane.events_of(51, "exited") == []
    beats = len(control_plane.heartbeats)
    again = start_agent(control_plane, sqlite_broker, join=False)
    wait_until(lambda: len(control_plane.heartbeats) > beats + 1, 60, "the restarted agent's heartbeats")
    assert len(control_plane.registrations) == 1  # the saved agent token was enough
    [exited] = wait_until(lambda: control_plane.events_of(51, "exited"), 30, "the role's exit")
    assert exited["reason"] == "rank 1 (worker) stopped: its agent restarted"
    assert exited["cause"] == "agent_restarted"
    assert group_members(pids["pgid"]) == [] and not alive(pids["role"])
    assert again.stop(signal.SIGTERM) == 0


def test_agent_stops_roles_the_control_plane_lists_in_a_heartbeat_answer(
    agent_redis_url, control_plane, start_agent
):
    agent = start_agent(control_plane, agent_redis_url)
    wait_registered(control_plane, agent)
    send_launch(agent_redis_url, control_plane, 61, sleep=120)
    pids = wait_until(lambda: pids_from_logs(control_plane.lines_of(61, 1)), 30, "the role to run")

    with control_plane.lock:
        control_plane.stop_orders.append({"run_id": 61, "reason": "run 61 failed on another node"})

    exited = wait_until(lambda: control_plane.events_of(61, "exited"), 20, "the role to stop")[0]
    assert exited["reason"] == "rank 1 (worker) stopped: run 61 failed on another node"
    assert group_members(pids["pgid"]) == []
    # Later heartbeats carry the exit too, for a control plane that missed the event.
    wait_until(
        lambda: any(r["run_id"] == 61 and r["state"] == "exited" for r in control_plane.heartbeats[-1]["roles"]),
        10, "a heartbeat with the exited role",
    )
    assert agent.stop(signal.SIGTERM) == 0


def test_a_heartbeat_stop_of_an_earlier_attempt_spares_the_restarted_role(
    agent_redis_url, control_plane, start_agent
):
    # The answer to a beat that listed attempt 0 of rank 1 may arrive after the restart's
    # attempt 1 of that rank has started: it must stop only what is older.
    agent = start_agent(control_plane, agent_redis_url)
    wait_registered(control_plane, agent)
    publish(agent_redis_url, control_plane, LAUNCH_ROLE, [62, 1, {**role_spec(62, sleep=120), "attempt": 1}])
    pids = wait_until(lambda: pids_from_logs(control_plane.lines_of(62, 1)), 30, "the role to run")

    with control_plane.lock:
        control_plane.stop_orders.append({"run_id": 62, "rank": 1, "before_attempt": 1,
                                          "reason": "run 62 restarted: attempt 0 is over"})
    served = wait_until(lambda: not control_plane.stop_orders and len(control_plane.heartbeats), 10,
                        "the stop to be answered")
    wait_until(lambda: len(control_plane.heartbeats) >= served + 2, 10, "two more heartbeats")
    assert alive(pids["role"]) and control_plane.events_of(62, "exited") == []

    with control_plane.lock:
        control_plane.stop_orders.append({"run_id": 62, "rank": 1, "reason": "run 62 was cancelled"})
    exited = wait_until(lambda: control_plane.events_of(62, "exited"), 20, "the role to stop")[0]
    assert exited["reason"] == "rank 1 (worker) stopped: run 62 was cancelled"
    assert agent.stop(signal.SIGTERM) == 0


def test_agent_with_an_unknown_join_token_exits_with_a_clear_error(control_plane, start_agent, agent_redis_url):
    agent = start_agent(control_plane, agent_redis_url, join=False, extra=["--token", "not-the-join-token"])

    assert agent.proc.wait(timeout=60) == 2
    assert "control plane refused the credentials on /register: unknown join token" in agent.output()


def test_agent_runs_a_bundle_role_sent_through_the_broker(sqlite_broker, control_plane, start_agent, tmp_path):
    data = make_bundle({"train.py": "print('user code')\n"})
    control_plane.files["/api/v1/runs/71/bundle"] = ("run-secret", data)
    spec = {**role_spec(71, 1), "bundle": {"sha256": sha256_of(data), "path": "/api/v1/runs/71/bundle"},
            "script_args": ["--epochs", "2"]}
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)

    publish(sqlite_broker, control_plane, LAUNCH_ROLE, [71, 1, spec])

    exited = wait_until(lambda: control_plane.events_of(71, "exited"), 30, "the role's exit")[0]
    assert exited["exit_code"] == 0, exited
    argv = next(x for x in control_plane.lines_of(71, 1) if x.startswith("argv "))
    assert argv.endswith("-- --epochs 2")
    assert (tmp_path / "agent-state" / "runs" / "71" / "code" / "train.py").exists()
    assert agent.stop(signal.SIGTERM) == 0


def test_agent_profiles_a_task_sent_through_the_broker(sqlite_broker, control_plane, start_agent, tmp_path):
    data = make_bundle({"usertask.py": "def task(): pass\n"})
    # Registered without a run token: only the agent's own token fetches a profile's bundle.
    control_plane.files["/api/v1/agent/profiles/3/bundle"] = (None, data)
    standin = "import json, os; print(json.dumps({'cwd': os.getcwd(), 'samples_per_s': 9.5}))"
    lock = tmp_path / "host-profile.lock"
    agent = start_agent(control_plane, sqlite_broker,
                        extra=["--profile-command", json.dumps([sys.executable, "-c", standin]),
                               "--profile-lock-path", str(lock)])
    wait_registered(control_plane, agent)
    spec = {"task": "usertask:task", "task_args": {}, "batch_size": 8, "device": "cpu",
            "bundle": {"sha256": sha256_of(data), "path": "/api/v1/agent/profiles/3/bundle"}}

    publish(sqlite_broker, control_plane, PROFILE_TASK, [3, spec])

    [(profile_id, body)] = wait_until(lambda: list(control_plane.profiles), 60, "the profile's report")
    assert profile_id == 3 and body["status"] == "done", body
    assert body["result"]["cwd"] == str(tmp_path / "agent-state" / "profiles" / "3" / "code")
    assert body["result"]["samples_per_s"] == 9.5
    # Two runs that agree, under the host's lock named on the command line.
    assert (body["result"]["repeats"], body["result"]["spread"]) == (2, 0.0)
    assert lock.exists()
    assert agent.stop(signal.SIGTERM) == 0
