"""One-step-delayed updates (`--delayed-updates`): a worker's step() sends its gradient and
returns; the update of step t is applied at step t+1's step(), after step t+1's gradient (computed
without it) has left. Whatever needs the current model applies the pending update first."""

from __future__ import annotations

import copy
import signal
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn
from trainer_testing import (
    DIGITS,
    Role,
    config,
    global_batch,
    events,
    read_metrics,
    replica_hashes,
    run_cli,
    run_in_process,
    series,
    sgd,
    start_ps_run,
    stop_all,
    tiny_data,
    tiny_mlp,
    with_replica_script,
)

from agents.spec import RoleSpec, trainer_argv
from hybridtrain.contract import EVENT_WORKER_JOINED, EVENT_WORKER_LEFT
from app.models import Run, RunWorker
from app.lifecycle.orders import launch_orders
from app.schemas.runs import RunCreate
from trainer import checkpoint
from trainer.cli import UsageError, build_parser, config_from_args
from trainer.config import TrainConfig
from trainer.frames import Grad, expect, pack
from trainer.loader import batch_indices
from trainer.metrics import MetricsLogger
from trainer.ps import PSClient
from trainer.server import ParameterServer, serve_in_thread
from trainer.transport import InMemoryHub

PAPER_SITES = ("onprem", "onprem", "onprem", "cloud", "cloud")
# Densities fixed and nothing timed: two runs of the same settings are then bitwise equal.
FIXED = {"density": 0.1, "density_min": 0.1, "density_max": 0.1, "server_k_fraction": 0.25}


def _flat(client: PSClient) -> torch.Tensor:
    """The client's model as one vector in the layout's order (a checkpoint's `params`)."""
    params = dict(client.model.named_parameters())
    return torch.cat([params[n].detach().reshape(-1) for n in client.layout.names])


def _step(client: PSClient, data, step: int) -> None:
    """One step of a worker's loop: its share of the global batch, backward, step()."""
    idx = batch_indices(step, client.index, client.batch_sizes, len(data), client.cfg.seed)
    client.zero_grad()
    loss = F.cross_entropy(client.model(data.tensors[0][idx]), data.tensors[1][idx])
    loss.backward()
    client.push_pull(step, loss=float(loss.detach()), samples=len(idx), compute_s=0.0)


def _run_workers(cfg: TrainConfig, work: Callable[[PSClient], None]) -> list[PSClient]:
    """A server and cfg.workers started workers on threads, each running `work(client)`, then
    closing (unless it left)."""
    hub = InMemoryHub(timeout_s=30)
    thread, server_errors = serve_in_thread(ParameterServer(cfg, hub.transport(0), MetricsLogger(0, "ps")))
    clients = []
    for rank in range(1, cfg.workers + 1):
        model = tiny_mlp()
        clients.append(PSClient(cfg, rank, hub.transport(rank), model, sgd(model), MetricsLogger(rank, "worker")))
    errors: list[BaseException] = []

    def run(client: PSClient) -> None:
        try:
            client.start()
            work(client)
            client.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    thread.join(30)
    if errors or server_errors:
        raise (errors or server_errors)[0]
    return clients


def _stale_sgd(cfg: TrainConfig, steps: int, lr_at: Callable[[int], float]) -> nn.Module:
    """Momentum SGD on the global batch where step t's gradient is taken at the weights after
    step t-2 (one step stale) and applied with step t's learning rate."""
    data = tiny_data()
    sizes = [cfg.global_batch // cfg.workers] * cfg.workers
    model = tiny_mlp()
    opt = sgd(model, weight_decay=0.0)
    stale = copy.deepcopy(model)
    for step in range(1, steps + 1):
        x, y = global_batch(data, step, sizes, cfg.seed)
        stale.zero_grad()
        F.cross_entropy(stale(x), y).backward()
        before = copy.deepcopy(model.state_dict())
        for p, q in zip(model.parameters(), stale.parameters()):
            p.grad = q.grad.clone()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        stale.load_state_dict(before)
    return model


def _assert_models_equal(models: list[nn.Module], reference: nn.Module) -> None:
    for model in models:
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# -- the flag --------------------------------------------------------------------------------------

def test_delayed_updates_are_off_by_default():
    assert TrainConfig().delayed_updates is False
    assert config_from_args(build_parser().parse_args([])).delayed_updates is False


# -- when an update is applied ------------------------------------------------------------------------

def test_with_delayed_updates_a_step_returns_before_its_update_arrives_and_the_next_step_applies_it():
    cfg = config(strategy="ps", workers=1, global_batch=16, max_steps=10, delayed_updates=True)
    hub = InMemoryHub(timeout_s=30)
    model = tiny_mlp()
    client = PSClient(cfg, 1, hub.transport(1), model, torch.optim.SGD(model.parameters(), lr=0.1),
                      MetricsLogger(1, "worker"))
    # The server's side played by hand: its aggregation, but nothing sent until the test says.
    server = ParameterServer(cfg, hub.transport(0), MetricsLogger(0, "ps"))
    server.configure(client.layout.spec)
    data, start = tiny_data(), _flat(client)

    _step(client, data, 1)
    # Nothing has answered step 1, and its step() has returned with the model as it was.
    assert torch.equal(_flat(client), start)
    assert (client.step, client.sent_step) == (0, 1)
    update = server.aggregate(1, [expect(server.transport.recv(1), Grad, 1)], 0)
    server.transport.send(1, pack(update))

    _step(client, data, 2)
    assert expect(server.transport.recv(1), Grad, 2).step == 2
    torch.testing.assert_close(_flat(client), start - 0.1 * update.dense.values.float())
    assert (client.step, client.sent_step) == (1, 2)


def test_with_delayed_updates_the_run_follows_sgd_on_gradients_one_step_stale():
    cfg = config(strategy="ps", workers=3, global_batch=48, delayed_updates=True)
    run = run_in_process(cfg, 4, optimizer=lambda m: sgd(m, weight_decay=0.0))
    _assert_models_equal(run.models, _stale_sgd(cfg, 4, lambda step: 0.1))


def test_a_delayed_update_moves_the_weights_with_the_learning_rate_of_its_own_step():
    # A schedule steps the rate after every step(), before that step's delayed update is applied.
    def halve(rank: int, step: int, run) -> None:
        for group in run.optimizers[rank - 1].param_groups:
            group["lr"] = 0.1 * 0.5**step

    cfg = config(strategy="ps", workers=3, global_batch=48, delayed_updates=True)
    run = run_in_process(cfg, 4, optimizer=lambda m: sgd(m, weight_decay=0.0), after_step=halve)
    _assert_models_equal(run.models, _stale_sgd(cfg, 4, lambda step: 0.1 * 0.5 ** (step - 1)))


def test_without_delayed_updates_each_step_applies_its_own_update_before_it_returns():
    cfg = config(strategy="ps", workers=3, global_batch=48)
    seen: dict[int, dict] = {}

    def snapshot(rank: int, step: int, run) -> None:
        if rank == 1:
            seen[step] = copy.deepcopy(run.models[0].state_dict())

    run_in_process(cfg, 3, optimizer=lambda m: sgd(m, weight_decay=0.0), after_step=snapshot)
    data, sizes = tiny_data(), [16, 16, 16]
    reference = tiny_mlp()
    opt = sgd(reference, weight_decay=0.0)
    for step in range(1, 4):
        x, y = global_batch(data, step, sizes, cfg.seed)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
        model = tiny_mlp()
        model.load_state_dict(seen[step])
        _assert_models_equal([model], reference)


# -- the run ends current ------------------------------------------------------------------------------

def test_the_last_step_of_a_delayed_run_waits_for_its_own_update():
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=32, max_steps=4, warmup_steps=1, dense_numel=16,
                 delayed_updates=True, **FIXED)
    after: dict[int, tuple[int, int]] = {}

    def train(client: PSClient) -> None:
        for step in range(1, 5):
            _step(client, tiny_data(), step)
            after[step] = (client.step, client.sent_step)

    _run_workers(cfg, train)
    assert after[3] == (2, 3) and after[4] == (4, 4)


def test_a_delayed_run_ends_with_every_replica_equal_to_the_servers_last_checkpoint(tmp_path):
    # max_steps beyond the loop: the last step leaves its update pending and closing applies it.
    cfg = config(strategy="ps-bz-gc", workers=3, global_batch=48, warmup_steps=1, dense_numel=16,
                 delayed_updates=True, checkpoint_every=4, checkpoint_dir=str(tmp_path), **FIXED)
    clients = _run_workers(cfg, lambda client: [_step(client, tiny_data(), s) for s in range(1, 7)])
    saved = checkpoint.read(checkpoint.latest(tmp_path), cfg)
    assert saved["step"] == 6
    for client in clients:
        assert (client.step, client.sent_step) == (6, 6)
        assert torch.equal(_flat(client), saved["params"])


def test_a_checkpoint_of_a_delayed_run_holds_the_model_of_its_step(tmp_path):
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=32, warmup_steps=1, dense_numel=16,
                 delayed_updates=True, checkpoint_every=3, checkpoint_dir=str(tmp_path), **FIXED)
    models: dict[int, torch.Tensor] = {}

    def train(client: PSClient) -> None:
        for step in range(1, 6):
            _step(client, tiny_data(), step)
            models[client.step] = _flat(client)  # the model after the updates it has applied

    _run_workers(cfg, train)
    assert checkpoint.saved_steps(tmp_path) == [3, 5]
    assert torch.equal(checkpoint.read(checkpoint.run_path(tmp_path, 3), cfg)["params"], models[3])


def test_an_evaluation_applies_the_pending_update_first():
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=32, warmup_steps=1, dense_numel=16,
                 delayed_updates=True, **FIXED)
    seen: dict[str, tuple[int, int]] = {}

    def train(client: PSClient) -> None:
        for step in range(1, 3):
            _step(client, tiny_data(), step)
        seen["before"] = (client.step, client.sent_step)
        client.average_buffers(2)
        seen["evaluated"] = (client.step, client.sent_step)
        client.combine_eval(2, {"accuracy": 1.0}, 1)
        _step(client, tiny_data(), 3)

    _run_workers(cfg, train)
    assert seen == {"before": (1, 2), "evaluated": (2, 2)}


def test_a_worker_leaving_a_delayed_run_applies_its_last_update_first():
    cfg = config(strategy="ps-bz-gc", workers=2, global_batch=32, warmup_steps=1, dense_numel=16,
                 delayed_updates=True, **FIXED)
    first: dict[int, torch.Tensor] = {}
    left: dict[str, object] = {}

    def train(client: PSClient) -> None:
        for step in range(1, 7):
            if client.rank == 2 and step == 4:
                client.leave()
                left.update(model=_flat(client), step=client.step)
                return
            _step(client, tiny_data(), step)
            if client.rank == 1:
                first[client.step] = _flat(client)

    _run_workers(cfg, train)
    assert left["step"] == 3 and torch.equal(left["model"], first[3])


# -- combined with the other PS options -------------------------------------------------------------------

def _train(**options) -> list[nn.Module]:
    cfg = TrainConfig(**({"strategy": "ps-bz-gc", "workers": 4, "global_batch": 32, "max_steps": 8,
                          "warmup_steps": 2, "dense_numel": 16, "allocation": "flops",
                          "delayed_updates": True} | options))
    return run_in_process(cfg, 8, eval_at=(4, 8)).models


def test_delayed_updates_with_overlap_learn_bitwise_what_they_learn_without_it():
    plain = _train(sites=PAPER_SITES, pipeline_chunks=3, **FIXED)
    overlapped = _train(sites=PAPER_SITES, pipeline_chunks=3, overlap=True, **FIXED)
    for a, b in zip(plain, overlapped):
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)


def test_delayed_updates_with_per_site_aggregation_learn_the_reference_aggregation_when_nothing_is_dropped():
    exact = {"density": 1.0, "density_min": 1.0, "density_max": 1.0, "server_k_fraction": 1.0, "value_dtype": "fp32"}
    direct = _train(sites=PAPER_SITES, **exact)
    aggregated = _train(sites=PAPER_SITES, site_aggregation=True, pipeline_chunks=2, **exact)
    for a, b in zip(direct, aggregated):
        for pa, pb in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


# -- the command line and the control plane ---------------------------------------------------------------

def _cli(*argv: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_delayed_updates_for_a_strategy_without_a_server_is_a_usage_error():
    with pytest.raises(UsageError, match="--delayed-updates"):
        _cli("--strategy", "allreduce", "--workers", "2", "--delayed-updates")


@pytest.mark.parametrize("extra", [["--pipeline-chunks", "4"],
                                   ["--sites", "a,a,b,b", "--aggregate-at-sites", "--pipeline-chunks", "2"]])
def test_delayed_updates_combine_with_pipelining_and_with_per_site_aggregation(extra):
    cfg = _cli("--strategy", "ps-bz-gc", "--workers", "3", "--delayed-updates", *extra)
    assert cfg.delayed_updates is True


def test_a_run_request_with_delayed_updates_for_a_strategy_without_a_server_is_refused():
    with pytest.raises(ValidationError, match="compression.delayed_updates"):
        RunCreate(name="r", node_ids=[1], strategy="allreduce", compression={"delayed_updates": True})


@pytest.mark.parametrize("delayed", [True, False])
def test_a_run_requests_delayed_updates_reach_every_ranks_trainer_command_line(delayed):
    body = RunCreate(name="r", node_ids=[1, 2], compression={"delayed_updates": delayed})
    workers = [RunWorker(rank=0, role="ps", node_id=1, node_name="a"),
               *(RunWorker(rank=r, role="worker", node_id=r, node_name=f"n{r}", batch_size=32) for r in (1, 2))]
    run = Run(id=7, name="r", strategy="ps-bz-gc", task="hybridtrain.tasks.digits:smallcnn", task_args={},
              global_batch_size=64, max_steps=40, seed=0, allocation="flops", device="auto",
              compression=body.compression.model_dump(exclude_none=True), master_addr="10.0.0.1",
              master_port=29507, workers=workers)
    for order in launch_orders(run, metrics_token=lambda rank: f"htr_{rank}.s", public_url="http://cp"):
        argv = trainer_argv(RoleSpec.model_validate(order.spec), command=[])
        assert config_from_args(build_parser().parse_args(argv)).delayed_updates is delayed


@pytest.mark.e2e
def test_a_delayed_run_over_tcp_keeps_the_replicas_identical_and_learns(tmp_path):
    proc = run_cli(*DIGITS, "--strategy", "ps-bz-gc", "--workers", "3", "--max-steps", "30", "--eval-every", "15",
                   "--delayed-updates", *with_replica_script(tmp_path), "--metrics-out", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    hashes = replica_hashes(proc.stdout)
    assert sorted(hashes) == [1, 2, 3] and len({w for w, _ in hashes.values()}) == 1
    assert series(read_metrics(tmp_path / "m.jsonl"), "accuracy")[30] > 0.5


# A user's own loop whose replicas start from different weights (the run's must win) and print
# the hash of their final weights once the loop is done.
SCRIPT = """
import hashlib, time
import torch, torch.nn.functional as F
import hybridtrain as ht
from torch.utils.data import TensorDataset

ctx = ht.init()
torch.manual_seed(100 + ctx.rank)
model = ht.prepare_model(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5), model)
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 12, generator=g)
data = TensorDataset(x, (x @ torch.randn(12, 3, generator=g)).argmax(1))
while ctx.step < ctx.max_steps:
    for xb, yb in ht.data_loader(data):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
        time.sleep(0.03)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
print(f"RESULT rank {ctx.rank} step {ctx.step} hash {hashlib.sha256(flat).hexdigest()}", flush=True)
"""


def _script_run(tmp_path, steps: int) -> list[str]:
    (tmp_path / "train.py").write_text(SCRIPT)
    return ["--strategy", "ps-gc", "--global-batch", "48", "--max-steps", str(steps), "--timeout-s", "60",
            "--delayed-updates", "--code-dir", str(tmp_path), "--script", "train.py"]


@pytest.mark.e2e
def test_a_joiner_of_a_delayed_run_ends_with_the_others_weights(tmp_path):
    args = _script_run(tmp_path, 150)
    server, roles, port = start_ps_run(tmp_path, 2, args, cwd=tmp_path)
    try:
        server.wait_for("[ps] step 1/")
        roles[3] = Role("worker", 3, 3, port, [*args, "--join"], metrics=tmp_path / "rank3.jsonl", cwd=tmp_path)
        assert server.wait() == 0, server.output[-3000:]
        for role in roles.values():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *roles.values())
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)] == [3]
    results = [role.wait_for("RESULT") for role in roles.values()]
    assert all(" step 150 " in line for line in results)
    assert len({line.split(" hash ")[1] for line in results}) == 1, results


@pytest.mark.e2e
def test_a_worker_told_to_leave_a_delayed_run_leaves_at_a_step_boundary_and_the_run_finishes(tmp_path):
    server, workers, _ = start_ps_run(tmp_path, 2, _script_run(tmp_path, 150), cwd=tmp_path)
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(1.5)
        workers[2].proc.send_signal(signal.SIGTERM)
        assert workers[2].wait() == 0, workers[2].output[-3000:]
        assert server.wait() == 0, server.output[-3000:]
        assert workers[1].wait() == 0, workers[1].output[-3000:]
    finally:
        stop_all(server, *workers.values())
    left = events(server.records(), EVENT_WORKER_LEFT)
    assert [e["subject"] for e in left] == [2]
    assert f"left the run after step {left[0]['step']}" in workers[2].output
    assert " step 150 " in workers[1].wait_for("RESULT")
