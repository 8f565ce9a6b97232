"""Rank 0's agent takes its port free on the node at launch (agents.spec.free_port)."""

from __future__ import annotations

import socket

from agent_testing import publish, role_spec, wait_registered, wait_until

from agents.celery_app import LAUNCH_ROLE
from agents.spec import free_port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    s.listen()
    return s


def test_a_free_suggested_port_is_kept():
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    assert free_port(port) == port


def test_a_taken_suggested_port_is_replaced_by_one_that_binds():
    with _listener() as busy:
        taken = busy.getsockname()[1]
        chosen = free_port(taken)
        assert chosen != taken and _bindable(chosen)


def test_two_picks_back_to_back_while_the_first_listens_differ():
    with _listener() as first:
        port = first.getsockname()[1]
        # The second run's suggestion collides with the first's live listener.
        second = free_port(port)
        assert second != port and _bindable(second)


def test_the_agent_launches_rank_0_on_a_free_port_and_names_it_when_it_starts(
    sqlite_broker, control_plane, start_agent
):
    agent = start_agent(control_plane, sqlite_broker)
    wait_registered(control_plane, agent)
    with _listener() as busy:
        taken = busy.getsockname()[1]
        spec = role_spec(41, rank=0) | {"master_port": taken, "pick_port": True}
        publish(sqlite_broker, control_plane, LAUNCH_ROLE, [41, 0, spec])

        started = wait_until(lambda: control_plane.events_of(41, "started"), 30, "rank 0's start")[0]

        assert started["port"] != taken and _bindable(started["port"])
    agent.stop()
