"""Bandwidth shaping with `tc` htb (netem, and so delay and loss, is not available here).

Where each limit lives (every direction is shaped at an egress, the only place tc can shape
without an ifb device):
1. An endpoint's link to its site: htb at `link_mbit` on the endpoint's veth (upload) and on
   the hub's port of that veth (download).
2. The WAN between sites A and B: packets from A routed into B leave the hub through B's bridge
   device; an htb class there per source site, matched on the source subnet, holds them to
   `wan_mbit(A, B)`. So each direction of a site pair is one shared pipe, like a site uplink,
   and flows of several nodes crossing it share its bandwidth. With an object store on site A,
   A's class on every other bridge is split in two leaves that borrow the whole pipe: one for
   the store's packets (matched on its address, ahead of the subnets), one for the rest; the
   first one's counters are the bytes of the store that crossed each WAN link
   (`store_bytes_by_site`).
Leaves are byte fifos holding about 20 ms of traffic (fq_codel is not available here), so a
full pipe adds tens of milliseconds of queueing, not seconds.
"""

from __future__ import annotations

import re
from typing import Any

from testbed.system import run
from testbed.topology import NODE_IFACE, Plan

# The kernel warns about htb quanta above 200000 bytes; any value above the MTU is fine here
# because each qdisc has at most one busy class per destination.
_QUANTUM = 60_000
_UNSHAPED_MBIT = 10_000.0  # the hub's own traffic on a bridge: ARP, nothing else


def _burst_bytes(mbit: float) -> int:
    # Veths hand htb GSO packets of up to 64 KiB, so a smaller bucket throttles below the rate;
    # 2 ms of traffic keeps the shaper accurate at gigabit rates with a coarse timer.
    return max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))


def _queue_bytes(mbit: float) -> int:
    # 20 ms at the rate, but room for a few GSO packets on slow links.
    return max(256 * 1024, int(mbit * 1e6 / 8 * 0.020))


def _tc(netns: str, *args: str) -> None:
    run(["ip", "netns", "exec", netns, "tc", *args])


def _rate(mbit: float) -> str:
    return f"{mbit:g}mbit"


def _htb_root(netns: str, dev: str, default_class: int) -> None:
    _tc(netns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
        "default", str(default_class))  # fmt: skip


def _htb_class(netns: str, dev: str, minor: int, mbit: float, *, parent: str = "1:",
               rate_mbit: float | None = None, leaf: bool = True) -> None:
    burst = str(_burst_bytes(mbit))
    _tc(netns, "class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}", "htb",
        "rate", _rate(rate_mbit or mbit), "ceil", _rate(mbit), "burst", burst, "cburst", burst,
        "quantum", str(_QUANTUM))  # fmt: skip
    if leaf:
        _tc(netns, "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:",
            "bfifo", "limit", str(_queue_bytes(mbit)))  # fmt: skip


def shape_link(netns: str, dev: str, mbit: float) -> None:
    """Hold everything leaving `dev` in `netns` to `mbit`."""
    _htb_root(netns, dev, 10)
    _htb_class(netns, dev, 10, mbit)


def shape_endpoints(the_plan: Plan) -> None:
    """Shape every endpoint's link to its site, both directions."""
    for ep in the_plan.endpoints:
        mbit = the_plan.site_plan(ep.site).link_mbit
        shape_link(ep.netns, NODE_IFACE, mbit)
        shape_link(the_plan.hub_netns, ep.hub_port, mbit)


def wan_class_minor(src_site_index: int) -> int:
    """The htb class on a bridge that carries traffic arriving from site `src_site_index`."""
    return 100 + src_site_index


def store_class_minor(src_site_index: int) -> int:
    """The htb leaf on a bridge that carries the object store's packets (on site `src_site_index`)."""
    # tc reads minors as hex: 0x2000+ and 0x1000+ never meet the WAN classes' 0x100-0x299.
    return 2000 + src_site_index


def _rest_class_minor(src_site_index: int) -> int:
    return 1000 + src_site_index


def shape_wan(the_plan: Plan) -> None:
    """Shape every ordered pair of sites on the destination site's bridge, by source subnet."""
    hub = the_plan.hub_netns
    store = the_plan.endpoint("store") if the_plan.config.object_store else None
    for dst in the_plan.sites:
        _htb_root(hub, dst.bridge, 99)
        _htb_class(hub, dst.bridge, 99, _UNSHAPED_MBIT)
        for src in the_plan.sites:
            if src.name == dst.name:
                continue
            minor = wan_class_minor(src.index)
            mbit = the_plan.config.wan_mbit(src.name, dst.name)
            if store is None or store.site != src.name:
                _htb_class(hub, dst.bridge, minor, mbit)
                _filter(hub, dst.bridge, "src", src.subnet, minor, prio=2)
                continue
            _htb_class(hub, dst.bridge, minor, mbit, leaf=False)
            for leaf, match in ((store_class_minor(src.index), f"{store.address}/32"),
                                (_rest_class_minor(src.index), src.subnet)):
                _htb_class(hub, dst.bridge, leaf, mbit, parent=f"1:{minor}", rate_mbit=mbit / 2)
                # The store's address at prio 1, before its subnet's filter at prio 2.
                _filter(hub, dst.bridge, "src", match, leaf, prio=1 if match.endswith("/32") else 2)


def _filter(hub: str, dev: str, field: str, match: str, minor: int, *, prio: int) -> None:
    _tc(hub, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", str(prio),
        "u32", "match", "ip", field, match, "flowid", f"1:{minor}")  # fmt: skip


def store_bytes_by_site(the_plan: Plan) -> dict[str, int]:
    """Bytes of the object store's packets (with their headers) that crossed the WAN link into
    each other site so far, as that link's shaper passed them (drops left out)."""
    store = the_plan.endpoint("store")
    src = the_plan.site_plan(store.site)
    out = {}
    for dst in the_plan.sites:
        if dst.name != src.name:
            stats = class_stats(the_plan.hub_netns, dst.bridge)
            out[dst.name] = stats.get(f"1:{store_class_minor(src.index)}", {}).get("bytes", 0)
    return out


_CLASS_RE = re.compile(r"^class htb (?P<handle>\S+) .*?rate (?P<rate>\S+)")
_SENT_RE = re.compile(r"Sent (?P<bytes>\d+) bytes \d+ pkt \(dropped (?P<drops>\d+)")


def class_stats(netns: str, dev: str) -> dict[str, dict[str, Any]]:
    """Per htb class of `dev`: its configured rate and the bytes and drops so far."""
    # This iproute2 prints no JSON for htb classes, so the text form is parsed.
    out = run(["ip", "netns", "exec", netns, "tc", "-s", "class", "show", "dev", dev])
    stats: dict[str, dict[str, Any]] = {}
    current: str | None = None
    for line in out.splitlines():
        line = line.strip()
        if m := _CLASS_RE.match(line):
            current = m["handle"]
            stats[current] = {"rate": m["rate"], "bytes": 0, "drops": 0}
        elif current and (m := _SENT_RE.match(line)):
            stats[current]["bytes"] = int(m["bytes"])
            stats[current]["drops"] = int(m["drops"])
    return stats
