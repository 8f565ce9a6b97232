"""`hybridtrain runs create`: the command line becomes the body of POST /api/v1/runs, and a bad
flag is one line on stderr with exit status 2 before anything is packed or sent."""

from __future__ import annotations

import argparse

import pytest

from app.cli import main
from app.cli.run_commands import EXIT_USAGE, register
from app.cli.run_flags import run_body

# Nothing listens here: a test that got past the local checks would fail with exit 4, not 2.
NOWHERE = ["--server", "http://127.0.0.1:9", "--token", "t"]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["runs", "create", "--name", "r", "--nodes", "1,2", *argv])


def _body(*argv: str) -> dict:
    return run_body(_args(*argv))


def _refused(capsys, *argv: str) -> str:
    code = main(["runs", "create", "--name", "r", "--nodes", "1", *NOWHERE, *argv])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert err.count("\n") == 1, err
    return err


def test_only_the_options_given_reach_the_request():
    assert _body("--target", "accuracy>=0.9") == {"name": "r", "node_ids": [1, 2], "target": "accuracy>=0.9"}


@pytest.mark.parametrize(("flag", "stop"), [("--stop-at-target", True), ("--no-stop-at-target", False)])
def test_stopping_at_the_target_is_asked_for_either_way(flag, stop):
    assert _body("--target", "accuracy>=0.9", flag)["stop_at_target"] is stop


def test_epochs_reach_the_request_whole():
    assert _body("--epochs", "3")["epochs"] == 3 and isinstance(_body("--epochs", "3")["epochs"], int)


def test_a_task_and_its_arguments_reach_the_request():
    body = _body("--task", "hybridtrain.tasks.shapes:resnet18", "--task-args", '{"lr": 0.05, "schedule": "constant"}')
    assert (body["task"], body["task_args"]) == ("hybridtrain.tasks.shapes:resnet18", {"lr": 0.05, "schedule": "constant"})


def test_a_target_is_sent_in_its_normal_form():
    assert _body("--target", " val_loss <= 0.30")["target"] == "val_loss<=0.3"


def test_epochs_reach_the_request():
    assert _body("--epochs", "3")["epochs"] == 3


def test_an_earlier_bundle_is_named_by_its_sha256():
    sha = "AB" * 32
    assert _body("--bundle", sha, "--script", "train.py")["bundle_sha256"] == sha.lower()


def test_script_arguments_after_the_double_dash_reach_the_request():
    body = _body("--bundle", "a" * 64, "--script", "train.py", "--", "--epochs", "3", "--lr", "0.1")
    assert (body["script"], body["script_args"]) == ("train.py", ["--epochs", "3", "--lr", "0.1"])


# (`--dataset` came back with another meaning: a registered data set the run reads.)
@pytest.mark.parametrize("flag", ["--model", "--lr", "--target-accuracy"])
def test_the_flags_that_became_task_args_are_gone(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["runs", "create", "--name", "r", "--nodes", "1", flag, "1"])
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_task_args_that_are_not_json_are_refused(capsys):
    assert "--task-args: not JSON" in _refused(capsys, "--task-args", "{lr: 0.05}")


def test_task_args_with_nan_are_refused(capsys):
    assert "--task-args: NaN is not a JSON number" in _refused(capsys, "--task-args", '{"lr": NaN}')


def test_task_args_that_are_not_an_object_are_refused(capsys):
    assert "--task-args: expected a JSON object" in _refused(capsys, "--task-args", "[0.05]")


def test_a_target_without_a_comparison_is_refused(capsys):
    assert "--target: target 'accuracy=0.9': expected METRIC>=VALUE" in _refused(capsys, "--target", "accuracy=0.9")


def test_a_target_on_a_system_metric_is_refused(capsys):
    assert "loss is not an evaluation metric" in _refused(capsys, "--target", "loss<=0.1")


def test_a_task_that_is_not_module_colon_function_is_refused(capsys):
    assert "--task: task 'digits.smallcnn': expected module:function" in _refused(capsys, "--task", "digits.smallcnn")


def test_a_bundle_that_is_not_a_sha256_is_refused(capsys):
    assert "--bundle: expected the 64 hex digits" in _refused(capsys, "--bundle", "abc123")


def test_a_script_missing_from_the_work_dir_is_refused(tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    err = _refused(capsys, "--workdir", str(tmp_path), "--script", "trian.py")
    assert f"--script trian.py: does not exist in the work dir {tmp_path}" in err


def test_a_script_the_ignore_file_leaves_out_is_refused(tmp_path, capsys):
    (tmp_path / ".hybridtrainignore").write_text("*.py\n")
    (tmp_path / "train.py").write_text("")
    assert "--script train.py: is ignored by its ignore file" in _refused(capsys, "--workdir", str(tmp_path), "--script", "train.py")


def test_a_script_outside_the_work_dir_is_refused(tmp_path, capsys):
    assert "without '..'" in _refused(capsys, "--workdir", str(tmp_path), "--script", "../train.py")


def test_a_script_needs_code_to_be_in(capsys):
    assert "--script needs --workdir (or --bundle)" in _refused(capsys, "--script", "train.py")


def test_script_arguments_need_a_script(capsys):
    assert "need --script" in _refused(capsys, "--", "--epochs", "3")


def test_a_task_and_a_script_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["runs", "create", "--name", "r", "--nodes", "1", "--task", "a:b", "--script", "t.py"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_work_dir_over_the_limit_is_refused_before_any_upload(tmp_path, capsys):
    (tmp_path / "data.bin").write_bytes(b"0" * 300_000)
    err = _refused(capsys, "--workdir", str(tmp_path), "--max-bundle-mb", "0.1")
    assert "--workdir: work dir" in err and "biggest files: data.bin" in err


def test_an_unreachable_control_plane_exits_4_after_packing(tmp_path, capsys):
    (tmp_path / "train.py").write_text("")
    code = main(["runs", "create", "--name", "r", "--nodes", "1", *NOWHERE, "--workdir", str(tmp_path)])
    assert code == 4
    assert "cannot reach the control plane" in capsys.readouterr().err
