"""Links between nodes: agents' probe results, admins' declared site links, the probe orders
that measure them, and `link_estimates`, the best known bandwidth and RTT of every pair of
nodes (docs/control-plane.md, "Links")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, aliased

from app.dispatch import ProbeOrder
from app.errors import DuplicateError, InvalidFieldError, NotFoundError
from app.models import LinkMeasurement, Node, NodeStatus, SiteLink
from app.models.base import utcnow
from app.queries.sites import get_site
from app.schemas.links import LinkReport, SiteLinkCreate

log = logging.getLogger(__name__)

# What a link is assumed to be when nothing was measured or declared: a LAN inside a site,
# a modest internet path between sites.
ASSUMED_SAME_SITE = (1000.0, 0.5)
ASSUMED_CROSS_SITE = (100.0, 50.0)
# A newly registered node probes (and is probed by) at most this many others.
JOIN_PROBE_PEERS = 16
JOIN_PROBE_SECONDS = 1.0
# A probe's slot in the schedule: its bulk seconds plus the pings, the drain and the report.
PROBE_SLOT_OVERHEAD_S = 2.0


@dataclass(frozen=True)
class LinkEstimate:
    """The best known bandwidth and RTT of a link, and where they come from."""

    mbps: float
    rtt_ms: float
    source: str  # "measured" | "declared" | "assumed"
    measured_at: datetime | None = None


# -- estimates ----------------------------------------------------------------------------------


def _nodes(session: Session, node_ids: Sequence[int]) -> dict[int, Node]:
    found = {n.id: n for n in session.scalars(select(Node).where(Node.id.in_(set(node_ids))))}
    for i, node_id in enumerate(node_ids):
        if node_id not in found:
            raise NotFoundError("node", node_id, field=f"node_ids.{i}")
    return found


def newest_measurements(
    session: Session, *, node_ids: Sequence[int]
) -> dict[tuple[int, int], LinkMeasurement]:
    """The newest probe of every measured ordered pair among `node_ids`."""
    ids = set(node_ids)
    ranked = (
        select(
            LinkMeasurement,
            func.row_number()
            .over(
                partition_by=(LinkMeasurement.src_node_id, LinkMeasurement.dst_node_id),
                order_by=(LinkMeasurement.measured_at.desc(), LinkMeasurement.id.desc()),
            )
            .label("rank"),
        )
        .where(LinkMeasurement.src_node_id.in_(ids), LinkMeasurement.dst_node_id.in_(ids))
        .subquery()
    )
    newest = aliased(LinkMeasurement, ranked)
    rows = session.scalars(select(newest).where(ranked.c.rank == 1)).all()
    return {(m.src_node_id, m.dst_node_id): m for m in rows}


def link_estimates(
    session: Session, *, node_ids: Sequence[int]
) -> dict[tuple[int, int], LinkEstimate]:
    """Every ordered pair (src, dst) of distinct nodes among `node_ids`, estimated from:

    1. the newest probe src -> dst, else
    2. the newest probe dst -> src (links are usually symmetric), else
    3. an admin's site link declared from src's site to dst's, else the reverse one, else
    4. an assumption: 1000 Mbit/s and 0.5 ms inside a site, 100 Mbit/s and 50 ms between sites.

    NotFoundError names `node_ids.N` for an unknown node.
    """
    nodes = _nodes(session, node_ids)
    measured = newest_measurements(session, node_ids=list(nodes))
    sites = {n.site_id for n in nodes.values()}
    declared = {
        (s.src_site_id, s.dst_site_id): s
        for s in session.scalars(
            select(SiteLink).where(SiteLink.src_site_id.in_(sites), SiteLink.dst_site_id.in_(sites))
        )
    }
    out: dict[tuple[int, int], LinkEstimate] = {}
    for src in nodes.values():
        for dst in nodes.values():
            if src.id == dst.id:
                continue
            probe = measured.get((src.id, dst.id)) or measured.get((dst.id, src.id))
            if probe is not None:
                out[src.id, dst.id] = LinkEstimate(probe.mbps, probe.rtt_ms, "measured", probe.measured_at)
                continue
            site_link = declared.get((src.site_id, dst.site_id)) or declared.get((dst.site_id, src.site_id))
            if site_link is not None:
                out[src.id, dst.id] = LinkEstimate(site_link.mbps, site_link.rtt_ms, "declared")
                continue
            mbps, rtt = ASSUMED_SAME_SITE if src.site_id == dst.site_id else ASSUMED_CROSS_SITE
            out[src.id, dst.id] = LinkEstimate(mbps, rtt, "assumed")
    return out


# -- measurements -------------------------------------------------------------------------------


def record_results(session: Session, *, node: Node, report: LinkReport) -> list[LinkMeasurement]:
    """Store the links that `node`'s agent measured; the failures are only logged.

    PermissionError when the report claims another source node; NotFoundError naming
    `results.N.dst_node_id` for an unknown destination.
    """
    if report.src_node_id is not None and report.src_node_id != node.id:
        raise PermissionError(
            f"src_node_id: the agent of node {node.id} may only report its own links, "
            f"not node {report.src_node_id}'s"
        )
    dst_ids = {r.dst_node_id for r in report.results}
    known = set(session.scalars(select(Node.id).where(Node.id.in_(dst_ids)))) if dst_ids else set()
    now = utcnow()
    rows = []
    for i, result in enumerate(report.results):
        where = f"results.{i}.dst_node_id"
        if result.dst_node_id not in known:
            raise NotFoundError("node", result.dst_node_id, field=where)
        if result.dst_node_id == node.id:
            raise InvalidFieldError(where, f"node {node.id} cannot measure a link to itself")
        rows.append(LinkMeasurement(
            src_node_id=node.id, dst_node_id=result.dst_node_id, mbps=result.mbps,
            rtt_ms=result.rtt_ms, bytes=result.bytes, seconds=result.seconds, measured_at=now,
        ))
    session.add_all(rows)
    for failure in report.errors:
        log.warning("node %s could not probe node %s: %s", node.id, failure.dst_node_id, failure.error)
    session.flush()
    return rows


def list_measurements(
    session: Session, *, node_id: int | None, skip: int = 0, limit: int = 100
) -> tuple[Sequence[LinkMeasurement], int]:
    """Probes from or to `node_id` (all when None), newest first, and how many there are."""
    where = []
    if node_id is not None:
        where.append(or_(LinkMeasurement.src_node_id == node_id, LinkMeasurement.dst_node_id == node_id))
    count = session.scalar(select(func.count()).select_from(LinkMeasurement).where(*where)) or 0
    rows = session.scalars(
        select(LinkMeasurement).where(*where)
        .order_by(LinkMeasurement.measured_at.desc(), LinkMeasurement.id.desc())
        .offset(skip).limit(limit)
    ).all()
    return rows, count


# -- probe orders -------------------------------------------------------------------------------


def probe_port(node: Node) -> int | None:
    """The port of the node's probe server as its agent reported it, if any."""
    port = (node.detected_hardware or {}).get("probe_port")
    return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None


def _target(node: Node) -> dict[str, Any]:
    return {"node_id": node.id, "host": node.address, "port": probe_port(node)}


def probe_rounds(pairs: Sequence[tuple[int, int]], site_of: dict[int, int]) -> list[list[tuple[int, int]]]:
    """The directed probes `pairs` (src, dst) in rounds that share no link: in a round every
    node is in at most one probe (so a link is measured one direction at a time and a node's
    own link carries one probe), and two sites exchange at most one probe (their pipe carries
    one). Greedy, in the given order; links between sites first, the slow ones to measure."""
    remaining = sorted(pairs, key=lambda p: site_of[p[0]] == site_of[p[1]])
    rounds: list[list[tuple[int, int]]] = []
    while remaining:
        busy_nodes: set[int] = set()
        busy_sites: set[frozenset[int]] = set()
        this, later = [], []
        for src, dst in remaining:
            sites = frozenset((site_of[src], site_of[dst]))
            crossing = len(sites) == 2
            if src in busy_nodes or dst in busy_nodes or (crossing and sites in busy_sites):
                later.append((src, dst))
                continue
            this.append((src, dst))
            busy_nodes |= {src, dst}
            if crossing:
                busy_sites.add(sites)
        rounds.append(this)
        remaining = later
    return rounds


def _scheduled_orders(probers: Sequence[Node], targets: Sequence[Node], seconds: float) -> list[ProbeOrder]:
    """One order per prober, its targets in the order of `probe_rounds`, each with its round and
    the wall-clock time its slot starts (`start_at`, epoch seconds, for `agents.probe.wait_for_slot`).
    An agent probes its targets in turn and is in one probe at a time (agents.probe), so even
    one that starts a slot late keeps both directions of a link apart."""
    by_id = {n.id: n for n in [*probers, *targets]}
    pairs = [(p.id, t.id) for p in probers for t in targets if t.id != p.id]
    rounds = probe_rounds(pairs, {i: n.site_id for i, n in by_id.items()})
    start = utcnow().timestamp()
    slot = seconds + PROBE_SLOT_OVERHEAD_S
    mine: dict[int, list[dict[str, Any]]] = {p.id: [] for p in probers}
    for r, pairs_in_round in enumerate(rounds):
        for src, dst in pairs_in_round:
            mine[src].append(_target(by_id[dst]) | {"round": r, "start_at": round(start + r * slot, 3)})
    return [ProbeOrder(node_id=p.id, spec={"targets": mine[p.id], "seconds": seconds})
            for p in probers if mine[p.id]]


def _why_not_target(node: Node) -> str | None:
    if node.status != NodeStatus.online:
        return f"node {node.name} is {node.status}"
    if not node.address:
        return f"node {node.name} has no address"
    if probe_port(node) is None:
        return f"node {node.name} advertises no probe port (its agent runs no probe server)"
    return None


def probe_orders(
    session: Session, *, node_ids: Sequence[int], seconds: float
) -> tuple[list[ProbeOrder], list[dict[str, Any]]]:
    """Orders for every given online node to probe every other given node that can be probed,
    scheduled in rounds that share no link (`probe_rounds`), and the nodes skipped, each with
    the reason.

    InvalidFieldError (`node_ids`) for fewer than two distinct nodes; NotFoundError naming
    `node_ids.N` for an unknown one.
    """
    distinct = list(dict.fromkeys(node_ids))
    if len(distinct) < 2:
        raise InvalidFieldError("node_ids", "give at least 2 distinct nodes: a link has two ends")
    nodes = _nodes(session, node_ids)
    ordered = [nodes[i] for i in distinct]
    skipped: list[dict[str, Any]] = []
    targets: list[Node] = []
    for node in ordered:
        reason = _why_not_target(node)
        if reason is None:
            targets.append(node)
        elif node.status == NodeStatus.online:
            skipped.append({"node_id": node.id, "reason": f"{reason}: it probes the others but is not probed"})
        else:
            skipped.append({"node_id": node.id, "reason": f"{reason}: it neither probes nor is probed"})
    probers = []
    for node in ordered:
        if node.status != NodeStatus.online:
            continue
        if not any(t.id != node.id for t in targets):
            skipped.append({"node_id": node.id, "reason": f"node {node.name} has no other node to probe"})
            continue
        probers.append(node)
    return _scheduled_orders(probers, targets, seconds), skipped


def join_probe_orders(session: Session, *, node: Node) -> list[ProbeOrder]:
    """Probes between a newly joined node and up to JOIN_PROBE_PEERS other online nodes, both
    ways; the peers are taken from as many sites as possible."""
    newest_first = (Node.last_heartbeat.desc().nulls_last(), Node.id)
    # At most JOIN_PROBE_PEERS per site can be chosen: a fleet joining at once must not load
    # every node for each one that joins.
    ranked = (
        select(Node.id, func.row_number().over(partition_by=Node.site_id, order_by=newest_first).label("rank"))
        .where(
            Node.id != node.id, Node.status == NodeStatus.online, Node.address.is_not(None),
            Node.detected_hardware["probe_port"].is_not(None),
        )
        .subquery()
    )
    peers = session.scalars(
        select(Node).join(ranked, ranked.c.id == Node.id).where(ranked.c.rank <= JOIN_PROBE_PEERS).order_by(*newest_first)
    ).all()
    peers = [p for p in peers if probe_port(p) is not None]
    # One node per site in turn, so a few peers already cover many site pairs.
    by_site: dict[int, list[Node]] = {}
    for peer in peers:
        by_site.setdefault(peer.site_id, []).append(peer)
    chosen: list[Node] = []
    while len(chosen) < JOIN_PROBE_PEERS and any(by_site.values()):
        for queue in by_site.values():
            if queue and len(chosen) < JOIN_PROBE_PEERS:
                chosen.append(queue.pop(0))
    if not chosen:
        return []
    orders = [ProbeOrder(node_id=node.id, spec={
        "targets": [_target(p) for p in chosen], "seconds": JOIN_PROBE_SECONDS,
    })]
    if _why_not_target(node) is None:
        orders += [
            ProbeOrder(node_id=p.id, spec={"targets": [_target(node)], "seconds": JOIN_PROBE_SECONDS})
            for p in chosen
        ]
    return orders


# -- declared site links ------------------------------------------------------------------------


def list_site_links(session: Session) -> tuple[Sequence[SiteLink], int]:
    """Every declared site link, by id."""
    rows = session.scalars(select(SiteLink).order_by(SiteLink.id)).all()
    return rows, len(rows)


def create_site_link(session: Session, *, data: SiteLinkCreate, created_by: str) -> SiteLink:
    """Declare the link from one site to another (both ways unless the reverse is declared)."""
    get_site(session, site_id=data.src_site_id, field="src_site_id")
    get_site(session, site_id=data.dst_site_id, field="dst_site_id")
    clash = session.scalar(select(SiteLink).where(
        SiteLink.src_site_id == data.src_site_id, SiteLink.dst_site_id == data.dst_site_id,
    ))
    if clash is not None:
        raise DuplicateError(
            "site link", "src_site_id, dst_site_id", (data.src_site_id, data.dst_site_id),
            within=f"(id {clash.id}; delete it to declare it anew)",
        )
    link = SiteLink(
        src_site_id=data.src_site_id, dst_site_id=data.dst_site_id, mbps=data.mbps,
        rtt_ms=data.rtt_ms, created_by=created_by,
    )
    session.add(link)
    session.flush()
    return link


def delete_site_link(session: Session, *, site_link_id: int) -> None:
    """Remove a declared site link."""
    link = session.get(SiteLink, site_link_id)
    if link is None:
        raise NotFoundError("site link", site_link_id)
    session.delete(link)
    session.flush()
