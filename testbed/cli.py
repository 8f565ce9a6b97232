"""`hybridtrain testbed up|down|status|probe` and `hybridtrain bench paper`.

`register(sub)` adds both commands to the `hybridtrain` parser; handlers import lazily so
`hybridtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

_STATE_DIR_HELP = "where state files live (default var/testbed)"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `testbed` and `bench` to the `hybridtrain` parser."""
    tb = sub.add_parser("testbed", help="the in-box hybrid-cloud testbed (needs root)")
    tb_sub = tb.add_subparsers(dest="testbed_command", required=True)

    p = tb_sub.add_parser("up", help="build a testbed from a YAML config")
    p.add_argument("--config", required=True, help="e.g. bench/testbeds/paper.yaml")
    p.add_argument("--no-services", action="store_true",
                   help="only namespaces, links and cgroups: no control plane, no agents")  # fmt: skip
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_up)

    p = tb_sub.add_parser("down", help="remove a testbed (every testbed without --name)")
    p.add_argument("--name", help="the testbed's name (the config's `name`)")
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_down)

    p = tb_sub.add_parser("status", help="what a testbed is made of and how it is doing")
    p.add_argument("--name", help="the testbed's name (default: the only one up)")
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_status)

    p = tb_sub.add_parser("probe", help="measure TCP throughput between every pair of sites")
    p.add_argument("--name", help="the testbed's name (default: the only one up)")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_probe)

    bench = sub.add_parser("bench", help="benchmarks that need a testbed")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("paper", help="seed 000's comparison of five strategies (needs root)")
    p.add_argument("--config", default=None,
                   help="comma-separated testbed configs, run one after another (default "
                        "bench/testbeds/paper.yaml,bench/testbeds/intercontinental.yaml; the first for --quick)")
    p.add_argument("--workloads", default=None,
                   help="comma-separated, of widecnn, resnet18 and charlm (the character transformer of "
                        "examples/charlm with AdamW, uploaded as a bundle); default all, widecnn for --quick")
    p.add_argument("--quick", action="store_true", help="a smoke test of the whole path (under 6 minutes)")
    p.add_argument("--out", type=Path, default=Path("results.json"))
    p.add_argument("--docs", default=None,
                   help="the Markdown file whose paper section is rewritten ('-' to skip; "
                        "default docs/BENCHMARKS.md for a full run, none for --quick)")  # fmt: skip
    p.add_argument("--charts", type=Path, default=None,
                   help="a folder to write the run's charts into (HTML, and PNG with kaleido) without "
                        "rewriting any docs, e.g. for a sweep run with --docs -")
    p.add_argument("--strategies", default=None,
                   help="comma-separated subset; STRATEGY+plain runs it over unencrypted links, "
                        "a PS STRATEGY+sites with per-site aggregation, a PS STRATEGY+inforward "
                        "applying its update's later chunks during the next forward pass, "
                        "a compressing one STRATEGY+fp8 with its values sent as fp8, "
                        "STRATEGY+quotaio with each node's communication threads left on its GPU quota, "
                        "a PS STRATEGY+chunksN with its step pipelined in N chunks, a local SGD "
                        "STRATEGY+delayN applying each outer step N inner steps after its exchange began, "
                        "a local SGD STRATEGY+replicas with each site's workers one replica, "
                        "STRATEGY+async with asynchronous outer steps, STRATEGY+streaming with its outer "
                        "steps in staggered fragments, STRATEGY+hN taking N inner steps between outer steps, "
                        "diloco-gc+densityN sending N %% of each change, a local SGD STRATEGY+olrN "
                        "with an outer learning rate of N / 100 and STRATEGY+momN with an outer "
                        "momentum of N / 100; variants chain "
                        "(diloco-gc+h100+density5)")
    over = p.add_argument_group("workload overrides (default: the settings in docs/testbed.md)")
    over.add_argument("--task", type=_task, help="module:function, e.g. hybridtrain.tasks.digits:widecnn")
    over.add_argument("--task-args", type=_task_args, help='the task\'s JSON args, e.g. \'{"lr": 0.05}\'')
    over.add_argument("--global-batch", type=int)
    over.add_argument("--max-steps", type=int)
    over.add_argument("--target", type=_target, help="e.g. 'accuracy>=0.95' or 'val_loss<=0.3'")
    over.add_argument("--target-accuracy", type=_target_accuracy, dest="target",
                      help="the same as --target accuracy>=X")  # fmt: skip
    over.add_argument("--balanced-step-s", type=float,
                      help="calibrate the global batch to this balanced compute per step")
    over.add_argument("--pipeline-chunks", type=int, help="PS strategies' pipeline (1: none)")
    over.add_argument("--server-k-fraction", type=float, help="ps-gc and ps-bz-gc server k")
    over.add_argument("--seeds", type=_seeds, help="runs per strategy, seeds 0, 1, ...; results are their means")
    p.add_argument("--wan-mbit", type=_wan_mbit, default=None,
                   help="a bandwidth sweep, e.g. 10,100,1000: each testbed brought up and benchmarked "
                        "once per value with every WAN link at that many Mbit/s (derived configs "
                        "under --state-dir); default: the links as the config writes them")
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_bench_paper)

    p = bench_sub.add_parser("faults", help="one run per fault, injected at a fixed step (needs root)")
    p.add_argument("--config", default="bench/testbeds/paper.yaml")
    p.add_argument("--quick", action="store_true", help="shorter runs and outages (a smoke test)")
    p.add_argument("--faults", default=None,
                   help="comma-separated subset of: kill-worker, spot-notice, cut-link, kill-server, "
                        "kill-control-plane, restart-redis, add-worker")  # fmt: skip
    p.add_argument("--aggregate-at-sites", action="store_true",
                   help="combine the cloud site's gradients at its relay (the victim is one of its workers)")
    p.add_argument("--out", type=Path, default=Path("var/bench/faults.json"))
    p.add_argument("--docs", default=None,
                   help="the Markdown file whose fault section is rewritten ('-' to skip; "
                        "default docs/BENCHMARKS.md for a full run, none for --quick)")  # fmt: skip
    p.add_argument("--state-dir", type=Path, default=Path("var/testbed"), help=_STATE_DIR_HELP)
    p.set_defaults(func=_bench_faults)


def _seeds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 20:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 20")
    return value


def _wan_mbit(text: str) -> tuple[float, ...]:
    values: list[float] = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = 0.0
        # Below 0.0001 or from 1e6 up, `:g` writes an exponent, which a testbed's name cannot hold.
        if not (math.isfinite(value) and value > 0 and "e" not in f"{value:g}"):
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not a bandwidth: give comma-separated Mbit/s above 0 (0.0001 to 999999), "
                "e.g. 10,100,1000")
        if f"{value:g}" in {f"{v:g}" for v in values}:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is given twice")
        values.append(value)
    return tuple(values)


def _task(text: str) -> str:
    from hybridtrain.contract import check_task_ref

    try:
        return check_task_ref(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _task_args(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object, e.g. '{\"lr\": 0.05}'")
    return value


def _target(text: str) -> str:
    from hybridtrain.contract import parse_target

    try:
        parse_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    # The text as given (without blanks), not the parsed value, whose str() keeps 6 digits.
    return "".join(text.split())


def _target_accuracy(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return _target(f"accuracy>={value!r}")


def _fail(exc: Exception) -> int:
    print(f"hybridtrain: {exc}", file=sys.stderr)
    return 2


def _up(args: argparse.Namespace) -> int:
    from testbed import lifecycle
    from testbed.errors import TestbedError

    try:
        state = lifecycle.up(args.config, state_dir=args.state_dir, services=not args.no_services)
    except TestbedError as exc:
        return _fail(exc)
    print(f"testbed {state.name} is up; `hybridtrain testbed down --name {state.name}` removes it")
    for name, ep in state.endpoints.items():
        print(f"  {name:<16} {ep['role']:<13} {ep['site']:<10} {ep['address']:<14} "
              f"netns {ep['netns']:<26} {ep['cpu_cores']:.3f} cores")  # fmt: skip
    if url := state.services.get("forwarded_url"):
        print(f"  control plane: {url} (forwarded from {state.services['internal_url']})")
        print(f"  admin token in {args.state_dir / state.name / 'admin_token'}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from testbed import lifecycle
    from testbed.errors import TestbedError

    try:
        lifecycle.down(args.name, state_dir=args.state_dir)
    except TestbedError as exc:
        return _fail(exc)
    return 0


def _only_name(args: argparse.Namespace) -> str:
    from testbed.errors import TestbedError
    from testbed.state import known_names

    if args.name:
        return str(args.name)
    names = known_names(args.state_dir)
    if len(names) != 1:
        raise TestbedError(
            f"{len(names)} testbeds have state in {args.state_dir} ({', '.join(names) or 'none'}); "
            "name one with --name"
        )
    return names[0]


def _status(args: argparse.Namespace) -> int:
    from testbed import lifecycle
    from testbed.errors import TestbedError

    try:
        info = lifecycle.status(_only_name(args), state_dir=args.state_dir)
    except TestbedError as exc:
        return _fail(exc)
    print(json.dumps(info, indent=2))
    return 0


def _probe(args: argparse.Namespace) -> int:
    from testbed import probe
    from testbed.errors import TestbedError
    from testbed.state import load

    try:
        state = load(args.state_dir, _only_name(args))
        if state is None:
            raise TestbedError("no such testbed")
    except TestbedError as exc:
        return _fail(exc)
    # One endpoint per site stands for the site; a pair of endpoints in a site measures its LAN.
    by_site: dict[str, list[str]] = {}
    for name, ep in state.endpoints.items():
        by_site.setdefault(ep["site"], []).append(name)
    sites = sorted(by_site)
    print(f"{'from':<12}{'to':<12}{'Mbit/s':>10}")
    for a, b in itertools.product(sites, sites):
        src = state.endpoints[by_site[a][0]]
        if a == b:
            if len(by_site[a]) < 2:
                continue
            dst = state.endpoints[by_site[a][1]]
        else:
            dst = state.endpoints[by_site[b][0]]
        rate = probe.measure(src["netns"], dst["netns"], dst["address"], seconds=args.seconds)
        print(f"{a:<12}{b:<12}{rate:>10.1f}")
    return 0


def _bench_paper(args: argparse.Namespace) -> int:
    from bench.paper import paperbench

    return paperbench.main(args)


def _bench_faults(args: argparse.Namespace) -> int:
    from bench.paper import faults

    return faults.main(args)
