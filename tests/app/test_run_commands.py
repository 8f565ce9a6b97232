"""`hybridtrain runs create`: the command line becomes the body of POST /api/v1/runs."""

from __future__ import annotations

import argparse

import pytest

from app.run_commands import _run_body, register


def _body(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return _run_body(parser.parse_args(["runs", "create", "--name", "r", "--nodes", "1,2", *argv]))


def test_only_the_options_given_reach_the_request():
    assert _body("--target-accuracy", "0.9") == {"name": "r", "node_ids": [1, 2], "target_accuracy": 0.9}


@pytest.mark.parametrize(("flag", "stop"), [("--stop-at-target", True), ("--no-stop-at-target", False)])
def test_stopping_at_the_target_is_asked_for_either_way(flag, stop):
    assert _body("--target-accuracy", "0.9", flag)["stop_at_target"] is stop
