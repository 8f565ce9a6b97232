"""Loading a user's task says exactly what is wrong with it; the shared contract parses targets,
task refs and metric names and splits batches; a run's target must fit the task's metrics."""

from __future__ import annotations

import itertools
import math
import sys
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

from hybridtrain.contract import (
    SYSTEM_METRICS,
    Target,
    check_metric_name,
    check_task_ref,
    parse_target,
    proportional_batch_sizes,
    steps_for_epochs,
)
from hybridtrain.task import Metric, Task, TaskError, accuracy, load_task, parse_task_args
from trainer.taskloop import check_target

# What every task module written by these tests starts with: a valid task, which each test
# then spoils in one way.
PRELUDE = '''
import torch
from torch.utils.data import TensorDataset

import hybridtrain


def data():
    return TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))


def make(**changes):
    fields = dict(model=lambda: torch.nn.Linear(2, 2), train_data=data(),
                  loss=torch.nn.functional.cross_entropy,
                  optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    fields.update(changes)
    return hybridtrain.Task(**fields)
'''

_names = itertools.count()


@pytest.fixture
def task_module(tmp_path, monkeypatch):
    """write(source, name=None) -> a fresh importable module's name (forgotten afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created: list[str] = []

    def write(source: str, name: str | None = None, prelude: bool = True) -> str:
        name = name or f"usertask_{next(_names)}"
        body = (PRELUDE if prelude else "") + textwrap.dedent(source)
        (tmp_path / f"{name}.py").write_text(body)
        created.append(name)
        return name

    yield write
    for name in created:
        sys.modules.pop(name, None)


def tiny_task(**changes) -> Task:
    fields = dict(model=lambda: torch.nn.Linear(2, 2),
                  train_data=TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long)),
                  loss=torch.nn.functional.cross_entropy,
                  optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    fields.update(changes)
    return Task(**fields)


def load_error(ref: str, args=None) -> str:
    with pytest.raises(TaskError) as info:
        load_task(ref, args)
    return str(info.value)


# -- load_task ----------------------------------------------------------------------------------


def test_load_task_calls_the_function_with_the_json_arguments(task_module):
    mod = task_module("""
        def task(width=2):
            return make(model=lambda: torch.nn.Linear(2, width))
    """)
    task = load_task(f"{mod}:task", {"width": 5})
    assert isinstance(task, Task)
    assert task.model().out_features == 5


def test_load_task_of_a_missing_module_says_no_module_and_hints_the_bundle():
    text = load_error("no_such_usertask_module:task")
    assert "no module named 'no_such_usertask_module'" in text
    assert "bundle" in text


def test_load_task_of_a_missing_submodule_names_it(task_module):
    pkg = task_module("", prelude=False)
    text = load_error(f"{pkg}.missing:task")
    assert f"no module named '{pkg}.missing'" in text


def test_a_missing_dependency_of_the_task_module_shows_the_import_traceback(task_module):
    # The module exists; what it imports does not. Its name merely starts with the missing
    # one's, which must not make it look like the task module itself is absent.
    mod = task_module("import usertaskdep\n", name="usertaskdep_models", prelude=False)
    text = load_error(f"{mod}:task")
    assert f"importing {mod} failed" in text
    assert "Traceback" in text and "usertaskdep" in text


def test_a_module_that_fails_to_import_shows_the_users_traceback(task_module):
    mod = task_module("raise RuntimeError('no GPU here')\n", prelude=False)
    text = load_error(f"{mod}:task")
    assert f"importing {mod} failed" in text
    assert "RuntimeError: no GPU here" in text and f"{mod}.py" in text


def test_load_task_of_a_module_without_the_function_names_it(task_module):
    mod = task_module("")
    assert load_error(f"{mod}:nope") == f"task {mod}:nope: module {mod} has no function 'nope'"


def test_load_task_of_a_non_callable_attribute_says_there_is_no_function(task_module):
    mod = task_module("task = 3\n")
    assert "has no function 'task'" in load_error(f"{mod}:task")


def test_a_task_function_that_raises_gives_the_exception_and_the_users_traceback(task_module):
    mod = task_module("""
        def task():
            raise ValueError("lr must be positive")
    """)
    text = load_error(f"{mod}:task")
    assert f"task {mod}:task raised ValueError: lr must be positive" in text
    assert "Traceback" in text and f"{mod}.py" in text and 'raise ValueError("lr must be positive")' in text


def test_the_original_exception_stays_chained(task_module):
    mod = task_module("""
        def task():
            raise KeyError("data")
    """)
    with pytest.raises(TaskError) as info:
        load_task(f"{mod}:task")
    assert isinstance(info.value.__cause__, KeyError)


def test_a_task_function_returning_something_else_names_the_type(task_module):
    mod = task_module("""
        def task():
            return {"model": None}
    """)
    assert load_error(f"{mod}:task") == f"task {mod}:task returned dict, not a hybridtrain.Task"


def test_wrong_arguments_name_the_arguments_given(task_module):
    mod = task_module("""
        def task(width=2):
            return make()
    """)
    text = load_error(f"{mod}:task", {"depth": 3})
    assert f"task {mod}:task does not take the arguments {{'depth': 3}}" in text
    assert "depth" in text.splitlines()[0]


def test_a_type_error_inside_the_task_function_is_not_blamed_on_the_arguments(task_module):
    # The call's arguments fit; the user's own code has the TypeError.
    mod = task_module("""
        def task():
            return make(model=len(3))
    """)
    text = load_error(f"{mod}:task")
    assert "does not take the arguments" not in text
    assert f"task {mod}:task raised TypeError" in text


def test_a_task_with_a_non_callable_model_is_unusable(task_module):
    mod = task_module("""
        def task():
            return make(model=3)
    """)
    text = load_error(f"{mod}:task")
    assert text.startswith(f"task {mod}:task returned an unusable Task: ")
    assert "model must be callable, got int" in text


def test_a_task_with_a_non_callable_schedule_is_unusable(task_module):
    mod = task_module("""
        def task():
            return make(schedule="cosine")
    """)
    assert "schedule must be callable or None, got str" in load_error(f"{mod}:task")


def test_training_data_that_is_not_a_dataset_is_unusable(task_module):
    mod = task_module("""
        def task():
            return make(train_data=[(torch.zeros(2), 0)])
    """)
    assert "train_data must be a torch.utils.data.Dataset or IterableDataset, got list" in load_error(f"{mod}:task")


def test_evaluation_data_that_is_not_a_dataset_is_unusable(task_module):
    mod = task_module("""
        def task():
            return make(eval_data=torch.zeros(4, 2))
    """)
    assert "eval_data must be a torch.utils.data.Dataset or IterableDataset, got Tensor" in load_error(f"{mod}:task")


def test_a_map_style_dataset_without_a_length_is_unusable(task_module):
    mod = task_module("""
        class NoLen(torch.utils.data.Dataset):
            def __getitem__(self, i):
                return torch.zeros(2), 0

        def task():
            return make(train_data=NoLen())
    """)
    assert "train_data: a map-style Dataset needs __len__" in load_error(f"{mod}:task")


def test_duplicate_metric_names_are_unusable(task_module):
    mod = task_module("""
        def task():
            return make(eval_data=data(), metrics=[hybridtrain.accuracy(), hybridtrain.accuracy()])
    """)
    assert "metric names must be unique, got ['accuracy', 'accuracy']" in load_error(f"{mod}:task")


def test_metrics_without_evaluation_data_are_unusable(task_module):
    mod = task_module("""
        def task():
            return make(metrics=[hybridtrain.accuracy()])
    """)
    assert "metrics are computed on eval_data, which is None" in load_error(f"{mod}:task")


def test_metrics_that_are_not_metric_objects_are_unusable(task_module):
    mod = task_module("""
        def task():
            return make(eval_data=data(), metrics=["accuracy"])
    """)
    assert "metrics must be hybridtrain.Metric objects, got ['str']" in load_error(f"{mod}:task")


def test_a_single_metric_instead_of_a_list_is_unusable(task_module):
    mod = task_module("""
        def task():
            return make(eval_data=data(), metrics=hybridtrain.accuracy())
    """)
    assert "metrics must be a list of hybridtrain.Metric, got Metric" in load_error(f"{mod}:task")


def test_every_problem_of_a_task_is_named_at_once(task_module):
    mod = task_module("""
        def task():
            return make(model=None, loss=None)
    """)
    text = load_error(f"{mod}:task")
    assert "model must be callable" in text and "loss must be callable" in text


def test_a_malformed_task_ref_says_the_expected_form():
    assert "expected module:function" in load_error("examples/diabetes.py")


# -- task arguments -----------------------------------------------------------------------------


def test_task_args_parse_a_json_object():
    assert parse_task_args('{"lr": 0.05, "schedule": "constant"}') == {"lr": 0.05, "schedule": "constant"}


def test_empty_task_args_are_no_arguments():
    assert parse_task_args("") == {} and parse_task_args(None) == {}


def test_task_args_given_as_a_mapping_are_copied():
    given = {"lr": 0.1}
    parsed = parse_task_args(given)
    assert parsed == given and parsed is not given


def test_task_args_that_are_not_json_are_rejected():
    with pytest.raises(TaskError, match="task arguments are not valid JSON"):
        parse_task_args("{lr: 0.1}")


def test_task_args_that_are_not_an_object_are_rejected():
    with pytest.raises(TaskError, match="task arguments must be a JSON object, got list"):
        parse_task_args("[0.1]")


# -- metrics ------------------------------------------------------------------------------------


def test_a_metric_name_must_be_lower_snake_case():
    with pytest.raises(ValueError, match="use 1-32 of a-z, 0-9 and _"):
        Metric("Top-1", lambda o, t: o)


def test_a_metric_may_not_take_a_system_metric_name():
    with pytest.raises(ValueError, match="one the trainer reports itself"):
        Metric("loss", lambda o, t: o)


def test_a_metric_may_not_be_named_val_loss():
    # The trainer reports the task's loss under that name; a metric of it would be summed in.
    with pytest.raises(ValueError, match="metric name 'val_loss' is the trainer's"):
        Metric("val_loss", lambda o, t: o, higher_is_better=False)


def test_a_metric_function_must_be_callable():
    with pytest.raises(TypeError, match="metric 'r2': fn must be callable, got float"):
        Metric("r2", 0.5)


def test_accuracy_scores_each_sample_by_its_top_class():
    m = accuracy()
    logits = torch.tensor([[0.1, 0.9], [2.0, -1.0], [0.3, 0.4]])
    assert (m.name, m.higher_is_better) == ("accuracy", True)
    assert m.fn(logits, torch.tensor([1, 1, 1])).tolist() == [1.0, 0.0, 1.0]


def test_metric_directions_include_val_loss_when_there_is_evaluation_data():
    task = tiny_task(eval_data=TensorDataset(torch.zeros(2, 2)),
                     metrics=[accuracy(), Metric("mae", lambda o, t: o, higher_is_better=False)])
    assert task.metric_directions == {"accuracy": True, "mae": False, "val_loss": False}


def test_metric_directions_are_empty_without_evaluation_data():
    assert tiny_task().metric_directions == {}


# -- targets (trainer.taskloop.check_target) ----------------------------------------------------


def test_a_target_on_a_metric_the_task_lacks_lists_the_tasks_metrics():
    task = tiny_task(eval_data=TensorDataset(torch.zeros(2, 2)), metrics=[accuracy()])
    with pytest.raises(TaskError) as info:
        check_target(task, "r2>=0.5", "m:task")
    assert "reports no metric 'r2'" in str(info.value)
    assert "(it reports accuracy, val_loss)" in str(info.value)


def test_a_target_for_a_task_without_evaluation_data_says_so():
    with pytest.raises(TaskError, match="it has no eval_data"):
        check_target(tiny_task(), "accuracy>=0.9", "m:task")


def test_a_target_in_the_wrong_direction_suggests_the_right_operator():
    task = tiny_task(eval_data=TensorDataset(torch.zeros(2, 2)), metrics=[accuracy()])
    with pytest.raises(TaskError) as info:
        check_target(task, "val_loss>=0.3", "m:task")
    assert "lower val_loss is better" in str(info.value)
    assert "should read val_loss<=0.3" in str(info.value)


def test_a_target_in_the_tasks_direction_is_accepted():
    task = tiny_task(eval_data=TensorDataset(torch.zeros(2, 2)), metrics=[accuracy()])
    check_target(task, "accuracy>=0.9", "m:task")
    check_target(task, None, "m:task")


# -- contract: targets --------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("accuracy>=0.9", Target("accuracy", ">=", 0.9)),
    (" val_loss <= 0.3 ", Target("val_loss", "<=", 0.3)),
    ("r2>=-1e-3", Target("r2", ">=", -0.001)),
    ("mae<=5", Target("mae", "<=", 5.0)),
])
def test_parse_target_reads_each_form(text, want):
    assert parse_target(text) == want


@pytest.mark.parametrize("text, message", [
    ("accuracy>0.9", "expected METRIC>=VALUE or METRIC<=VALUE"),
    ("Accuracy>=0.9", "expected METRIC>=VALUE"),
    ("accuracy>=high", "expected METRIC>=VALUE"),
    ("accuracy>=0.9.1", "'0.9.1' is not a number"),
    ("accuracy>=1e999", "the value must be finite"),
    ("loss<=0.1", "loss is not an evaluation metric"),
])
def test_parse_target_rejects_malformed_targets(text, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        parse_target(text)


def test_a_parsed_target_prints_as_it_parses():
    t = parse_target("val_loss<=0.25")
    assert parse_target(str(t)) == t


def test_a_higher_is_better_target_is_reached_at_or_above_its_value():
    t = Target("accuracy", ">=", 0.9)
    assert (t.reached(0.9), t.reached(0.95), t.reached(0.89)) == (True, True, False)


def test_a_lower_is_better_target_is_reached_at_or_below_its_value():
    t = Target("val_loss", "<=", 0.3)
    assert (t.reached(0.3), t.reached(0.1), t.reached(0.31)) == (True, True, False)


@pytest.mark.parametrize("op", [">=", "<="])
def test_nan_never_reaches_a_target(op):
    assert not Target("m", op, 0.5).reached(math.nan)


# -- contract: names ----------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["examples.diabetes:task", "m:f", "_pkg.sub_2:Task_1"])
def test_check_task_ref_accepts_module_colon_function(ref):
    assert check_task_ref(ref) == ref


@pytest.mark.parametrize("ref", ["", "module", "a:b:c", "my-pkg:task", "pkg.:task", "pkg:task()", "1pkg:task"])
def test_check_task_ref_rejects_other_forms(ref):
    with pytest.raises(ValueError, match="expected module:function"):
        check_task_ref(ref)


@pytest.mark.parametrize("name", ["r2", "accuracy", "top_5", "a" * 32])
def test_check_metric_name_accepts_lower_snake_case_up_to_32(name):
    assert check_metric_name(name) == name


@pytest.mark.parametrize("name", ["", "2r", "Acc", "top-5", "a" * 33])
def test_check_metric_name_rejects_other_names(name):
    with pytest.raises(ValueError, match="use 1-32 of a-z"):
        check_metric_name(name)


@pytest.mark.parametrize("name", sorted(SYSTEM_METRICS))
def test_check_metric_name_rejects_system_metrics(name):
    with pytest.raises(ValueError, match="reports itself"):
        check_metric_name(name)


# -- contract: arithmetic -----------------------------------------------------------------------


def test_steps_for_epochs_rounds_a_partial_last_batch_up():
    assert steps_for_epochs(3, 1438, 64) == math.ceil(3 * 1438 / 64) == 68


def test_steps_for_epochs_is_at_least_one_step():
    assert steps_for_epochs(0.001, 100, 64) == 1


@pytest.mark.parametrize("args", [(0, 100, 64), (1, 0, 64), (1, 100, 0), (-1, 100, 64)])
def test_steps_for_epochs_rejects_non_positive_inputs(args):
    with pytest.raises(ValueError, match="must all be positive"):
        steps_for_epochs(*args)


@pytest.mark.parametrize("b, speeds", [(64, [1, 1, 1]), (100, [3.0, 1.0]), (7, [1000, 1, 1]),
                                       (513, [0.37, 2.5, 1.1, 9.0]), (4, [1, 2, 3, 4])])
def test_proportional_batch_sizes_sum_to_b_and_give_everyone_at_least_one(b, speeds):
    sizes = proportional_batch_sizes(b, speeds)
    assert sum(sizes) == b and all(n >= 1 for n in sizes)


def test_proportional_batch_sizes_are_within_one_sample_of_the_exact_share():
    speeds = [0.37, 2.5, 1.1, 9.0]
    sizes = proportional_batch_sizes(513, speeds)
    exact = [1 + (513 - 4) * s / sum(speeds) for s in speeds]
    assert all(abs(n - e) < 1 for n, e in zip(sizes, exact))


def test_proportional_batch_sizes_break_ties_towards_the_lower_worker():
    assert proportional_batch_sizes(8, [1, 1, 1]) == [3, 3, 2]


@pytest.mark.parametrize("b, speeds, message", [
    (8, [], "at least one worker"),
    (8, [1, 0], "finite number > 0"),
    (8, [1, math.inf], "finite number > 0"),
    (8, [1, math.nan], "finite number > 0"),
    (2, [1, 1, 1], "smaller than the 3 workers"),
])
def test_proportional_batch_sizes_reject_bad_inputs(b, speeds, message):
    with pytest.raises(ValueError, match=message):
        proportional_batch_sizes(b, speeds)
