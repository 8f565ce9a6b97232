"""`hybridtrain profiles list|request`, and plans that wait for their nodes' profiles
(`runs create --plan-only`, `plans optimize`), against a served control plane on Postgres
with its orders on Redis; the agent's report goes through the agent API between two polls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from predictions_testing import RESULT, TASK, add_profile
from runs_testing import API, dispatched_fixture, online_node_fixture, runs_redis_url_fixture  # noqa: F401 (fixtures)
from test_client_cli import _cli, server  # noqa: F401 (fixture)

from app.cli import profile_commands
from app.cli.run_commands import EXIT_TIMEOUT
from hybridtrain.contract import PROFILE_TASK


@pytest.fixture
def agents_report(monkeypatch, client):
    """Between two polls of the CLI, the agents of `nodes` report their pending profiles (each
    with `result`, or failed with `error`); returns the list of nodes to fill in."""
    nodes: list[Any] = []
    outcome: dict[str, Any] = {"result": RESULT | {"spread": 0.05, "repeats": 3}}
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        for node in nodes:
            pending = [p for p in client.get(f"{API}/tasks/profiles", params={"node_id": node.id}).json()["data"]
                       if p["status"] == "pending"]
            for p in pending:
                body = ({"status": "failed", "error": outcome["error"]} if "error" in outcome
                        else {"status": "done", "result": outcome["result"]})
                assert node.agent.post(f"{API}/agent/profiles/{p['id']}", json=body).status_code == 200

    monkeypatch.setattr(profile_commands, "_pause", pause)
    return nodes, outcome, pauses


def test_plan_only_profiles_the_task_waits_and_prints_the_numbers_with_their_age_and_noise(
    server, online_node, session, dispatched, agents_report, capsys
):
    profiled, bare = online_node(), online_node()
    add_profile(session, profiled.id)
    agents_report[0].append(bare)
    code, out, err = _cli(capsys, "runs", "create", "--name", "p", "--nodes", f"{profiled.id},{bare.id}", *server,
                          "--task", TASK, "--plan-only", "--all-strategies")
    assert code == 0, err
    assert f"profiling the task on 1 node(s): {bare.name} (id {bare.id})" in err and "profiled in" in err
    assert [task for task, _ in dispatched.take(bare.id)] == [PROFILE_TASK]
    lines = out.splitlines()
    assert lines[0].startswith("| strategy | samples/s |") and "n/a" not in lines[2].split("|")[2]
    assert f"profile of {bare.name} (id {bare.id}): 500.0 samples/s ±2.5 % (spread 5.0 % over 3 runs), measured" in out
    assert f"profile of {profiled.name} (id {profiled.id}): 500.0 samples/s noise unknown (one run)" in out


def test_plan_only_stops_waiting_at_its_bound_and_says_so(server, online_node, dispatched, capsys):
    node = online_node()
    code, out, err = _cli(capsys, "runs", "create", "--name", "p", "--nodes", str(node.id), *server,
                          "--task", TASK, "--plan-only", "--all-strategies", "--profile-wait", "0")
    assert code == EXIT_TIMEOUT
    assert "still profiling after 0 s" in err
    assert "every strategy: no finished profile of" in out


def test_plan_only_with_no_profile_orders_nothing(server, online_node, client, dispatched, capsys):
    node = online_node()
    code, _, err = _cli(capsys, "runs", "create", "--name", "p", "--nodes", str(node.id), *server,
                        "--task", TASK, "--plan-only", "--no-profile")
    assert code == 0, err
    assert client.get(f"{API}/tasks/profiles", params={"node_id": node.id}).json()["count"] == 0


def test_a_script_plan_says_once_why_it_has_no_numbers(server, online_node, dispatched, tmp_path, capsys):
    node = online_node()
    (tmp_path / "train.py").write_text("print('hi')\n")
    code, out, err = _cli(capsys, "runs", "create", "--name", "p", "--nodes", str(node.id), *server,
                          "--workdir", str(tmp_path), "--script", "train.py", "--plan-only", "--all-strategies")
    assert code == 0, err
    reasons = [line for line in out.splitlines() if "no measured step of script" in line]
    assert reasons == [reasons[0]] and reasons[0].startswith("every strategy: no measured step of script train.py")
    assert f"--nodes {node.id} --workdir . --script train.py --max-steps 30`" in reasons[0]
    assert "profiling" not in err and dispatched.take(node.id) == []


def test_plans_optimize_waits_for_the_profiles_then_explains_its_choice(
    server, online_node, session, dispatched, agents_report, capsys
):
    a, b = online_node(), online_node()
    add_profile(session, a.id)
    agents_report[0].append(b)
    code, out, err = _cli(capsys, "plans", "optimize", "--nodes", f"{a.id},{b.id}", *server, "--task", TASK,
                          "--global-batch", "64")
    assert code == 0, err
    assert f"profiling the task on 1 node(s): {b.name} (id {b.id})" in err
    assert any(line.startswith("nodes: ") for line in out.splitlines()) and "inputs:" in out


def test_plans_optimize_reports_a_failed_profile_and_fails(server, online_node, dispatched, agents_report, capsys):
    node = online_node()
    agents_report[0].append(node)
    agents_report[1]["error"] = "TaskError: no module named mytask"
    code, _, err = _cli(capsys, "plans", "optimize", "--nodes", str(node.id), *server, "--task", TASK)
    assert code != 0
    assert f"the profile of node {node.name} (id {node.id}) failed: TaskError: no module named mytask" in err


def test_profiles_request_waits_and_prints_each_profile(server, online_node, dispatched, agents_report, capsys):
    a, b = online_node(), online_node()
    agents_report[0].extend([a, b])
    code, out, err = _cli(capsys, "profiles", "request", "--nodes", f"{a.id},{b.id}", "--task", TASK, *server,
                          "--wait")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(" done " in line and "500.0 samples/s ±2.5 %" in line for line in lines)
    assert {task for node in (a, b) for task, _ in dispatched.take(node.id)} == {PROFILE_TASK}


def test_profiles_list_filters_by_node_name_and_task(server, online_node, session, capsys):
    a, b = online_node(), online_node()
    add_profile(session, a.id)
    add_profile(session, b.id, samples_per_s=12.5)
    add_profile(session, b.id, task="hybridtrain.tasks.digits:smallcnn")
    code, out, err = _cli(capsys, "profiles", "list", "--node", b.name, "--task", TASK, *server)
    assert code == 0, err
    [line] = out.splitlines()
    assert f"node {b.id}" in line and TASK in line and "12.5 samples/s noise unknown (one run)" in line
    code, out, _ = _cli(capsys, "profiles", "list", "--node", str(a.id), "--json", *server)
    assert code == 0 and [p["node_id"] for p in json.loads(out)["data"]] == [a.id]


def test_profiles_list_refuses_task_args_without_a_task(server, capsys):
    code, _, err = _cli(capsys, "profiles", "list", "--task-args", "{}", *server)
    assert code == 2 and "give --task too" in err


def test_profiles_request_and_plans_optimize_pack_a_work_dir_as_runs_create_does(
    server, online_node, dispatched, agents_report, tmp_path, capsys
):
    node = online_node()
    agents_report[0].append(node)
    (tmp_path / "mytask.py").write_text("def task(): ...\n")
    code, out, err = _cli(capsys, "profiles", "request", "--nodes", str(node.id), "--workdir", str(tmp_path),
                          "--task", "mytask:task", *server, "--wait", "--json")
    assert code == 0, err
    [profile] = json.loads(out)
    assert "packed 1 files" in err and profile["bundle_sha256"] and profile["status"] == "done"
    code, out, err = _cli(capsys, "plans", "optimize", "--nodes", str(node.id), "--workdir", str(tmp_path),
                          "--task", "mytask:task", "--global-batch", "64", *server)
    assert code == 0, err
    assert "(already on the server)" in err and "profiling" not in err and "inputs:" in out
