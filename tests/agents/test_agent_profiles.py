"""Task profiles: the child-process runner, and `profile_task` reporting to a control plane."""

from __future__ import annotations

import hashlib
import json
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
from agents.profiles import host_lock, profile_argv, run_profile, stable_measurement
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


# -- trustworthy profiles: stable repeats, one at a time per host -----------------------------


def _rates(*rates: float):
    it = iter(rates)
    return lambda: {"samples_per_s": next(it), "step_s": 1.0}


def test_a_stable_profile_stops_after_the_minimum_runs():
    result = stable_measurement(_rates(100.0, 104.0, 999.0), min_repeats=2, max_repeats=4, tolerance=0.1)
    assert result["repeats"] == 2 and result["samples_per_s_runs"] == [100.0, 104.0]
    assert result["spread"] == pytest.approx(4 / 102)
    assert result["samples_per_s"] == 100.0  # the lower middle run, whole


def test_a_noisy_profile_runs_again_until_it_settles():
    result = stable_measurement(_rates(42.0, 522.0, 422.0, 425.0, 1.0), min_repeats=2, max_repeats=6,
                                tolerance=0.1)
    # The first two disagree (a neighbour took the CPU), then two runs agree: those are kept.
    assert result["repeats"] == 4 and result["samples_per_s"] == 422.0
    assert result["samples_per_s_runs"] == [42.0, 522.0, 422.0, 425.0]
    assert result["spread"] == pytest.approx(3 / 423.5)


def test_a_profile_that_never_settles_reports_its_spread_at_the_cap():
    result = stable_measurement(_rates(100.0, 200.0, 300.0, 400.0), min_repeats=2, max_repeats=3, tolerance=0.1)
    assert result["repeats"] == 3 and result["samples_per_s"] == 200.0 and result["spread"] == pytest.approx(1.0)


HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT, 0o644)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
)


def _holder(lock: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock), str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_profile_waits_while_another_agent_of_the_host_profiles(tmp_path):
    lock = tmp_path / "profile.lock"
    holder = _holder(lock, 1.0)
    try:
        with host_lock(lock, wait_s=30, poll_s=0.05) as waited:
            assert holder.poll() is not None  # the other profile had finished first
        assert waited >= 0.5
    finally:
        holder.kill()
        holder.wait()


def test_a_profile_gives_up_on_a_lock_held_past_its_wait(tmp_path):
    lock = tmp_path / "profile.lock"
    holder = _holder(lock, 30.0)
    try:
        with pytest.raises(ProfileError, match="another profile on this host held"):
            with host_lock(lock, wait_s=0.3, poll_s=0.05):
                pass
    finally:
        holder.kill()
        holder.wait()


# Prints the next rate of a list each time it runs (its state in a file beside the list).
NOISY = (
    "import json, sys, pathlib\n"
    "state = pathlib.Path(sys.argv[1]); rates = json.loads(state.read_text())\n"
    "state.write_text(json.dumps(rates[1:]))\n"
    "print(json.dumps({'samples_per_s': rates[0], 'step_s': 16 / rates[0]}))\n"
)


def test_profile_task_repeats_the_profiler_under_the_host_lock_and_reports_the_spread(
    control_plane, client, cache, tmp_path
):
    state = tmp_path / "rates.json"
    lock = tmp_path / "profile.lock"
    state.write_text(json.dumps([100.0, 150.0, 60.0, 102.0]))  # never two alike in a row
    body = _run(11, _order(task="hybridtrain.tasks.digits:smallcnn"), client, cache, tmp_path,
                command=[sys.executable, "-c", NOISY, str(state)], lock_path=lock,
                min_repeats=2, max_repeats=3, stable_spread=0.1)
    assert body["status"] == "done"
    assert body["result"]["samples_per_s_runs"] == [100.0, 150.0, 60.0]
    assert body["result"]["repeats"] == 3 and body["result"]["samples_per_s"] == 100.0
    assert body["result"]["spread"] == pytest.approx(90 / 100)
    assert control_plane.profiles == [(11, body)]
    assert lock.exists()
