"""Launch and profile orders: validation of the bundle and script fields, and the argv built."""

from __future__ import annotations

import json

import pytest
from agent_testing import role_spec
from pydantic import ValidationError

from agents.spec import MAX_SCRIPT_ARGS, ProfileSpec, RoleSpec, trainer_argv
from hybridtrain.contract import RESERVED_FLAGS

SHA = "3f2a" + "0" * 60


def _spec(**fields) -> RoleSpec:
    return RoleSpec.model_validate({**role_spec(5, 1), **fields})


def test_role_spec_accepts_a_bundle_and_script_args():
    spec = _spec(bundle={"sha256": SHA, "path": "/api/v1/runs/5/bundle"}, script_args=["--epochs", "3"])
    assert spec.bundle is not None and spec.bundle.sha256 == SHA
    assert spec.bundle.short == "3f2a00000000\u2026"
    assert spec.script_args == ["--epochs", "3"]


def test_role_spec_without_the_new_fields_has_no_bundle_and_no_script_args():
    spec = _spec()
    assert spec.bundle is None and spec.script_args == []


@pytest.mark.parametrize("sha", ["3F2A" + "0" * 60, "abc", "g" * 64, "0" * 65])
def test_role_spec_rejects_a_bundle_sha256_that_is_not_64_lowercase_hex(sha):
    with pytest.raises(ValidationError, match="bundle.sha256"):
        _spec(bundle={"sha256": sha, "path": "/api/v1/runs/5/bundle"})


@pytest.mark.parametrize(
    "path", ["http://evil.example/api/v1/x", "/api/v2/runs/5/bundle", "runs/5/bundle",
             "/api/v1/../../etc/passwd", "/api/v1/runs/5/bundle?x=1"],
)
def test_role_spec_rejects_a_bundle_path_outside_the_api(path):
    with pytest.raises(ValidationError, match="bundle.path"):
        _spec(bundle={"sha256": SHA, "path": path})


def test_role_spec_rejects_unknown_bundle_fields():
    with pytest.raises(ValidationError, match="url"):
        _spec(bundle={"sha256": SHA, "path": "/api/v1/runs/5/bundle", "url": "http://x"})


def test_role_spec_rejects_more_than_64_script_args():
    with pytest.raises(ValidationError, match="script_args"):
        _spec(script_args=["x"] * (MAX_SCRIPT_ARGS + 1))


def test_role_spec_rejects_a_script_arg_with_a_nul():
    with pytest.raises(ValidationError, match=r"script_args\[1\]: contains a NUL"):
        _spec(script_args=["ok", "bad\0arg"])


@pytest.mark.parametrize("flag", sorted(RESERVED_FLAGS))
def test_role_spec_refuses_every_reserved_flag_of_the_contract_in_options(flag):
    with pytest.raises(ValidationError, match="set by the spec itself"):
        _spec(options={flag.replace("-", "_"): "x"})


def test_role_spec_still_refuses_pythonpath_in_env():
    with pytest.raises(ValidationError, match="PYTHONPATH"):
        _spec(env={"PYTHONPATH": "/tmp"})


def test_trainer_argv_appends_script_args_after_a_double_dash():
    spec = _spec(options={"script": "train.py"}, script_args=["--epochs", "3", "--", "x y"])
    argv = trainer_argv(spec, ["python", "-m", "trainer"])
    assert argv[argv.index("--script") + 1] == "train.py"
    cut = argv.index("--")
    assert argv[cut + 1:] == ["--epochs", "3", "--", "x y"]
    assert "--role" in argv[:cut]


def test_the_report_token_never_reaches_the_command_line():
    # Anyone on the node reads command lines (`ps`); the supervisor hands the token in a file.
    argv = trainer_argv(_spec(), ["python", "-m", "trainer"])
    assert "--report-token" not in argv and not any("secret" in a for a in argv)


def test_trainer_argv_has_no_double_dash_without_script_args():
    assert "--" not in trainer_argv(_spec(), ["python", "-m", "trainer"])


def test_profile_spec_accepts_a_full_order():
    spec = ProfileSpec.model_validate({
        "task": "examples.diabetes:task", "task_args": {"lr": 0.1},
        "bundle": {"sha256": SHA, "path": "/api/v1/agent/profiles/3/bundle"},
        "batch_size": 32, "device": "cpu",
    })
    assert spec.task == "examples.diabetes:task" and spec.bundle is not None


@pytest.mark.parametrize(
    ("fields", "where"),
    [({"task": "no-colon"}, "task"), ({"device": "tpu"}, "device"), ({"batch_size": 0}, "batch_size")],
)
def test_profile_spec_rejects_a_bad_field_naming_it(fields, where):
    order = {"task": "hybridtrain.tasks.digits:smallcnn", "batch_size": 8, "device": "cpu", **fields}
    with pytest.raises(ValidationError, match=where):
        ProfileSpec.model_validate(order)


def test_a_launch_with_a_checkpoint_url_and_join_passes_both_to_the_trainer():
    spec = _spec(checkpoint_url="http://cp:8000/api/v1/runs/5/checkpoint", join=True, attempt=2)
    argv = trainer_argv(spec, command=["python", "-m", "trainer"])
    at = argv.index("--checkpoint-url")
    assert argv[at + 1] == "http://cp:8000/api/v1/runs/5/checkpoint"
    assert "--join" in argv and spec.attempt == 2


def test_a_plain_launch_has_no_checkpoint_url_no_join_and_attempt_zero():
    spec = _spec()
    argv = trainer_argv(spec, command=[])
    assert "--checkpoint-url" not in argv and "--join" not in argv and spec.attempt == 0


@pytest.mark.parametrize("url", ["file:///etc/passwd", "cp:8000/x", "http://cp/x?token=1", "http://c p/x"])
def test_role_spec_rejects_a_checkpoint_url_that_is_not_a_plain_http_url(url):
    with pytest.raises(ValidationError, match="checkpoint_url"):
        _spec(checkpoint_url=url)


def test_role_spec_rejects_a_negative_attempt():
    with pytest.raises(ValidationError, match="attempt"):
        _spec(attempt=-1)


# -- the run's training options: one typed JSON field, one trainer argument -------------------------


def test_a_launch_hands_the_trainer_its_training_options_as_one_json_argument():
    spec = _spec(train_options={"strategy": "diloco", "max_steps": 40, "local_sgd": {"sync_every": 5}})
    argv = trainer_argv(spec, command=["python", "-m", "trainer"])
    assert json.loads(argv[argv.index("--options-json") + 1]) == {
        "strategy": "diloco", "task": "hybridtrain.tasks.digits:smallcnn", "task_args": {}, "global_batch_size": 64,
        "max_steps": 40, "stop_at_target": True, "seed": 0, "device": "auto", "local_sgd": {"sync_every": 5}}


def test_the_trainer_builds_its_config_from_the_launch_orders_options():
    from trainer.cli import build_parser, config_from_args

    spec = _spec(train_options={"strategy": "ps-gc", "global_batch_size": 32,
                                "compression": {"pipeline_chunks": 3, "density": 0.02}}, batch_sizes=[20, 8, 4])
    parser = build_parser()
    cfg = config_from_args(parser.parse_args(trainer_argv(spec, command=[])), parser)
    assert (cfg.strategy, cfg.pipeline_chunks, cfg.density, cfg.global_batch) == ("ps-gc", 3, 0.02, 32)


@pytest.mark.parametrize(("train_options", "where"), [
    ({"strategy": "allreduce", "compression": {"pipeline_chunks": 2}}, "train_options.compression.pipeline_chunks"),
    ({"strategy": "ps", "compression": {"overlap": True}}, "train_options.compression.overlap"),
    ({"strategy": "dp"}, "train_options.strategy"),
])
def test_a_launch_order_with_impossible_training_options_is_refused_naming_the_field(train_options, where):
    with pytest.raises(ValidationError, match=where):
        _spec(train_options=train_options)


def test_options_json_is_set_by_the_spec_itself_not_through_options():
    with pytest.raises(ValidationError, match="set by the spec itself"):
        _spec(options={"options_json": "{}"})


def test_an_order_from_a_control_plane_before_train_options_still_passes_its_flags():
    spec = _spec(train_options=None, options={"strategy": "ps", "max-steps": 20})
    argv = trainer_argv(spec, command=[])
    assert "--options-json" not in argv and argv[argv.index("--strategy") + 1] == "ps"
