"""Real agent processes through the faults of issues 15 and 17: a control plane that is down,
an agent restarted on its state dir, orders that wait for or come back to an agent, two
agents on one state dir, a conflict at registration, and the memory an idle agent holds."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from agent_testing import (
    group_members,
    pids_from_logs,
    send_launch,
    wait_registered,
    wait_until,
)


def test_role_events_and_logs_reach_a_control_plane_that_was_down_while_the_role_ran(
    sqlite_broker, control_plane, start_agent
):
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)
    control_plane.down = True

    send_launch(sqlite_broker, control_plane, 81, lines=20)
    wait_until(lambda: "run 81 rank 1 exited" in agent.output(), 30, "the role to end")
    assert control_plane.events_of(81) == []

    control_plane.down = False

    exited = wait_until(lambda: control_plane.events_of(81, "exited"), 30, "the exit to arrive")[0]
    assert exited["exit_code"] == 0
    assert [e["event"] for e in control_plane.events_of(81)] == ["started", "exited"]
    assert control_plane.lines_of(81, 1)[2:] == [f"line {i}" for i in range(20)] + ["bye"]
    assert agent.stop(signal.SIGTERM) == 0


def test_an_agent_restarted_on_its_state_dir_delivers_what_its_predecessor_could_not(
    sqlite_broker, control_plane, start_agent
):
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)
    control_plane.down = True
    send_launch(sqlite_broker, control_plane, 82, lines=3)
    wait_until(lambda: "run 82 rank 1 exited" in agent.output(), 30, "the role to end")
    assert agent.stop(signal.SIGTERM) == 0
    assert control_plane.events_of(82) == []

    control_plane.down = False
    again = start_agent(control_plane, sqlite_broker, join=False)

    wait_until(lambda: control_plane.events_of(82, "exited"), 30, "the predecessor's exit event")
    assert [e["event"] for e in control_plane.events_of(82)] == ["started", "exited"]
    assert again.stop(signal.SIGTERM) == 0


def test_a_launch_published_while_no_agent_consumes_runs_once_the_agent_starts(
    agent_redis_url, control_plane, start_agent
):
    send_launch(agent_redis_url, control_plane, 83, lines=1)

    agent = start_agent(control_plane, agent_redis_url)

    exited = wait_until(lambda: control_plane.events_of(83, "exited"), 60, "the waiting launch to run")[0]
    assert exited["exit_code"] == 0
    assert agent.stop(signal.SIGTERM) == 0


def test_a_launch_delivered_again_after_the_role_ended_starts_nothing_and_reports_the_exit_again(
    agent_redis_url, control_plane, start_agent
):
    agent = start_agent(control_plane, agent_redis_url)
    wait_registered(control_plane, agent)
    send_launch(agent_redis_url, control_plane, 84, lines=1)
    wait_until(lambda: control_plane.events_of(84, "exited"), 30, "the role to end")

    send_launch(agent_redis_url, control_plane, 84, lines=1)

    wait_until(lambda: len(control_plane.events_of(84, "exited")) == 2, 30, "the exit reported again")
    assert len(control_plane.events_of(84, "started")) == 1
    assert len([x for x in control_plane.lines_of(84, 1) if x.startswith("PIDS ")]) == 1
    assert agent.stop(signal.SIGTERM) == 0


def test_a_second_agent_on_a_state_dir_in_use_exits_saying_what_to_do(
    sqlite_broker, control_plane, start_agent, tmp_path
):
    first = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, first)
    send_launch(sqlite_broker, control_plane, 85, sleep=120)
    pids = wait_until(lambda: pids_from_logs(control_plane.lines_of(85, 1)), 30, "the first agent's role")

    second = start_agent(control_plane, sqlite_broker)

    assert second.proc.wait(timeout=60) == 2
    state_dir = (tmp_path / "agent-state").resolve()
    assert (f"another agent (pid {first.proc.pid}) uses {state_dir}; "
            f"give this one --state-dir DIR") in second.output()
    # It took nothing from the first: the role still runs, registered once.
    assert group_members(pids["pgid"]) and len(control_plane.registrations) == 1
    assert first.stop(signal.SIGTERM) == 0


def test_a_transient_conflict_at_registration_is_retried(sqlite_broker, control_plane, start_agent):
    control_plane.conflicts = 2

    agent = start_agent(control_plane, sqlite_broker)

    wait_registered(control_plane, agent)
    assert len(control_plane.registrations) == 1
    assert "retry" in agent.output()
    assert agent.stop(signal.SIGTERM) == 0


def test_an_idle_agent_holds_under_150_mb_and_never_loads_torch(sqlite_broker, control_plane, start_agent):
    # A speed measurement makes the hardware child import torch; the agent must not.
    agent = start_agent(control_plane, sqlite_broker, extra=["--benchmark-seconds", "0.2"])
    wait_registered(control_plane, agent)
    assert control_plane.registrations[0]["hardware"]["benchmark"]["samples_per_s"] > 0

    status = Path(f"/proc/{agent.proc.pid}/status").read_text()
    rss_kb = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))
    maps = Path(f"/proc/{agent.proc.pid}/maps").read_text()

    assert rss_kb < 150 * 1024, f"idle agent holds {rss_kb / 1024:.0f} MB"
    assert "libtorch" not in maps
    assert agent.stop(signal.SIGTERM) == 0


def test_launch_and_cancel_orders_ack_late_and_go_back_to_the_queue_when_their_worker_is_lost():
    from agents import tasks
    from agents.celery_app import REDIS_VISIBILITY_TIMEOUT_S, make_celery

    conf = make_celery("redis://127.0.0.1:6379/10").conf

    assert tasks.launch_role_task.acks_late and tasks.cancel_run_task.acks_late
    assert conf.task_reject_on_worker_lost is True
    assert conf.broker_connection_retry and conf.broker_connection_max_retries is None
    # Longer than the longest late-acked order: a launch downloading its bundle.
    assert conf.broker_transport_options["visibility_timeout"] == REDIS_VISIBILITY_TIMEOUT_S > 150 + 30
