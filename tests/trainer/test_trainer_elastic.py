"""Elastic parameter-server runs on real processes: a worker lost (killed, silent, or cut off
by its link going down), leaving or joining, too few workers, a relay lost, and the server
preempted (docs/elastic.md)."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from shaped_link import shaped_link
from trainer_testing import (
    DIGITS,
    Role,
    events,
    replica_hashes,
    run_cli,
    series,
    start_ps_run,
    stop_all,
    with_replica_script,
)

from hybridtrain.contract import (
    EVENT_CHECKPOINT,
    EVENT_WAITING,
    EVENT_WORKER_JOINED,
    EVENT_WORKER_LEFT,
    EVENT_WORKER_LOST,
    EXIT_TOO_FEW_WORKERS,
)


def run_args(workers: int, steps: int) -> list[str]:
    """A digits run whose steps take ~0.2 s (dense frames over emulated 10 Mbit/s links): long
    enough to hit mid-run on two shared cores, short enough for a test."""
    return [*DIGITS, "--strategy", "ps", "--eval-every", "1000", "--timeout-s", "60", "--max-steps", str(steps),
            "--link-mbps", ",".join(["10"] * workers)]


def bytes_per_step(records: list[dict], *, rank: int, peer: int) -> dict[int, float]:
    """step -> the bytes `rank` sent to `peer` in that step."""
    return {r["step"]: r["value"] for r in records
            if r.get("name") == "bytes_sent" and r["rank"] == rank and r.get("peer") == peer}


def run_with_a_late_worker(tmp_path, workers: int, args: list[str], *, after: str, rank: int, join: bool = True,
                           cwd=None, heard: Path | None = None) -> tuple[Role, dict[int, Role]]:
    """A PS run planned for `workers`; worker `rank` (a planned one, or with `join` a newcomer
    given --join) starts once the server has printed `after`. Every role must exit 0; returns
    the server and the workers by rank, the late one included. The roles are forked from the
    zygote (trainer_testing.Role), so a late one is in within a second on a quiet host; on a
    loaded one it may take longer than the run has left: with `heard`, that file is made once
    the server has the late worker's HELLO, and a `held` script's planned workers wait for it."""
    where = {"cwd": cwd} if cwd else {}
    server, roles, port = start_ps_run(tmp_path, workers, args, ranks=[r for r in range(1, workers + 1) if r != rank],
                                       **where)
    try:
        server.wait_for(after)
        roles[rank] = Role("worker", rank, workers + 1, port, [*args, "--join"] if join else args,
                           metrics=tmp_path / f"rank{rank}.jsonl", **where)
        if heard is not None:
            server.wait_for(f"worker {rank} asks to join")
            heard.touch()
        assert server.wait() == 0, server.output[-3000:]
        for role in roles.values():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *roles.values())
    return server, roles


def test_a_killed_worker_is_dropped_within_three_step_times_and_the_run_finishes(tmp_path):
    server, workers, _ = start_ps_run(tmp_path, 3, run_args(3, 60))
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(3.0)
        killed_at = time.time()
        os.kill(workers[2].proc.pid, signal.SIGKILL)
        assert server.wait() == 0, server.output[-3000:]
        for r in (1, 3):
            assert workers[r].wait() == 0, server.output[-3000:] + workers[r].output[-3000:]
    finally:
        stop_all(server, *workers.values())
    records = server.records()
    lost = events(records, EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [2]
    assert "residual" in lost[0]["detail"]
    times = sorted(r["t"] for r in records if r.get("name") == "loss" and r["t"] < killed_at)
    step_s = statistics.median(b - a for a, b in zip(times, times[1:]))
    assert lost[0]["t"] - killed_at <= 3 * step_s + 0.05
    # After the loss the survivors share the whole global batch between them.
    after = [s for s in series(records, "batch_size") if s > lost[0]["step"] + 1]
    assert after and max(after) == 60
    shares = {r: series(workers[r].records(), "batch_size", rank=r) for r in (1, 3)}
    assert all(shares[1][s] + shares[3][s] == 48 for s in after)


def test_a_silent_worker_is_dropped_after_the_loss_deadline_not_the_peer_timeout(tmp_path):
    # SIGSTOP: the process is frozen but its connection stays open, as with a node gone silent.
    server, workers, _ = start_ps_run(tmp_path, 2, run_args(2, 60))
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(2.0)
        stopped_at = time.time()
        os.kill(workers[2].proc.pid, signal.SIGSTOP)
        assert server.wait() == 0, server.output[-3000:]
        assert workers[1].wait() == 0
    finally:
        if workers[2].proc.poll() is None:
            os.kill(workers[2].proc.pid, signal.SIGCONT)
        stop_all(server, *workers.values())
    lost = events(server.records(), EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [2] and "silent" in lost[0]["detail"]
    # The floor (2 s) plus a step, far below --timeout-s 60.
    assert lost[0]["t"] - stopped_at < 6


def test_a_worker_whose_link_goes_down_is_dropped_after_the_loss_deadline_and_the_run_trains_on(tmp_path):
    # Worker 2 runs in a namespace of its own behind a veth; bringing the namespace's end down
    # cuts it off as a cloud VM's lost link would: no FIN, no RST, its frames just stop.
    args = run_args(2, 60)
    with shaped_link("htcut", "1gbit", "1mb") as link:
        server, workers, port = start_ps_run(tmp_path, 2, args, ranks=[1], master_addr=link.host_address)
        workers[2] = Role("worker", 2, 3, port, args, metrics=tmp_path / "rank2.jsonl",
                          master_addr=link.host_address, prefix=("ip", "netns", "exec", link.ns))
        try:
            server.wait_for("[ps] step 1/")
            time.sleep(2.0)
            cut_at = time.time()
            subprocess.run(["ip", "-n", link.ns, "link", "set", link.inside, "down"], check=True, timeout=10)
            assert server.wait() == 0, server.output[-3000:]
            assert workers[1].wait() == 0, workers[1].output[-3000:]
        finally:
            stop_all(server, *workers.values())
    lost = events(server.records(), EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [2] and "silent" in lost[0]["detail"]
    assert lost[0]["t"] - cut_at < 6  # the 2 s floor plus a step, far below --timeout-s 60
    after = [s for s in series(server.records(), "batch_size") if s > lost[0]["step"] + 1]
    shares = series(workers[1].records(), "batch_size", rank=1)
    assert after and all(shares[s] == 48 for s in after)  # the survivor takes the whole global batch


def test_a_worker_told_to_leave_leaves_at_a_step_boundary_is_let_go_as_its_bye_arrives_and_exits_0(tmp_path):
    # Rank 1 waits 1 s after each update before computing again, rank 2 does not: rank 2's BYE
    # reaches the server as rank 1 starts its next step, a second before that step's gradient.
    (tmp_path / "train.py").write_text(SCRIPT.replace("time.sleep(0.03)", "time.sleep(1.0 if ctx.rank == 1 else 0.0)"))
    args = ["--strategy", "ps-gc", "--global-batch", "48", "--max-steps", "4", "--timeout-s", "60",
            "--code-dir", str(tmp_path), "--script", "train.py"]
    server, workers, _ = start_ps_run(tmp_path, 2, args, cwd=tmp_path)
    try:
        server.wait_for("[ps] step 1/")
        workers[2].proc.send_signal(signal.SIGTERM)
        assert workers[2].wait() == 0, workers[2].output[-3000:]
        assert server.wait() == 0, server.output[-3000:]
        assert workers[1].wait() == 0, workers[1].output[-3000:]
    finally:
        stop_all(server, *workers.values())
    records = server.records()
    left = events(records, EVENT_WORKER_LEFT)
    assert [e["subject"] for e in left] == [2]
    # It took part in every step up to the one it left after, and in none after.
    assert sorted(series(workers[2].records(), "batch_size", rank=2)) == list(range(1, left[0]["step"] + 1))
    assert f"left the run after step {left[0]['step']}" in workers[2].output
    next_round = min(r["t"] for r in records if "name" in r and r["step"] == left[0]["step"] + 1)
    assert next_round - left[0]["t"] > 0.5
    # Its BYE did not start the clock of rank 1's silence: rank 1 stayed a member throughout.
    assert not events(records, EVENT_WORKER_LOST)


SCRIPT = """
import hashlib, os, time
import torch, torch.nn.functional as F
import hybridtrain as ht
from torch.utils.data import TensorDataset

ctx = ht.init()
torch.manual_seed(100 + ctx.rank)  # different weights on every worker: the run's must win
model = ht.prepare_model(torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)))
opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model)
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 12, generator=g)
data = TensorDataset(x, (x @ torch.randn(12, 3, generator=g)).argmax(1))
shares = set()
while ctx.step < ctx.max_steps:
    for xb, yb in ht.data_loader(data):
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        shares.add(len(xb))
        opt.step()
        time.sleep(0.03)
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
print(f"RESULT rank {ctx.rank} step {ctx.step} hash {hashlib.sha256(flat).hexdigest()} shares {sorted(shares)}", flush=True)
"""


def held(script: str, step: int, heard: Path) -> str:
    """`script` whose planned workers wait after `step` until `heard` exists: the run goes on
    only once the server has a joiner's HELLO, however slowly the joiner starts on a loaded
    host, so the run cannot end before its next boundary admits the joiner."""
    assert "        time.sleep(0.03)\n" in script
    wait = (f"        while ctx.step == {step} and not ctx.cfg.join and not os.path.exists({str(heard)!r}):\n"
            "            time.sleep(0.01)\n")
    return script.replace("        time.sleep(0.03)\n", "        time.sleep(0.03)\n" + wait)


def test_a_joiner_gets_the_runs_weights_and_optimizer_state_and_a_batch_share(tmp_path):
    heard = tmp_path / "heard"
    (tmp_path / "train.py").write_text(held(SCRIPT, 1, heard))
    args = ["--strategy", "ps-gc", "--global-batch", "48", "--max-steps", "200", "--timeout-s", "60",
            "--code-dir", str(tmp_path), "--script", "train.py"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 1/", rank=3, cwd=tmp_path,
                                           heard=heard)
    joined = events(server.records(), EVENT_WORKER_JOINED)
    assert [e["subject"] for e in joined] == [3]
    results = {r: role.wait_for("RESULT") for r, role in roles.items()}
    hashes = {line.split(" hash ")[1].split()[0] for line in results.values()}
    assert len(hashes) == 1, results
    assert all(" step 200 " in line for line in results.values())
    # The joiner computed its share of every step after the one it caught up with.
    steps = series(roles[3].records(), "batch_size", rank=3)
    assert min(steps) == joined[0]["step"] + 2 and max(steps) == 200
    assert all(0 < n < 48 for n in steps.values())


def test_a_joiner_of_a_task_run_catches_up_with_its_learning_rate_schedule(tmp_path):
    # The digits task has a cosine schedule: a joiner whose schedule restarted would apply
    # another learning rate, and its weights would differ from the others' at the end.
    args = [*run_args(2, 90), "--eval-every", "45", *with_replica_script(tmp_path)]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 1/", rank=3, cwd=tmp_path)
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)] == [3]
    hashes = replica_hashes("\n".join(role.output for role in roles.values()))
    assert sorted(hashes) == [1, 2, 3] and len({w for w, _ in hashes.values()}) == 1


def test_a_joiner_heard_after_the_last_boundary_is_told_that_the_run_has_ended(tmp_path):
    # The planned workers wait after the last step until the server has the joiner's HELLO: no
    # boundary is left to admit it.
    heard = tmp_path / "heard"
    (tmp_path / "train.py").write_text(held(SCRIPT, 4, heard))
    args = ["--strategy", "ps-gc", "--global-batch", "48", "--max-steps", "4", "--timeout-s", "60",
            "--code-dir", str(tmp_path), "--script", "train.py"]
    server, workers, port = start_ps_run(tmp_path, 2, args, cwd=tmp_path)
    joiner = None
    try:
        server.wait_for("[ps] step 4/")
        joiner = Role("worker", 3, 3, port, [*args, "--join"], metrics=tmp_path / "rank3.jsonl", cwd=tmp_path)
        server.wait_for("worker 3 asks to join")
        heard.touch()
        assert server.wait() == 0, server.output[-3000:]
        assert all(w.wait() == 0 for w in workers.values())
        assert joiner.wait() != 0
    finally:
        stop_all(server, *workers.values(), *([joiner] if joiner else []))
    assert not events(server.records(), EVENT_WORKER_JOINED)
    assert "the run ended after step 4, before a step boundary could admit this worker" in joiner.output


def test_a_fresh_run_waits_for_a_worker_that_starts_late_and_plans_it_from_the_first_step(tmp_path):
    # The notice comes when no worker has said HELLO for min(20 s, --start-wait-s / 2): where a
    # resumed run would have started without rank 2.
    args = [*run_args(2, 6), "--start-wait-s", "8"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="waiting up to 8 s from the start for rank(s) 2",
                                           rank=2, join=False)
    assert events(server.records(), EVENT_WORKER_JOINED) == []
    assert min(series(roles[2].records(), "batch_size", rank=2)) == 1


def test_a_fresh_run_starts_without_a_worker_missing_past_the_start_wait_and_admits_it_later(tmp_path):
    args = [*run_args(2, 60), "--start-wait-s", "2"]
    server, _ = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 1/", rank=2, join=False)
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)] == [2]


def _checkpointed(tmp_path, workers: int, steps: int) -> list[str]:
    """The flags that resume from a checkpoint of `steps` steps of a `workers`-worker run."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", str(steps)]
    first = run_cli(*run_args(workers, steps), "--workers", str(workers), *ck)
    assert first.returncode == 0, first.stderr[-3000:]
    return [*ck, "--resume"]


def test_a_resumed_run_waits_for_a_worker_that_starts_late_as_a_fresh_run_does(tmp_path):
    # A restart relaunches every rank at once, but a node may take longer than 20 s to start its
    # worker: the resumed run plans it from the first step rather than admitting it as a joiner.
    args = [*run_args(2, 6), *_checkpointed(tmp_path, 2, 3), "--start-wait-s", "8"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="waiting up to 8 s from the start for rank(s) 2",
                                           rank=2, join=False)
    assert "resumed from step 3 with 2 workers" in server.output
    assert events(server.records(), EVENT_WORKER_JOINED) == []
    assert min(series(roles[2].records(), "batch_size", rank=2)) == 4


def test_a_resumed_run_admits_a_worker_later_than_the_start_wait_as_a_joiner(tmp_path):
    # The survivors start without it once --start-wait-s is over; it joins at a step boundary.
    args = [*run_args(2, 60), *_checkpointed(tmp_path, 2, 3), "--start-wait-s", "2"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="resumed from step 3 with 1 workers", rank=2,
                                           join=False)
    assert "resumed from step 3 with 1 workers" in server.output
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)] == [2]
    assert max(series(roles[2].records(), "batch_size", rank=2)) == 60


def test_a_resumed_run_with_a_rank_gone_waits_only_for_the_ranks_it_expects(tmp_path):
    # Rank 2 of three was lost for good; the restart launches ranks 1 and 3 and names them.
    args = [*run_args(3, 6), *_checkpointed(tmp_path, 3, 3), "--start-wait-s", "60", "--expect-ranks", "1,3"]
    server, workers, _ = start_ps_run(tmp_path, 3, args, ranks=[1, 3])
    try:
        assert server.wait() == 0, server.output[-3000:]
        assert all(w.wait() == 0 for w in workers.values())
    finally:
        stop_all(server, *workers.values())
    assert "resumed from step 3 with 2 workers" in server.output
    assert "waiting up to" not in server.output


def test_a_joiner_admitted_just_before_an_evaluation_starts_after_it_without_failing_the_run(tmp_path):
    # An evaluation after every step: whenever the joiner is admitted, the others evaluate the
    # step it did not train before its first gradient. 50 steps: a joiner forked from the
    # zygote connects within a second (one that imported torch itself, on a slow 2-core host,
    # took longer than 38 steps).
    steps = 50
    args = [*DIGITS, "--strategy", "ps", "--eval-every", "1", "--timeout-s", "60", "--max-steps", str(steps),
            "--link-mbps", "10,10"]
    server, roles = run_with_a_late_worker(tmp_path, 2, args, after="[ps] step 2/", rank=3)
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_JOINED)] == [3]
    assert max(series(roles[3].records(), "batch_size", rank=3)) == steps


def test_a_run_below_min_workers_waits_then_fails_saying_why(tmp_path):
    server, workers, _ = start_ps_run(tmp_path, 2, [*run_args(2, 400), "--min-workers", "2",
                                                     "--min-workers-wait-s", "3"])
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(1.0)
        os.kill(workers[2].proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert server.wait() == EXIT_TOO_FEW_WORKERS
        waited = time.monotonic() - t0
        assert workers[1].wait() != 0
    finally:
        stop_all(server, *workers.values())
    assert waited >= 3.0
    last = server.output.strip().splitlines()[-1]
    assert "--min-workers 2" in last and "--min-workers-wait-s 3" in last, last
    assert len(events(server.records(), EVENT_WAITING)) == 1


def test_a_lost_relay_leaves_its_site_training_through_the_server(tmp_path):
    sites = ["--sites", "home,home,away,away,away"]
    server, workers, _ = start_ps_run(tmp_path, 4, [*run_args(4, 50), *sites])
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(2.0)
        os.kill(workers[2].proc.pid, signal.SIGKILL)  # the relay of site "away"
        assert server.wait() == 0, server.output[-3000:]
        for r in (1, 3, 4):
            assert workers[r].wait() == 0, server.output[-3000:] + workers[r].output[-3000:]
    finally:
        stop_all(server, *workers.values())
    assert [e["subject"] for e in events(server.records(), EVENT_WORKER_LOST)] == [2]
    for r in (3, 4):
        assert max(series(workers[r].records(), "batch_size", rank=r)) == 50


def test_a_joiner_in_a_remote_site_hears_the_update_from_its_sites_relay(tmp_path):
    # Workers 2 and 3 are "away" (2 relays to 3); worker 4 joins there mid-run. The server
    # sends it the run's state, then nothing per step: worker 2 forwards it each update.
    args = [*run_args(3, 60), "--sites", "home,home,away,away"]
    server, workers, port = start_ps_run(tmp_path, 3, args)
    try:
        server.wait_for("[ps] step 1/")
        joiner_args = [*run_args(4, 60), "--sites", "home,home,away,away,away", "--join"]
        workers[4] = Role("worker", 4, 5, port, joiner_args, metrics=tmp_path / "rank4.jsonl")
        assert server.wait() == 0, server.output[-3000:]
        for r, role in workers.items():
            assert role.wait() == 0, role.output[-3000:]
    finally:
        stop_all(server, *workers.values())
    joined = events(server.records(), EVENT_WORKER_JOINED)
    assert [e["subject"] for e in joined] == [4]
    computed = series(workers[4].records(), "batch_size", rank=4)
    assert computed and max(computed) == 60
    later = range(joined[0]["step"] + 2, 60)
    assert len(later) >= 20, joined
    server_to_4 = bytes_per_step(server.records(), rank=0, peer=4)
    relay_to_4 = bytes_per_step(workers[2].records(), rank=2, peer=4)
    to_1 = bytes_per_step(server.records(), rank=0, peer=1)
    # An update is the whole model, dense (`ps`): the relay sends it, the server only acks.
    assert all(relay_to_4.get(s, 0) >= 0.9 * to_1[s] for s in later)
    assert all(server_to_4.get(s, 0) < 0.01 * to_1[s] for s in later)


def test_a_preempted_server_checkpoints_and_exits_saying_so(tmp_path):
    ckpt = tmp_path / "ckpt"
    server, workers, _ = start_ps_run(tmp_path, 2, [*run_args(2, 400), "--checkpoint-dir", str(ckpt)])
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait() != 0
        for role in workers.values():
            assert role.wait() != 0
    finally:
        stop_all(server, *workers.values())
    assert "preempted" in server.output.strip().splitlines()[-1]
    saved = events(server.records(), EVENT_CHECKPOINT)
    assert len(saved) == 1 and (ckpt / saved[0]["detail"]).is_file()


def test_a_checkpoint_whose_worker_is_lost_before_it_answers_is_asked_of_another_at_the_next_boundary(tmp_path):
    # Rank 1, the one asked for step 5's state, dies right after step 5's update: its answer
    # would have come after step 6's gradient. Rank 2 is asked at the boundary after step 6.
    (tmp_path / "train.py").write_text(SCRIPT.replace(
        "        time.sleep(0.03)", "        time.sleep(0.03)\n        if ctx.rank == 1 and ctx.step == 5:\n"
        "            import os; os._exit(3)"))
    ckpt = tmp_path / "ckpt"
    args = ["--strategy", "ps-gc", "--global-batch", "48", "--max-steps", "8", "--timeout-s", "60",
            "--checkpoint-every", "5", "--checkpoint-dir", str(ckpt), "--code-dir", str(tmp_path),
            "--script", "train.py"]
    server, workers, _ = start_ps_run(tmp_path, 2, args, cwd=tmp_path)
    try:
        assert server.wait() == 0, server.output[-3000:]
        assert workers[2].wait() == 0, workers[2].output[-3000:]
        assert workers[1].wait() == 3
    finally:
        stop_all(server, *workers.values())
    records = server.records()
    assert [(e["subject"], e["step"]) for e in events(records, EVENT_WORKER_LOST)] == [(1, 5)]
    saved = events(records, EVENT_CHECKPOINT)
    assert [e["step"] for e in saved] == [6, 8]
    assert all((ckpt / e["detail"]).is_file() for e in saved)


# Per-site aggregation: rank 1 is in the server's site; rank 2 relays for site "away", whose
# rank 3 sends its chunks to it (pipelined in two, so a loss can fall between a step's chunks).
AGGREGATED = ["--sites", "home,home,away,away", "--aggregate-at-sites", "--pipeline-chunks", "2"]


def aggregated_run(tmp_path, hit, *, survivors: tuple[int, ...], steps: int = 60) -> list[dict]:
    """A three-worker run under per-site aggregation; `hit(workers)` once it trains. Every
    survivor and the server must exit 0; returns the server's records."""
    server, workers, _ = start_ps_run(tmp_path, 3, [*run_args(3, steps), *AGGREGATED])
    try:
        server.wait_for("[ps] step 1/")
        time.sleep(2.0)
        hit(workers)
        assert server.wait(timeout=120) == 0, server.output[-3000:]
        for r in survivors:
            assert workers[r].wait() == 0, server.output[-3000:] + workers[r].output[-3000:]
    finally:
        for role in workers.values():
            if role.proc.poll() is None:
                os.kill(role.proc.pid, signal.SIGCONT)
        stop_all(server, *workers.values())
    return server.records()


def counted_once(records: list[dict], *, lost_step: int) -> None:
    """Each step's aggregate counts every sample once: never more than the global batch (a
    chunk counted twice), and the whole batch again after the step of the loss."""
    samples = series(records, "batch_size")
    assert max(samples.values()) == 48
    assert all(n == 48 for s, n in samples.items() if s > lost_step + 1)


def test_a_killed_member_of_an_aggregating_site_is_dropped_and_its_relay_trains_on(tmp_path):
    records = aggregated_run(tmp_path, lambda w: os.kill(w[3].proc.pid, signal.SIGKILL), survivors=(1, 2))
    lost = events(records, EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [3] and "residual" in lost[0]["detail"]
    counted_once(records, lost_step=lost[0]["step"])


def test_a_silent_member_of_an_aggregating_site_is_left_out_by_its_relay_within_the_loss_deadline(tmp_path):
    stopped = []

    def freeze(workers):
        stopped.append(time.time())
        os.kill(workers[3].proc.pid, signal.SIGSTOP)

    records = aggregated_run(tmp_path, freeze, survivors=(1, 2))
    lost = events(records, EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [3]
    assert "relay 2 went on without it" in lost[0]["detail"]
    assert lost[0]["t"] - stopped[0] < 7  # the relay's half of the 2 s floor, a step, the leave grace (2 s)
    counted_once(records, lost_step=lost[0]["step"])


def test_a_member_leaving_an_aggregating_site_is_let_go_cleanly(tmp_path):
    records = aggregated_run(tmp_path, lambda w: w[3].proc.send_signal(signal.SIGTERM), survivors=(1, 2, 3))
    assert [e["subject"] for e in events(records, EVENT_WORKER_LEFT)] == [3]
    assert not events(records, EVENT_WORKER_LOST)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "silent"])
def test_a_lost_relay_of_an_aggregating_site_leaves_its_member_sending_to_the_server(tmp_path, sig):
    records = aggregated_run(tmp_path, lambda w: os.kill(w[2].proc.pid, sig), survivors=(1, 3))
    lost = events(records, EVENT_WORKER_LOST)
    assert [e["subject"] for e in lost] == [2]
    # The relay's site residual is gone with it; its member's chunks count once, whichever
    # the relay passed on before it went.
    counted_once(records, lost_step=lost[0]["step"])
