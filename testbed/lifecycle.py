"""`up`, `down` and `status` of a testbed.

`up` builds in this order, recording each thing in the state file before creating it:
1. the hub namespace and one bridge per site;
2. one namespace per endpoint, wired to its bridge, with its address and default route;
3. the shaping (endpoint links, then the WAN classes on the bridges);
4. one cgroup per endpoint with its CPU quota, under the testbed's cgroup;
5. optionally the services (control plane, broker, agents; see `services.py`).
Any failure or signal during `up` tears down what was built before the error propagates.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from testbed import cgroups, netns, processes, shaping
from testbed.errors import TestbedError
from testbed.state import (
    DEFAULT_STATE_DIR,
    TestbedState,
    known_names,
    load,
    remove,
    save,
)
from testbed.system import require_root, require_tools
from testbed.topology import (
    NODE_IFACE,
    PREFIX,
    Plan,
    check_cpu_budget,
    load_config,
    name_prefix,
    plan,
)

Log = Callable[[str], None]


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived; raised so that `finally` blocks tear the testbed down."""


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `Interrupted` (SIGINT already raises KeyboardInterrupt)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def up(
    config_path: str | Path,
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    services: bool = True,
    log: Log = print,
) -> TestbedState:
    """Build the testbed of `config_path`; on any failure, remove what was built and re-raise."""
    require_root()
    require_tools()
    the_plan = plan(load_config(config_path))
    check_cpu_budget(the_plan)
    name = the_plan.config.name
    if load(state_dir, name) is not None or netns.list_namespaces(the_plan.prefix):
        raise TestbedError(
            f"testbed {name!r} is already up (or was not torn down); "
            f"run `hybridtrain testbed down --name {name}` first"
        )
    # The previous run's database, agent tokens and logs: a new testbed starts empty (`down`
    # keeps them, for reading after a failure).
    shutil.rmtree(state_dir / name, ignore_errors=True)
    state = TestbedState(
        name=name,
        prefix=the_plan.prefix,
        config_path=str(Path(config_path).resolve()),
        cgroup=str(cgroups.group_path(the_plan.cgroup_name)),
    )
    save(state, state_dir)
    with signals_raise():
        try:
            _build(the_plan, state, state_dir, log)
            if services:
                from testbed import services as services_mod

                services_mod.start(the_plan, state, state_dir, log=log)
            state.complete = True
            save(state, state_dir)
        except BaseException:
            log(f"testbed {name}: up failed, tearing down what was built")
            down(name, state_dir=state_dir, log=log)
            raise
    return state


def _build(the_plan: Plan, state: TestbedState, state_dir: Path, log: Log) -> None:
    t0 = time.monotonic()
    for ns in [the_plan.hub_netns, *(ep.netns for ep in the_plan.endpoints)]:
        state.namespaces.append(ns)
        save(state, state_dir)
        netns.create_namespace(ns)
    netns.build_hub(the_plan)
    for ep in the_plan.endpoints:
        netns.attach_endpoint(the_plan, ep)
        state.endpoints[ep.name] = {
            "role": ep.role,
            "site": ep.site,
            "netns": ep.netns,
            "address": ep.address,
            "iface": NODE_IFACE,
            "hub_port": ep.hub_port,
            "cpu_cores": round(ep.cpu_cores, 4),
            "gpu": ep.gpu,
            "tflops": ep.tflops,
            "cgroup": str(cgroups.group_path(the_plan.cgroup_name, ep.name)),
            "host_cgroup": str(cgroups.host_group_path(the_plan.cgroup_name, ep.name)),
        }
    save(state, state_dir)
    shaping.shape_endpoints(the_plan)
    shaping.shape_wan(the_plan)
    # The testbed's own group is unlimited: it only gathers the endpoints' groups, and holds
    # the processes that run outside every endpoint (the port forwarder).
    cgroups.create(Path(state.cgroup))
    cgroups.create(Path(state.cgroup) / "host", 0)
    for ep in the_plan.endpoints:
        cgroups.create(Path(state.endpoints[ep.name]["cgroup"]), ep.cpu_cores)
        cgroups.create(Path(state.endpoints[ep.name]["host_cgroup"]), cgroups.HOST_CORES)
    log(
        f"testbed {the_plan.config.name}: {len(the_plan.sites)} sites, "
        f"{len(the_plan.endpoints)} endpoints, quotas {the_plan.total_cpu_cores:.2f} cores, "
        f"built in {time.monotonic() - t0:.1f} s"
    )


def down(name: str | None = None, *, state_dir: Path = DEFAULT_STATE_DIR, log: Log = print) -> list[str]:
    """Remove testbed `name` (every testbed when None): processes, cgroups, namespaces, links.

    Works from the state file and then sweeps by name prefix, so it also cleans up after an
    `up` that was killed before it could record what it made. Returns what it removed.
    """
    require_root()
    names = [name] if name else sorted({*known_names(state_dir), *_names_on_machine()})
    removed: list[str] = []
    for tb in names:
        removed += _down_one(tb, state_dir, log)
    return removed


def _names_on_machine() -> set[str]:
    found = {ns[len(PREFIX) :].split("-", 1)[0] for ns in netns.list_namespaces(PREFIX)}
    found |= {p.name[len(PREFIX) :] for p in cgroups.list_testbed_groups()}
    return found


def _down_one(name: str, state_dir: Path, log: Log) -> list[str]:
    prefix = name_prefix(name)
    state = load(state_dir, name)
    removed: list[str] = []
    # 1. The processes we started, gracefully and by process group, so agents stop their roles.
    records = [r for r in (state.processes if state else []) if processes.is_alive(r)]
    processes.stop_all(records)
    removed += [f"process {r.name} ({r.pid})" for r in records]
    namespaces = sorted({*(state.namespaces if state else []), *netns.list_namespaces(prefix)})
    # 2. Anything else still living in our namespaces (a trainer an agent failed to stop).
    for ns in namespaces:
        stragglers = netns.namespace_pids(ns)
        if stragglers:
            processes.kill_pids(stragglers)
            removed.append(f"{len(stragglers)} processes in {ns}")
    # 3. The cgroups, killing whatever is left in them.
    group = cgroups.group_path(f"{PREFIX}{name}")
    if group.exists():
        cgroups.remove_tree(group)
        removed.append(f"cgroup {group}")
    # 4. The namespaces; their veths, bridges and qdiscs vanish with them.
    for ns in namespaces:
        if ns in netns.list_namespaces(prefix):
            netns.delete_namespace(ns)
            removed.append(f"netns {ns}")
    # 5. Links in the root namespace should never exist; remove any that an older layout left.
    for link in netns.root_links(prefix):
        netns.delete_root_link(link)
        removed.append(f"link {link}")
    remove(state_dir, name)
    leftovers = netns.list_namespaces(prefix) + netns.root_links(prefix)
    if group.exists():
        leftovers.append(str(group))
    if leftovers:
        raise TestbedError(f"testbed {name}: could not remove {', '.join(leftovers)}")
    log(f"testbed {name}: down ({len(removed)} things removed)")
    return removed


def status(name: str, *, state_dir: Path = DEFAULT_STATE_DIR) -> dict[str, Any]:
    """What testbed `name` is made of and how it is doing: endpoints, quotas, links, processes."""
    state = load(state_dir, name)
    if state is None:
        raise TestbedError(f"no testbed {name!r} (no state file in {state_dir})")
    live_ns = set(netns.list_namespaces(state.prefix))
    endpoints = {}
    for ep_name, ep in state.endpoints.items():
        group = Path(ep["cgroup"])
        endpoints[ep_name] = {
            **{k: ep[k] for k in ("role", "site", "address", "cpu_cores", "gpu")},
            "netns_up": ep["netns"] in live_ns,
            "cpu_stat": cgroups.usage(group),
            "link": shaping.class_stats(ep["netns"], ep["iface"]) if ep["netns"] in live_ns else {},
        }
    wan = {}
    hub = f"{state.prefix}hub"
    if hub in live_ns:
        for i, site in enumerate(_site_names(state)):
            wan[site] = shaping.class_stats(hub, f"{PREFIX}br{i}")
    return {
        "name": state.name,
        "complete": state.complete,
        "config": state.config_path,
        "endpoints": endpoints,
        "wan_by_destination_site": wan,
        "processes": [
            {"name": p.name, "pid": p.pid, "alive": processes.is_alive(p), "log": p.log}
            for p in state.processes
        ],
        "services": {k: v for k, v in state.services.items() if "token" not in k},
    }


def _site_names(state: TestbedState) -> list[str]:
    config = load_config(state.config_path)
    return [s.name for s in config.sites]
