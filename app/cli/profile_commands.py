"""`hybridtrain profiles list|request`, and what plans print about profiles: the wait while
nodes profile a plan's task, and how old and how noisy each input of a plan is (exit statuses
as in app.cli.run_commands)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from app.cli.inventory_commands import _node_id
from app.perfmodel.provenance import age_text, input_lines, noise_text, since_s
from app.cli.run_arguments import connection_args
from app.cli.run_commands import (
    EXIT_RUN_FAILED, EXIT_TIMEOUT, _client, _guard, _print_json, resolve_cluster,
)
from app.cli.run_flags import (
    UsageError, add_code_flags, bundle_flag, cluster_ref, code_bundle, ids, task_args_flag, task_flag,
)
from hybridtrain.option_flags import add_option

# How long a plan waits for its nodes' profiles by default: a profile is 2-4 runs of the
# profiler, one host at a time, each a few seconds to a minute on a CPU.
PROFILE_WAIT_S = 900.0
POLL_S = 2.0
# A progress line at least this often while nothing changes.
NOTE_EVERY_S = 15.0


def register_profiles(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `profiles list` and `profiles request` to the `hybridtrain` parser."""
    profiles = sub.add_parser("profiles", help="task profiles: each node's measured speed on a task, for plans")
    profiles_sub = profiles.add_subparsers(dest="profiles_command", required=True)

    ls = profiles_sub.add_parser("list", help="profiles, newest first: status, samples/s, spread, age")
    connection_args(ls)
    ls.add_argument("--node", default=None, help="only this node (id or name)")
    # Here the task is a filter: left out, every task's profiles, not the default task's.
    add_option(ls, "task", note="only this task's profiles, by default every task's (--task-args and --bundle "
                                "narrow it)")
    add_option(ls, "task_args", note="with --task: only the profiles of the task with these")
    ls.add_argument("--bundle", default=None, metavar="SHA256")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_profiles_list)

    request = profiles_sub.add_parser("request", help="ask nodes' agents to measure a task (prints the profiles)")
    connection_args(request)
    where = request.add_mutually_exclusive_group(required=True)
    where.add_argument("--nodes", type=ids, help="node ids, e.g. 1,2,3")
    where.add_argument("--cluster", type=cluster_ref, help="a cluster id or name")
    add_option(request, "task")
    add_option(request, "task_args")
    add_code_flags(request)
    request.add_argument("--batch-size", type=int, default=None, help="the batch each node measures (default 32)")
    add_option(request, "device", note="here where each node measures the task")
    request.add_argument("--wait", action="store_true", help="wait until every profile has ended")
    request.add_argument("--timeout", type=float, default=PROFILE_WAIT_S, help="seconds to --wait at most")
    request.add_argument("--json", action="store_true")
    request.set_defaults(func=_profiles_request)


def add_plan_profile_flags(parser: argparse.ArgumentParser) -> None:
    """`--no-profile` and `--profile-wait` of the commands that print a plan's numbers."""
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="do not ask nodes without a profile of the task to measure it")
    parser.add_argument("--profile-wait", type=float, default=PROFILE_WAIT_S, metavar="SECONDS",
                        help=f"wait this long for the nodes' profiles (default {PROFILE_WAIT_S:g}; 0: do not wait)")


# -- printing -------------------------------------------------------------------------------------


def inputs_text(plan: dict[str, Any], *, now: datetime | None = None) -> str:
    """How old and how noisy each input of `plan` is: its nodes' profiles and its links."""
    lines = input_lines(plan, now=now)
    return "inputs:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def profiling_of(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes a plan answer (one plan, a plan set, or optimize's) waits on."""
    if "plans" in answer:
        plans = answer["plans"]
        return list(plans[0].get("profiling") or []) if plans else []
    if "plan" in answer:
        return list(answer["plan"].get("profiling") or [])
    return list(answer.get("profiling") or [])


def _waiting_text(profiling: list[dict[str, Any]], waited_s: float) -> str:
    pending = [p for p in profiling if p["status"] == "pending"]
    names = ", ".join(f"{p['node_name']} (id {p['node_id']})" for p in pending)
    return (f"hybridtrain: profiling the task on {len(pending)} node(s): {names}; "
            f"{waited_s:.0f} s so far (one profile at a time per host, repeated until stable)")


def _pause(seconds: float) -> None:
    # The wait between polls, looked up at each call: the CLI tests let an agent report here.
    time.sleep(seconds)


def wait_for_profiles(
    ask: Callable[[], dict[str, Any]], answer: dict[str, Any], *, wait_s: float, out: TextIO,
    poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
) -> tuple[dict[str, Any], bool]:
    """Ask again every `poll_s` while any node is still profiling, at most `wait_s`; the last
    answer, and whether nothing is pending any more. Progress goes to `out`."""
    start = clock()
    last_note = -NOTE_EVERY_S
    last_pending: list[int] | None = None
    told: set[int] = set()
    while True:
        profiling = profiling_of(answer)
        pending = sorted(p["node_id"] for p in profiling if p["status"] == "pending")
        waited = clock() - start
        for failed in (p for p in profiling if p["status"] == "failed"):
            if failed["node_id"] not in told:
                told.add(failed["node_id"])
                print(f"hybridtrain: the profile of node {failed['node_name']} (id {failed['node_id']}) "
                      f"failed: {failed.get('error') or 'no reason given'}", file=out)
        if not pending:
            if last_pending:
                print(f"hybridtrain: profiled in {waited:.0f} s", file=out)
            return answer, True
        if pending != last_pending or waited - last_note >= NOTE_EVERY_S:
            print(_waiting_text(profiling, waited), file=out, flush=True)
            last_note, last_pending = waited, pending
        if waited >= wait_s:
            print(f"hybridtrain: still profiling after {waited:.0f} s; the plan below has no numbers for "
                  "those nodes yet: ask again later (`hybridtrain profiles list`)", file=out)
            return answer, False
        _pause(min(poll_s, max(0.0, wait_s - waited)))
        answer = ask()


# -- handlers ---------------------------------------------------------------------------------------


def _task_key_filter(client: Any, args: argparse.Namespace) -> str | None:
    task = task_flag(args.task)
    if task is None:
        if args.task_args is not None or args.bundle is not None:
            raise UsageError("--task-args and --bundle narrow --task: give --task too")
        return None
    from app.queries.profiles import task_key

    return task_key(task, task_args_flag(args.task_args) or {}, bundle_flag(args.bundle))


def _profile_line(p: dict[str, Any], now: datetime) -> str:
    rate = "-" if p.get("samples_per_s") is None else f"{p['samples_per_s']:.1f}"
    if p["status"] == "done":
        by_run = str(p.get("created_by") or "").startswith("run ")
        state = f"{rate} samples/s {noise_text(p.get('spread'), p.get('repeats'), unit='steps' if by_run else 'runs')}, " \
                f"measured {age_text(since_s(p.get('measured_at'), now))}" + (f" by {p['created_by']}" if by_run else "")
    elif p["status"] == "pending":
        state = f"measuring, asked {age_text(since_s(p.get('created_at'), now))}"
    else:
        state = f"failed: {((p.get('error') or '?').strip().splitlines() or ['?'])[-1]}"
    task = p["task"] + (f" {p['task_args']}" if p.get("task_args") else "")
    return f"{p['id']:>5}  node {p['node_id']:<4} {p['status']:<8} {task}  {state}"


@_guard
def _profiles_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        key = _task_key_filter(client, args)
        node = _node_id(client, args.node) if args.node is not None else None
        page = client.list_profiles(task_key=key, node_id=node)
    if args.json:
        _print_json(page)
        return 0
    rows = page["data"][: max(0, args.limit)]
    if not rows:
        print("hybridtrain: no profile yet; `hybridtrain profiles request --task MOD:FN --nodes 1,2` "
              "asks for some (plans ask for them too)", file=sys.stderr)
    now = datetime.now(UTC)
    for p in rows:
        print(_profile_line(p, now))
    return 0


@_guard
def _profiles_request(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    for key, value in [("task", task_flag(args.task)), ("task_args", task_args_flag(args.task_args)),
                       ("batch_size", args.batch_size),
                       ("device", args.device)]:
        if value is not None:
            body[key] = value
    with _client(args) as client:
        if args.nodes is not None:
            body["node_ids"] = args.nodes
        else:
            holder = {"cluster_id": args.cluster}
            resolve_cluster(client, holder)
            body["node_ids"] = client.get_cluster(holder["cluster_id"])["node_ids"]
        if (sha256 := code_bundle(client, args)) is not None:
            body["bundle_sha256"] = sha256
        profiles = client.create_profiles(body)
        ended = True
        if args.wait:
            ids_ = [p["id"] for p in profiles]

            def ask() -> dict[str, Any]:
                current = [client.get_profile(i) for i in ids_]
                return {"profiling": [{"node_id": p["node_id"], "node_name": f"node {p['node_id']}",
                                       "status": p["status"], "error": p.get("error")} for p in current],
                        "profiles": current}

            answer, ended = wait_for_profiles(ask, ask(), wait_s=args.timeout, out=sys.stderr)
            profiles = answer["profiles"]
    if args.json:
        _print_json(profiles)
    else:
        now = datetime.now(UTC)
        for p in profiles:
            print(_profile_line(p, now))
    if not ended:
        return EXIT_TIMEOUT
    return EXIT_RUN_FAILED if any(p["status"] == "failed" for p in profiles) else 0
