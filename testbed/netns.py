"""Network namespaces, site bridges and veth pairs.

Layout: one hub namespace holds a bridge per site (with the site's gateway address) and routes
between sites; every endpoint (node, server pod, control plane) is a namespace with one veth
whose other end is a port of its site's bridge. Veths are created directly inside their
namespaces, so the root namespace never holds a testbed link or a testbed address.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

from testbed.system import run
from testbed.topology import NODE_IFACE, Endpoint, Plan, SitePlan

NETNS_DIR = Path("/var/run/netns")
_CLONE_NEWNET = 0x40000000


def exec_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """`argv` run inside `netns`."""
    return ["ip", "netns", "exec", netns, *argv]


def _ip(netns: str, *args: str) -> str:
    return run(["ip", "-n", netns, *args])


def _sysctl(netns: str, key: str, value: str) -> None:
    run(exec_argv(netns, ["sysctl", "-q", "-w", f"{key}={value}"]))


def create_namespace(name: str) -> None:
    """Create a namespace with its loopback up and IPv6 off (nothing here speaks it)."""
    run(["ip", "netns", "add", name])
    _ip(name, "link", "set", "lo", "up")
    _sysctl(name, "net.ipv6.conf.all.disable_ipv6", "1")
    _sysctl(name, "net.ipv6.conf.default.disable_ipv6", "1")


def delete_namespace(name: str) -> None:
    """Delete a namespace; its veths, bridges and qdiscs go with it."""
    run(["ip", "netns", "del", name], check=False)


def list_namespaces(prefix: str) -> list[str]:
    """The namespaces whose names start with `prefix`."""
    names = [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def namespace_pids(name: str) -> list[int]:
    """The processes living in namespace `name`."""
    out = run(["ip", "netns", "pids", name], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def root_links(prefix: str) -> list[str]:
    """Links of the root namespace whose names start with `prefix` (there should be none)."""
    names = []
    for line in run(["ip", "-o", "link", "show"]).splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if name.startswith(prefix):
            names.append(name)
    return names


def delete_root_link(name: str) -> None:
    """Delete a stray link from the root namespace."""
    run(["ip", "link", "del", name], check=False)


def build_hub(the_plan: Plan) -> None:
    """Give the (existing) hub namespace one bridge per site and turn on routing between them."""
    hub = the_plan.hub_netns
    _sysctl(hub, "net.ipv4.ip_forward", "1")
    for site in the_plan.sites:
        _add_bridge(hub, site)


def _add_bridge(hub: str, site: SitePlan) -> None:
    _ip(hub, "link", "add", site.bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0")
    _ip(hub, "addr", "add", f"{site.gateway}/24", "dev", site.bridge)
    _ip(hub, "link", "set", site.bridge, "up")


def attach_endpoint(the_plan: Plan, ep: Endpoint) -> None:
    """Wire an (existing) endpoint namespace to its site's bridge and give it its address."""
    site = the_plan.site_plan(ep.site)
    hub = the_plan.hub_netns
    run(
        ["ip", "link", "add", NODE_IFACE, "netns", ep.netns, "type", "veth",
         "peer", "name", ep.hub_port, "netns", hub]
    )  # fmt: skip
    _ip(hub, "link", "set", ep.hub_port, "master", site.bridge)
    _ip(hub, "link", "set", ep.hub_port, "up")
    _ip(ep.netns, "addr", "add", f"{ep.address}/24", "dev", NODE_IFACE)
    _ip(ep.netns, "link", "set", NODE_IFACE, "up")
    _ip(ep.netns, "route", "add", "default", "via", site.gateway)


class _Libc:
    setns = ctypes.CDLL(None, use_errno=True).setns


def enter(netns: str) -> None:
    """Move the calling thread into `netns` (network namespaces are per thread in Linux)."""
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if _Libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)
