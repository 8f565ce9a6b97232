"""A parameter-server run's ranks get one link secret per attempt in their launch orders (their
TLS key, trainer.linktls); the API never shows it; all-reduce runs and runs that opt out get
none. Over the real API on the real Postgres, with orders read back from the real Redis."""

from __future__ import annotations

import pytest
from runs_testing import API, cancel_created_runs_fixture, dispatched_fixture, online_node_fixture, post_run, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE
from app.run_secrets import run_link_secret, run_metrics_token


def _create(client, nodes, **fields):
    server = {"ps_node_id": nodes[0].id} if fields["strategy"].startswith("ps") else {}
    return post_run(client, run_body(nodes, **server, **fields))


def _launches(dispatched, nodes, rid):
    """{rank: spec} of the launch orders for run `rid` waiting on the nodes' queues (taken)."""
    return {args[1]: args[2] for node in nodes for task, args in dispatched.take(node.id)
            if task == LAUNCH_ROLE and args[0] == rid}


def _all_ranks(client, dispatched, nodes, **fields):
    """The run created and its rank 0 started: every rank's launch spec, and the run."""
    run = _create(client, nodes, **fields)
    sent = _launches(dispatched, nodes, run["id"])
    nodes[0].event(run["id"], rank=0, role="ps", event="started", pid=1, port=41000)
    return sent | _launches(dispatched, nodes, run["id"]), client.get(f"{API}/runs/{run['id']}").json()


def test_every_rank_of_a_ps_run_gets_the_same_link_secret_by_default(online_node, client, dispatched):
    a, b = online_node(), online_node()
    sent, run = _all_ranks(client, dispatched, [a, b], strategy="ps-bz-gc")

    assert sorted(sent) == [0, 1, 2]
    secrets = {spec["link_secret"] for spec in sent.values()}
    assert len(secrets) == 1 and len(secrets.pop()) >= 40
    assert run["encrypt_links"] is True
    assert "link_secret" not in str(run)


def test_a_link_secret_is_the_runs_own_and_not_its_metrics_token():
    assert run_link_secret("k", run_id=1, attempt=0) != run_link_secret("k", run_id=2, attempt=0)
    assert run_link_secret("k", run_id=1, attempt=0) != run_link_secret("k", run_id=1, attempt=1)
    assert run_link_secret("k", run_id=1, attempt=0) not in run_metrics_token("k", run_id=1, attempt=0, rank=0)


def test_an_allreduce_run_gets_no_link_secret(online_node, client, dispatched):
    a, b = online_node(), online_node()
    run = _create(client, [a, b], strategy="allreduce")

    sent = _launches(dispatched, [a, b], run["id"])

    assert sent and not any("link_secret" in spec for spec in sent.values())


def test_a_run_that_opts_out_gets_no_link_secret(online_node, client, dispatched):
    a, b = online_node(), online_node()
    sent, run = _all_ranks(client, dispatched, [a, b], strategy="ps", encrypt_links=False)

    assert sorted(sent) == [0, 1, 2] and not any("link_secret" in spec for spec in sent.values())
    assert run["encrypt_links"] is False


def test_plain_links_on_the_command_line_reach_the_request_and_are_left_out_otherwise():
    import argparse

    from app.cli.run_commands import register
    from app.cli import run_flags

    def body(*argv: str) -> dict:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers(dest="command"))
        return run_flags.run_body(parser.parse_args(["runs", "create", "--name", "r", "--nodes", "1", *argv]))

    assert body("--plain-links")["encrypt_links"] is False
    assert "encrypt_links" not in body()
