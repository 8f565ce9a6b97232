"""The queue on the command line: `runs create --priority/--share-gpus`, and a queued run's
place shown where the CLI describes a run."""

from __future__ import annotations

import argparse

from app.cli.run_commands import _describe, register
from app.cli.run_flags import run_body


def _body(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return run_body(parser.parse_args(["runs", "create", "--name", "r", "--nodes", "1", *argv]))


def test_the_queue_flags_reach_the_request():
    body = _body("--priority", "5", "--share-gpus")
    assert (body["priority"], body["share_gpus"]) == (5, True)


def test_queue_flags_left_out_leave_the_servers_defaults():
    assert "priority" not in _body() and "share_gpus" not in _body()


def test_a_queued_run_is_described_with_its_place_and_why_it_waits():
    run = {"id": 7, "status": "queued", "reason": None, "workers": [{"rank": 0, "status": "planned"}],
           "queue_position": 2, "waiting_for": ["node a GPU 0 is held by run 5"]}
    assert "(number 2 in the queue: node a GPU 0 is held by run 5)" in _describe(run)
