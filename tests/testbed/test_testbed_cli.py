"""`hybridtrain bench paper`'s workload flags: a task, its JSON args and a target."""

from __future__ import annotations

import argparse

import pytest

from testbed.cli import register


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybridtrain")
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "paper", *argv])


def test_target_accuracy_is_an_alias_of_an_accuracy_target() -> None:
    assert _parse("--target-accuracy", "0.9").target == "accuracy>=0.9"


def test_a_target_is_kept_as_written_without_blanks() -> None:
    assert _parse("--target", "val_loss <= 0.3").target == "val_loss<=0.3"


def test_seeds_are_a_count_of_runs_per_strategy() -> None:
    assert _parse("--seeds", "2").seeds == 2 and _parse().seeds is None


def test_task_args_are_parsed_as_a_json_object() -> None:
    args = _parse("--task", "hybridtrain.tasks.shapes:resnet18", "--task-args", '{"lr": 0.05}')
    assert args.task == "hybridtrain.tasks.shapes:resnet18" and args.task_args == {"lr": 0.05}


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [("--task-args", "[1]", "JSON object"), ("--task-args", "{lr", "not JSON"),
     ("--task", "widecnn", "module:function"), ("--target", "accuracy>0.9", "METRIC>=VALUE"),
     ("--seeds", "0", "from 1 to 20"), ("--seeds", "three", "from 1 to 20")],
)  # fmt: skip
def test_a_bad_workload_flag_is_one_line_naming_the_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(flag, value)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}" in error and says in error


def test_a_bandwidth_sweep_is_a_list_of_mbit_per_second() -> None:
    assert _parse("--wan-mbit", "10,100,1000").wan_mbit == (10.0, 100.0, 1000.0)
    assert _parse("--wan-mbit", "2.5").wan_mbit == (2.5,) and _parse().wan_mbit is None


@pytest.mark.parametrize(("value", "says"), [("0", "above 0"), ("10,-5", "'-5' is not a bandwidth"),
                                             ("ten", "above 0"), ("1e9", "above 0"), ("inf", "above 0"),
                                             ("10,10.0", "twice")])  # fmt: skip
def test_a_bandwidth_that_is_not_a_positive_number_is_refused_naming_it(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse("--wan-mbit", value)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --wan-mbit" in error and says in error
