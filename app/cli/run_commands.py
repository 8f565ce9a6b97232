"""`hybridtrain runs ...`, `hybridtrain bundles ...`, `hybridtrain nodes list` and
`hybridtrain local`: the commands a CI pipeline or a laptop user runs against a control plane,
what they do and print (their flags are app/cli/run_arguments.py's; app/cli/run_flags.py makes
them request fields).

Exit status: 0 success; 1 the run failed or was cancelled (`runs create --wait`), or the
control plane refused the request; 2 bad usage; 3 `--wait` timed out; 4 unreachable (for
`--wait`: for longer than `--retry-for`); 130 Ctrl-C while waiting (the run goes on).
`runs cancel --wait` returns 0 once the run reads `cancelled` (its agents reported every role
gone), 3 if it still reads `cancelling` after `--timeout`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from app.cli.run_arguments import add_runs
from app.cli.run_flags import UsageError, pack, run_body, upload

EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4
EXIT_INTERRUPTED = 130


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `runs`, `nodes` and `local` to the `hybridtrain` parser."""
    from app.cli.inventory_commands import add_nodes_command

    handlers = {"create": _runs_create, "get": _runs_get, "show": _runs_show, "add-nodes": _runs_add_nodes,
                "list": _runs_list, "cancel": _runs_cancel, "metrics": _runs_metrics, "logs": _runs_logs}
    for name, parser in add_runs(sub).items():
        parser.set_defaults(func=handlers[name])
    add_nodes_command(sub)
    from app.cli.local import add_local_command

    add_local_command(sub)


def register_plans(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `plans optimize` to the `hybridtrain` parser (app.cli.inventory_commands)."""
    from app.cli.inventory_commands import register_plans as register

    register(sub)


def register_bundles(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `bundles list` and `bundles delete` to the `hybridtrain` parser (app.cli.inventory_commands)."""
    from app.cli.inventory_commands import register_bundles as register

    register(sub)


# -- handlers -------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from app.cli.client import HybridtrainClient
    from app.config import get_client_settings

    settings = get_client_settings()
    return HybridtrainClient(args.server or settings.url, args.token or settings.token)


def resolve_cluster(client: Any, body: dict[str, Any]) -> None:
    """Replace a `cluster_id` given by name with the cluster's id (UsageError when unknown)."""
    if isinstance(body.get("cluster_id"), str):
        from app.cli.cluster_commands import cluster_id

        body["cluster_id"] = cluster_id(client, body["cluster_id"])


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def _guard(fn: Any) -> Any:
    # A bad flag or an error of the API becomes one line on stderr and an exit status, never a
    # traceback.
    def run(args: argparse.Namespace) -> int:
        from app.cli.client import ApiError

        try:
            return int(fn(args) or 0)
        except UsageError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except ApiError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE if exc.status_code == 0 else EXIT_RUN_FAILED

    return run


def prediction_table(plans: list[dict[str, Any]]) -> str:
    """Each strategy's predicted throughput, step, granularity and cost (the data sets' reads
    spread over the run as data $/h), as a Markdown table; under it, what the reads cost."""
    rows = ["| strategy | samples/s | step s | granularity | egress $/h | compute $/h | data $/h | $/1M samples "
            "| egress share |",
            "|---|---|---|---|---|---|---|---|---|"]
    data_lines: list[str] = []
    reasons: dict[str, list[str]] = {}  # one line per reason, however many strategies share it
    for plan in plans:
        p = plan.get("prediction")
        if p is None:
            reasons.setdefault(plan.get("prediction_unavailable") or "no prediction", []).append(plan["strategy"])
            continue
        c = p["costs"]

        def num(v: Any, fmt: str) -> str:
            return "n/a" if v is None else format(v, fmt)

        rows.append(f"| {plan['strategy']} | {p['samples_per_s']:.1f} | {p['step_s']:.3f} | "
                    f"{num(p['granularity'], '.2f')} | {c['egress_usd_per_h']:.3f} | {c['compute_usd_per_h']:.3f} | "
                    f"{c.get('data_usd_per_h', 0.0):.3f} | "
                    f"{num(c['usd_per_million_samples'], '.3f')} | {num(c['egress_share'], '.0%')} |")
        if c.get("data_bytes"):
            line = (f"data sets: {c['data_bytes'] / 2**30:.3g} GB from their stores over the run, "
                    f"${c['data_usd']:.4g}")
            if line not in data_lines:
                data_lines.append(line)
    why = [f"{', '.join(strategies) if len(strategies) < len(plans) or len(plans) == 1 else 'every strategy'}: "
           f"{reason}" for reason, strategies in reasons.items()]
    return "\n".join(rows + why + data_lines)


def _plan_only(client: Any, body: dict[str, Any], args: argparse.Namespace) -> int:
    """Print the plan (every strategy's with --all-strategies); first, unless --no-profile,
    wait for the nodes that profile its task (bounded by --profile-wait)."""
    from app.cli.profile_commands import inputs_text, wait_for_profiles

    request = {**body, **({"strategies": "all"} if args.all_strategies else {})}
    if args.profile and body.get("script") is None:
        request["profile_missing"] = True
    answer, ended = wait_for_profiles(lambda: client.plan_run(request), client.plan_run(request),
                                      wait_s=args.profile_wait, out=sys.stderr)
    if args.all_strategies:
        print(prediction_table(answer["plans"]))
        inputs = inputs_text(answer["plans"][0]) if answer["plans"] else ""
        if inputs:
            print(inputs)
    else:
        _print_json(answer)
    return 0 if ended else EXIT_TIMEOUT


def _describe(run: dict[str, Any]) -> str:
    from hybridtrain.progress import status_text

    ranks = " ".join(f"{w['rank']}:{w['status']}" for w in run["workers"])
    reason = f" ({run['reason']})" if run.get("reason") else ""
    if run.get("queue_position"):
        waiting = "; ".join(run.get("waiting_for") or [])
        reason += f" (number {run['queue_position']} in the queue{': ' + waiting if waiting else ''})"
    return f"run {run['id']} {status_text(run)}{reason} [{ranks}]"


@_guard
def _runs_create(args: argparse.Namespace) -> int:
    from app.cli.client import RunTimeout

    body = run_body(args)  # every flag checked before anything is packed or sent
    packed = pack(args) if args.workdir is not None else None
    with _client(args) as client:
        resolve_cluster(client, body)
        if packed is not None:
            body["bundle_sha256"] = upload(client, packed, args.workdir)
        if args.plan_only:
            return _plan_only(client, body, args)
        run = client.create_run(body, idempotency_key=args.idempotency_key)
        print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
        if not args.wait:
            _print_json(run)
            return 0
        from app.cli.run_progress import run_progress

        progress = run_progress(client, sys.stderr)
        try:
            run = client.wait_for_run(
                run["id"], timeout_s=args.timeout, retry_for_s=args.retry_for,
                on_change=lambda r: progress.note(f"hybridtrain: {_describe(r)}"),
                on_poll=progress.poll,
                on_retry=lambda exc, pause: progress.note(f"hybridtrain: {exc}; retrying in {pause:.3g} s"),
            )
        except RunTimeout as exc:
            progress.close()
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return EXIT_TIMEOUT
        except KeyboardInterrupt:
            progress.close()
            print(f"hybridtrain: stopped waiting; run {run['id']} goes on "
                  f"(`hybridtrain runs cancel {run['id']}` stops it)", file=sys.stderr)
            return EXIT_INTERRUPTED
        finally:
            progress.close()
        _print_json(run)
        return 0 if run["status"] == "succeeded" else EXIT_RUN_FAILED


@_guard
def _runs_get(args: argparse.Namespace) -> int:
    with _client(args) as client:
        _print_json(client.get_run(args.run_id))
    return 0


@_guard
def _runs_show(args: argparse.Namespace) -> int:
    from app.cli.run_progress import describe_run

    with _client(args) as client:
        print(describe_run(client.get_run(args.run_id)))
    return 0


@_guard
def _runs_add_nodes(args: argparse.Namespace) -> int:
    with _client(args) as client:
        run = client.add_run_nodes(args.run_id, args.nodes)
    print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
    return 0


@_guard
def _runs_list(args: argparse.Namespace) -> int:
    with _client(args) as client:
        page = client.list_runs(status=args.status, limit=args.limit)
    for run in page["data"]:
        print(f"{run['id']:>6}  {run['status']:<10} {run['strategy']:<18} {run['name']}"
              + (f"  ({run['reason']})" if run.get("reason") else ""))
    return 0


@_guard
def _runs_cancel(args: argparse.Namespace) -> int:
    from app.cli.client import RunTimeout

    with _client(args) as client:
        run = client.cancel_run(args.run_id, reason=args.reason)
        print(f"hybridtrain: {_describe(run)}", file=sys.stderr)
        if args.wait and not run["status"] == "cancelled":
            try:
                # A cancelling run's roles stop within seconds: poll often.
                run = client.wait_for_run(
                    run["id"], timeout_s=args.timeout, poll_s=0.5,
                    on_change=lambda r: print(f"hybridtrain: {_describe(r)}", file=sys.stderr),
                )
            except RunTimeout as exc:
                print(f"hybridtrain: {exc}", file=sys.stderr)
                return EXIT_TIMEOUT
    _print_json(run)
    return 0


@_guard
def _runs_metrics(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.metrics(args.run_id, names=args.name, rank=args.rank, since=args.since,
                              max_points=args.max_points)
    if not args.csv:
        _print_json(data)
        return 0
    print("name,rank,peer,step,t,value")
    for series in data["series"]:
        peer = "" if series["peer"] is None else series["peer"]
        for step, t, value in series["points"]:
            print(f"{series['name']},{series['rank']},{peer},{step},{t},{'' if value is None else value}")
    return 0


@_guard
def _runs_logs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        data = client.logs(args.run_id, rank=args.rank, tail=args.tail)
    for line in data["lines"]:
        print(f"[rank {line['rank']}] {line['line']}")
    return 0


