"""The CLI and a run's life: the recovery flags of `runs create`, the states `--wait` notes
(degraded, restarting n/max) and `runs show`, against the real control plane in process."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from runs_testing import run_body, dispatched_fixture, online_node_fixture, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.cli import run_flags
from app.cli.client import HybridtrainClient
from app.cli.run_commands import register
from app.cli.run_progress import describe_run
from hybridtrain.progress import status_text
from tests.app.conftest import ADMIN_TOKEN


@pytest.fixture
def api(make_client: Callable[[str | None], TestClient]) -> Iterator[HybridtrainClient]:
    with HybridtrainClient("http://testserver", ADMIN_TOKEN, transport=make_client(None)._transport) as client:
        yield client


def _body(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return run_flags.run_body(parser.parse_args(["runs", "create", "--name", "r", "--nodes", "1", *argv]))


def test_the_recovery_flags_reach_the_request():
    body = _body("--checkpoint-every", "100", "--checkpoint-every-s", "600", "--max-restarts", "3",
                 "--min-workers", "2", "--min-workers-wait-s", "300")
    assert {k: body[k] for k in ("checkpoint_every", "checkpoint_every_s", "max_restarts", "min_workers",
                                 "min_workers_wait_s")} == {
        "checkpoint_every": 100, "checkpoint_every_s": 600.0, "max_restarts": 3, "min_workers": 2,
        "min_workers_wait_s": 300.0}


def test_recovery_flags_left_out_leave_the_servers_defaults():
    assert "checkpoint_every" not in _body() and "max_restarts" not in _body()


def test_a_degraded_and_a_restarting_run_say_so(api, online_node, dispatched):
    a, b = online_node(), online_node()
    run = api.create_run(run_body([a, b], strategy="ps", ps_node_id=a.id, max_restarts=2))
    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(run["id"], rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=rank + 1)

    b.event(run["id"], rank=2, role="worker", event="exited", exit_code=1, pid=3)
    degraded = api.get_run(run["id"])
    a.event(run["id"], rank=0, role="ps", event="exited", signal=9, pid=1)
    restarting = api.get_run(run["id"])

    assert status_text(degraded) == "degraded (1 worker out)"
    assert status_text(restarting) == "restarting 1/2"
    shown = describe_run(restarting)
    assert shown.splitlines()[0] == f"run {run['id']} {run['name']}: restarting 1/2"
    assert "checkpoint: none yet" in shown and "rank   2 worker" in shown


def test_a_run_that_restarted_and_runs_again_shows_its_restarts():
    run = {"status": "running", "restarts": 1, "max_restarts": 3, "workers": []}
    assert status_text(run) == "running, restarted 1/3"


def test_each_restart_is_counted_in_the_state_shown(api, online_node, dispatched):
    a = online_node()
    run = api.create_run(run_body([a], strategy="allreduce", max_restarts=3))
    a.event(run["id"], rank=0, role="worker", event="started", pid=1)
    a.event(run["id"], rank=0, role="worker", event="exited", exit_code=1, pid=1)
    first = api.get_run(run["id"])
    # The relaunched rank is killed before it could report its start (no pid: not the old process).
    a.event(run["id"], rank=0, role="worker", event="exited", signal=9, pid=None)
    second = api.get_run(run["id"])

    assert (status_text(first), status_text(second)) == ("restarting 1/3", "restarting 2/3")


def test_a_config_file_gives_every_request_field_and_the_flags_given_win(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("strategy: ps-bz-gc\nglobal_batch_size: 240\nrebalance_every: 5\n"
                      "compression: {pipeline_chunks: 4, density: 0.05, server_k_fraction: 0.125, warmup_steps: 1}\n")
    body = _body("--config", str(config), "--global-batch", "128", "--density", "0.02", "--sync-every", "10")
    assert body["global_batch_size"] == 128 and body["rebalance_every"] == 5 and body["strategy"] == "ps-bz-gc"
    assert body["compression"] == {"pipeline_chunks": 4, "density": 0.02, "server_k_fraction": 0.125,
                                   "warmup_steps": 1}
    assert body["local_sgd"] == {"sync_every": 10}
    assert body["node_ids"] == [1] and body["name"] == "r"


def test_site_replicas_reach_the_requests_local_sgd_section():
    body = _body("--strategy", "diloco", "--sync-every", "10", "--site-replicas")
    assert body["local_sgd"] == {"sync_every": 10, "site_replicas": True}
    assert "local_sgd" not in _body("--strategy", "diloco")


def test_asynchronous_outer_steps_reach_the_requests_local_sgd_section():
    body = _body("--strategy", "diloco", "--async-outer", "--max-staleness", "4")
    assert body["local_sgd"] == {"asynchronous": True, "max_staleness": 4}


def test_streaming_fragments_reach_the_requests_local_sgd_section():
    body = _body("--strategy", "diloco", "--sync-every", "12", "--fragments", "4")
    assert body["local_sgd"] == {"sync_every": 12, "fragments": 4}


@pytest.mark.parametrize("text, says", [("- a\n- b\n", "a mapping"), ("compression: 4\n", "compression must"),
                                        ("{: nope", "not YAML")])
def test_a_config_file_that_is_not_a_mapping_of_fields_is_a_usage_error(tmp_path, text, says):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(run_flags.UsageError, match=says):
        _body("--config", str(config))


def test_a_missing_config_file_is_a_usage_error_naming_it(tmp_path):
    with pytest.raises(run_flags.UsageError, match="--config .*missing.yaml"):
        _body("--config", str(tmp_path / "missing.yaml"))
