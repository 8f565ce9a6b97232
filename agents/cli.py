"""`hybridtrain agent ...`: run a node agent, or print what it would report about this machine."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.config import AgentSettings
from agents.errors import AgentError


def build_parser() -> argparse.ArgumentParser:
    """The parser of `hybridtrain agent`; every flag overrides its environment variable."""
    parser = argparse.ArgumentParser(
        prog="hybridtrain agent",
        description="Bind this machine to a node of a hybridtrain control plane and run the "
        "trainer roles it is given. Flags override HYBRIDTRAIN_AGENT_* variables.",
    )
    parser.add_argument("--server", dest="server_url", help="control plane URL, e.g. http://cp:8000")
    parser.add_argument("--token", dest="join_token", help="the node's one-time join token")
    parser.add_argument("--state-dir", type=Path, help="where the agent keeps its token and logs")
    parser.add_argument("--broker-url", help="Celery broker (redis://... or sqla+sqlite:///...)")
    parser.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float)
    parser.add_argument("--advertise-address", help="address other nodes reach this one at")
    parser.add_argument("--concurrency", type=int, help="Celery pool threads (>= 2)")
    parser.add_argument("--kill-grace", dest="kill_grace_s", type=float,
                        help="seconds between SIGTERM and SIGKILL of a cancelled role")
    parser.add_argument("--stop-grace", dest="stop_grace_s", type=float,
                        help="seconds roles get to end when the agent gets SIGTERM (spot notice)")
    parser.add_argument("--benchmark-seconds", type=float,
                        help="length of the reference-model measurement; 0 skips it")
    parser.add_argument("--role-threads", type=int, help="OMP/MKL threads of every role")
    parser.add_argument("--trainer-command", type=json.loads,
                        help='JSON list that runs a role, default ["python", "-m", "trainer"]')
    parser.add_argument("--profile-command", type=json.loads,
                        help='JSON list that profiles a task, default ["python", "-m", "trainer.profile"]')
    parser.add_argument("--profile-lock-path", type=Path, metavar="PATH",
                        help="the host's profile lock, one file for every agent of a machine "
                             "(default <tmp>/hybridtrain-profile.lock): their profiles run one at a time")
    parser.add_argument("--probe-port", type=int,
                        help="port of the link probe server; 0 picks a free one, -1 runs none")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING, ...")
    parser.add_argument("--detect", action="store_true",
                        help="print the detected hardware (and speed) as JSON and exit")
    return parser


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    """Environment settings with the given flags laid over them."""
    overrides: dict[str, Any] = {
        key: value
        for key, value in vars(args).items()
        if value is not None and key != "detect"
    }
    return AgentSettings(**overrides)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hybridtrain agent`; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    settings = settings_from_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s agent[%(process)d] %(name)s: %(message)s",
    )
    # One line per HTTP call would drown the agent's own messages.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.detect:
        from agents.hardware import detect, measure_samples_per_s

        hw = detect(settings.server_url)
        if settings.benchmark_seconds > 0:
            hw.benchmark = measure_samples_per_s(settings.benchmark_seconds)
        print(json.dumps(hw.to_json(), indent=2))
        return 0
    from agents.agent import Agent

    try:
        return Agent(settings).run()
    except AgentError as exc:
        print(f"hybridtrain agent: {exc}", file=sys.stderr)
        return 2
