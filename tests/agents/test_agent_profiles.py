"""Task profiles: the child-process runner, and `profile_task` reporting to a control plane."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_testing import ROOT, FakeControlPlane, make_bundle, sha256_of

from agents.bundles import BundleCache
from agents.client import ControlPlaneClient
from agents.errors import ProfileError
from agents.profiles import profile_argv, run_profile
from agents.spec import ProfileSpec
from agents.tasks import profile_task

AGENT_TOKEN = "hta_test-agent-token"
# A stand-in for `python -m trainer.profile`: echoes what it was given as the one JSON line.
STANDIN = (
    "import json, os, sys; print('warming up'); "
    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
    "'safe_path': os.environ.get('PYTHONSAFEPATH'), 'omp': os.environ.get('OMP_NUM_THREADS'), "
    "'token': os.environ.get('HYBRIDTRAIN_AGENT_TOKEN'), 'samples_per_s': 123.5}))"
)
STANDIN_COMMAND = [sys.executable, "-c", STANDIN]


@pytest.fixture
def client(control_plane: FakeControlPlane) -> Iterator[ControlPlaneClient]:
    # The plane accepts the agent token as if this agent had registered.
    control_plane.agent_token_hash = hashlib.sha256(AGENT_TOKEN.encode()).hexdigest()
    http = ControlPlaneClient(control_plane.url, agent_token=AGENT_TOKEN, timeout_s=5)
    yield http
    http.close()


@pytest.fixture
def cache(tmp_path: Path, client: ControlPlaneClient) -> BundleCache:
    return BundleCache(tmp_path / "state", client, retry_s=0)


def _order(**fields: Any) -> dict[str, Any]:
    return {"task": "usertask:task", "task_args": {"lr": 0.5}, "batch_size": 16, "device": "cpu", **fields}


def _run(profile_id: int, spec: dict[str, Any], client, cache, tmp_path, **kw: Any) -> dict[str, Any]:
    kw.setdefault("command", STANDIN_COMMAND)
    return profile_task(profile_id, spec, client=client, cache=cache, state_dir=tmp_path / "state",
                        report_retry_s=0, **kw)


def test_profile_argv_carries_task_args_as_json():
    spec = ProfileSpec.model_validate(_order())
    assert profile_argv(spec, ["p"]) == [
        "p", "--task", "usertask:task", "--task-args", '{"lr":0.5}', "--batch", "16", "--device", "cpu",
    ]


def test_run_profile_returns_the_json_line_the_child_printed(tmp_path):
    result = run_profile([*STANDIN_COMMAND, "--batch", "8"], cwd=tmp_path, code_dir=tmp_path)

    assert result["samples_per_s"] == 123.5 and result["argv"] == ["--batch", "8", "--code-dir", str(tmp_path)]
    assert result["cwd"] == str(tmp_path)
    # The working directory is not searched before the profiler's own packages.
    assert result["safe_path"] == "1"


def test_run_profile_computes_with_the_threads_the_roles_get(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_profile(STANDIN_COMMAND, cwd=tmp_path, threads=1)["omp"] == "1"


def test_run_profile_keeps_the_agents_credentials_from_the_users_code(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTRAIN_AGENT_TOKEN", AGENT_TOKEN)
    assert run_profile(STANDIN_COMMAND, cwd=tmp_path)["token"] is None


def test_profile_task_passes_the_agents_role_threads_to_the_profiler(control_plane, client, cache, tmp_path):
    body = _run(9, _order(task="hybridtrain.tasks.digits:smallcnn"), client, cache, tmp_path, threads=3)
    assert body["status"] == "done" and body["result"]["omp"] == "3"


def test_run_profile_failure_carries_the_childs_last_stderr_lines(tmp_path):
    failing = [sys.executable, "-c", "import sys; print('task usertask:task: no module named usertask', file=sys.stderr); sys.exit(1)"]

    with pytest.raises(ProfileError, match="exited with code 1: task usertask:task: no module named usertask"):
        run_profile(failing, cwd=tmp_path)


def test_run_profile_refuses_output_without_a_json_object(tmp_path):
    with pytest.raises(ProfileError, match="printed no JSON result"):
        run_profile([sys.executable, "-c", "print('[1, 2]'); print('done')"], cwd=tmp_path)


def test_run_profile_kills_a_child_that_runs_past_the_timeout(tmp_path):
    sleeper = [sys.executable, "-c", "import sys, time; print('stuck', file=sys.stderr, flush=True); time.sleep(60)"]

    with pytest.raises(ProfileError, match=r"did not finish within 0.5 s: stuck"):
        run_profile(sleeper, cwd=tmp_path, timeout_s=0.5)


def test_profile_task_fetches_the_bundle_with_the_agent_token_and_reports_the_result(
    control_plane, client, cache, tmp_path
):
    data = make_bundle({"usertask.py": "def task(): pass\n"})
    path = "/api/v1/agent/profiles/5/bundle"
    control_plane.files[path] = (AGENT_TOKEN, data)

    body = _run(5, _order(bundle={"sha256": sha256_of(data), "path": path}), client, cache, tmp_path)

    assert body["status"] == "done"
    result = body["result"]
    code = tmp_path / "state" / "profiles" / "5" / "code"
    assert result["cwd"] == str(code) and result["argv"][-2:] == ["--code-dir", str(code)]
    assert result["argv"][result["argv"].index("--task-args") + 1] == '{"lr":0.5}'
    assert control_plane.profiles == [(5, body)]
    # The unpacked copy goes once measured; the archive stays cached for the next profile.
    assert not code.parent.exists() and cache.path_of(sha256_of(data)).exists()


def test_profile_task_without_a_bundle_runs_in_an_empty_directory(control_plane, client, cache, tmp_path):
    body = _run(6, _order(task="hybridtrain.tasks.digits:smallcnn"), client, cache, tmp_path)

    assert body["status"] == "done"
    assert body["result"]["cwd"] == str(tmp_path / "state" / "profiles" / "6" / "code")
    assert control_plane.profiles == [(6, body)]


def test_profile_task_reports_a_failed_profiler_with_its_stderr(control_plane, client, cache, tmp_path):
    failing = [sys.executable, "-c", "import sys; sys.exit('TaskError: task() returned a list, not a Task')"]

    body = _run(7, _order(), client, cache, tmp_path, command=failing)

    assert body == {"status": "failed", "error": "the profiler exited with code 1: TaskError: task() returned a list, not a Task"}
    assert control_plane.profiles == [(7, body)]


def test_profile_task_reports_a_bundle_it_cannot_fetch(control_plane, client, cache, tmp_path):
    spec = _order(bundle={"sha256": "3f2a" + "0" * 60, "path": "/api/v1/agent/profiles/8/bundle"})

    body = _run(8, spec, client, cache, tmp_path)

    assert body == {"status": "failed", "error": "bundle 3f2a00000000\u2026: HTTP 404 from the control plane"}
    assert control_plane.profiles == [(8, body)]


def test_profile_task_reports_an_invalid_order_naming_the_field(control_plane, client, cache, tmp_path):
    body = _run(9, _order(device="tpu"), client, cache, tmp_path)

    assert body["status"] == "failed" and body["error"].startswith("invalid profile order: device:")
    assert control_plane.profiles == [(9, body)]


def test_importing_the_agents_tasks_does_not_import_torch():
    code = "import sys, agents.agent, agents.tasks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_real_trainer_profile_measures_the_builtin_smallcnn(tmp_path):
    argv = [sys.executable, "-m", "trainer.profile", "--task", "hybridtrain.tasks.digits:smallcnn",
            "--batch", "8", "--device", "cpu", "--seconds", "0.5"]

    result = run_profile(argv, cwd=ROOT, timeout_s=240)

    assert result["params"] > 0 and result["batch"] == 8 and result["samples_per_s"] > 0
    assert result["metrics"]["accuracy"] is True


def test_profile_task_reports_a_failure_when_the_control_plane_refuses_the_measurement(
    control_plane, client, cache, tmp_path
):
    odd = [sys.executable, "-c", "print('{\"speed\": 1}')"]

    body = _run(10, _order(), client, cache, tmp_path, command=odd)

    assert body["status"] == "failed"
    assert body["error"].startswith("the control plane refused the measurement: control plane rejected /profiles/10: 422")
    assert control_plane.profiles == [(10, body)]


def test_profile_task_with_the_real_profiler_reports_a_measurement_the_control_plane_takes(
    control_plane, client, cache, tmp_path
):
    spec = {"task": "hybridtrain.tasks.digits:smallcnn", "task_args": {}, "bundle": None,
            "batch_size": 8, "device": "cpu"}

    body = profile_task(11, spec, client=client, cache=cache, state_dir=tmp_path / "state",
                        timeout_s=240, report_retry_s=0)

    assert body["status"] == "done", body
    assert body["result"]["batch"] == 8 and body["result"]["params"] > 0
    assert control_plane.profiles == [(11, body)]
