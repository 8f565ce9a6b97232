"""The built-in tasks: they load as tasks, keep the trainer's former models, data and schedule,
and refuse bad arguments clearly."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from hybridtrain.task import Task, TaskError, load_task
from hybridtrain.tasks import builtin, datasets, models

MODULES = ("digits", "shapes", "synthetic")
# sha256 over (shape, bytes) of x_train, y_train, x_test, y_test as trainer/data.py built them at
# commit 5ca0eeb; they hold while the numpy/torch generators and the bundled CSV are unchanged.
DATA_SHA256 = {
    "digits": "23eace137d1b9017472c807b270e67c9b506f294e663ca448b3a85ba7d4c4c28",
    "shapes": "3c29b5d9e2cb38a5cc89020051ef75663cf3659c52d9cafd2962aa9237a3587c",
    "synthetic": "1076adbeee21244d548423f42a18caac77407148a6f8231bbcda9119ba1ec2ab",
}
# Parameter counts on digits (1x8x8, 10 classes), as trainer/models.py built them.
DIGITS_PARAMS = {"smallcnn": 25_978, "widecnn": 3_352_906, "widemlp": 25_458_698,
                 "resnet18": 11_172_810, "resnet50": 23_519_690, "resnet152": 58_155_466}


def old_lr_at(step: int, lr: float, max_steps: int, warmup: int, schedule: str) -> float:
    """trainer.config.lr_at at commit 5ca0eeb, the formula the built-in schedule must keep."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def data_digest(data: datasets.Arrays) -> str:
    h = hashlib.sha256()
    for t in (data.x_train, data.y_train, data.x_test, data.y_test):
        t = t.contiguous()
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("model", models.MODELS)
def test_builtin_task_loads_and_its_model_scores_a_batch(module, model):
    task = load_task(f"hybridtrain.tasks.{module}:{model}", {})
    x, y = task.collate(task.eval_data.__getitems__([0, 1]))
    with torch.no_grad():
        net = task.model().eval()
        out = net(x)
    assert out.shape == (2, 10)
    assert task.loss(out, y).ndim == 0
    assert task.metric_directions == {"accuracy": True, "val_loss": False}


@pytest.mark.parametrize("model", models.MODELS)
def test_builtin_model_has_the_former_parameter_count(model):
    net = load_task(f"hybridtrain.tasks.digits:{model}", {}).model()
    assert sum(p.numel() for p in net.parameters()) == DIGITS_PARAMS[model]


@pytest.mark.parametrize("name", MODULES)
def test_builtin_data_has_the_recorded_checksum(name):
    assert data_digest(datasets.load(name)) == DATA_SHA256[name]


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
@pytest.mark.parametrize("warmup", [0, 10])
def test_builtin_schedule_follows_the_former_lr_at_formula(schedule, warmup):
    task = load_task("hybridtrain.tasks.digits:smallcnn",
                     {"lr": 0.2, "schedule": schedule, "warmup_steps": warmup})
    net = task.model()
    opt = task.optimizer(net)
    sched = task.schedule(opt, 50)
    for step in range(1, 51):
        # The rate in force while the optimizer takes 1-based step `step`.
        for group in opt.param_groups:
            assert group["lr"] == pytest.approx(old_lr_at(step, 0.2, 50, warmup, schedule), abs=1e-12)
        opt.step()
        sched.step()


def test_builtin_cosine_schedule_ends_at_zero():
    task = load_task("hybridtrain.tasks.digits:smallcnn", {})
    opt = task.optimizer(task.model())
    sched = task.schedule(opt, 20)
    for _ in range(19):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_builtin_optimizer_decays_weight_matrices_only():
    task = load_task("hybridtrain.tasks.digits:smallcnn", {"momentum": 0.5, "weight_decay": 1e-3})
    net = task.model()
    opt = task.optimizer(net)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 1e-3 for p in g["params"]}
    assert decayed == {id(p) for p in net.parameters() if p.dim() > 1}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(net.parameters()))
    assert all(g["momentum"] == 0.5 and g["lr"] == 0.1 for g in opt.param_groups)


@pytest.mark.parametrize("args, field", [
    ({"schedule": "linear"}, "schedule"),
    ({"lr": 0}, "lr"),
    ({"lr": "0.1"}, "lr"),
    ({"lr": float("nan")}, "lr"),
    ({"momentum": 1.0}, "momentum"),
    ({"weight_decay": -1e-4}, "weight_decay"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"warmup_steps": 2.5}, "warmup_steps"),
    ({"warmup_steps": True}, "warmup_steps"),
])
def test_builtin_task_rejects_a_bad_argument_naming_it(args, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        builtin.image_task("digits", "smallcnn", **args)


def test_builtin_task_bad_argument_is_a_task_error_through_load_task():
    with pytest.raises(TaskError, match="schedule must be one of cosine, constant, got 'linear'"):
        load_task("hybridtrain.tasks.digits:smallcnn", {"schedule": "linear"})


def test_builtin_task_unknown_argument_is_a_task_error():
    with pytest.raises(TaskError, match="does not take the arguments"):
        load_task("hybridtrain.tasks.shapes:smallcnn", {"model": "resnet18"})


def test_builtin_schedule_refuses_a_non_positive_max_steps():
    task = load_task("hybridtrain.tasks.digits:smallcnn", {})
    with pytest.raises(ValueError, match="max_steps must be an integer >= 1"):
        task.schedule(task.optimizer(task.model()), 0)


def test_builtin_task_functions_are_named_for_their_module():
    from hybridtrain.tasks import synthetic

    assert synthetic.resnet50.__module__ == "hybridtrain.tasks.synthetic"
    assert synthetic.resnet50.__name__ == "resnet50"
    assert isinstance(synthetic.smallcnn(), Task)


def test_data_loader_fetches_a_tensor_pairs_batch_in_one_call():
    data = datasets.load("digits")
    calls = []

    class Counting(datasets.TensorPairs):
        def __getitems__(self, indices):
            calls.append(list(indices))
            return super().__getitems__(indices)

    loader = DataLoader(Counting(data.x_train, data.y_train), batch_size=5, collate_fn=datasets.batched)
    x, y = next(iter(loader))
    assert calls == [[0, 1, 2, 3, 4]]
    assert torch.equal(x, data.x_train[:5]) and torch.equal(y, data.y_train[:5])


def test_batched_stacks_single_samples_like_default_collate():
    data = datasets.load("digits").train()
    x, y = datasets.batched([data[0], data[1]])
    assert x.shape == (2, 1, 8, 8) and y.tolist() == data.y[:2].tolist()


def test_tensor_pairs_refuses_unequal_lengths():
    with pytest.raises(ValueError, match="3 inputs but 2 targets"):
        datasets.TensorPairs(torch.zeros(3), torch.zeros(2))


def test_builtin_data_is_built_once_per_process():
    assert datasets.load("digits") is datasets.load("digits")


def test_importing_the_tasks_package_does_not_import_torch():
    code = "import sys, hybridtrain.tasks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eval_samples_scores_a_fixed_sample_of_the_held_out_set():
    first = load_task("hybridtrain.tasks.shapes:smallcnn", {"eval_samples": 1200}).eval_data
    again = load_task("hybridtrain.tasks.shapes:smallcnn", {"eval_samples": 1200}).eval_data
    full = datasets.load("shapes").eval()
    assert len(first) == 1200 and torch.equal(first.y, again.y) and torch.equal(first.x, again.x)
    # A sample of the set, not its first rows: every class is in it about equally.
    assert not torch.equal(first.y, full.y[:1200])
    assert torch.bincount(first.y, minlength=10).min() > 80


@pytest.mark.parametrize("samples", [0, 2001, 1.5, True])
def test_eval_samples_outside_the_held_out_set_is_refused_naming_its_size(samples):
    with pytest.raises(ValueError, match=r"eval_samples must be an integer from 1 to 2000"):
        builtin.image_task("shapes", "smallcnn", eval_samples=samples)


def test_image_size_averages_the_images_down_and_the_model_follows():
    task = load_task("hybridtrain.tasks.shapes:smallcnn", {"image_size": 16})
    x, y = task.train_data[0:4]
    assert x.shape == (4, 3, 16, 16)
    assert task.model()(x).shape == (4, 10)
    # Area averaging: each new pixel is the mean of a 2x2 block.
    full = datasets.load("shapes").x_train[0]
    assert torch.allclose(x[0, :, 0, 0], full[:, :2, :2].mean(dim=(1, 2)), atol=1e-6)


@pytest.mark.parametrize("side", [3, 33, "16"])
def test_image_size_beyond_the_images_is_refused(side):
    with pytest.raises(ValueError, match=r"image_size must be an integer from 4 to 32"):
        builtin.image_task("shapes", "smallcnn", image_size=side)
