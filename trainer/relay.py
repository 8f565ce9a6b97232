"""Who carries the server's per-step update to whom: one copy per remote site, then a local hop.

The server's reply is the same frame for every worker. Sent directly, a site with several
workers behind a slow inter-site link receives that frame once per worker over the slow link
(in the paper's testbed: twice over 100 Mbit/s). Under a relay plan the server sends it once to
one worker of each remote site, the relay, which forwards the raw frame to its site's other
workers over the fast local network before decoding it itself. Workers in the server's own site
keep the direct link. Only the per-step update travels this way; the rare evaluation messages
stay direct, where they cost nothing worth saving.

Under site replicas (`--site-replicas`) every site with several workers has a relay, the
server's own too: its workers average their gradients through it every inner step
(`trainer.site_replica`), and it sends the server the site's one change per outer step.

Choice (the paper is silent): the relay is the lowest rank of its site. Forwarding costs it one
local send per peer (milliseconds at 1 Gbit/s), far less than the inter-site copy it saves.

The plan is made once, for the run's first workers (trainer.membership.Roster restricts it to
whoever is still in). If a relay is lost its peers hear the server directly from then on; a
worker that joins later in a remote site is routed behind a worker of its site with a ROUTE
frame (`Roster.relay_for`, docs/elastic.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SERVER = 0


@dataclass(frozen=True)
class RelayPlan:
    """`server_sends`: ranks the server sends the update to; `forwards`: relay rank -> its peers."""

    server_sends: tuple[int, ...]
    forwards: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def source(self, rank: int) -> int:
        """The rank that hands `rank` the update: the server or its site's relay."""
        for relay, peers in self.forwards.items():
            if rank in peers:
                return relay
        return SERVER

    def forwards_of(self, rank: int) -> tuple[int, ...]:
        """The ranks that `rank` forwards the update to (none unless it is a relay)."""
        return self.forwards.get(rank, ())


def direct_plan(workers: int) -> RelayPlan:
    """The server sends to every worker itself."""
    return RelayPlan(tuple(range(1, workers + 1)))


def plan_relay(sites: Sequence[str], workers: int, *, every_site: bool = False) -> RelayPlan:
    """The plan for ranks placed at `sites` (index = rank, 0 the server); direct without sites.
    `every_site`: the server's own site gets a relay too (site replicas: every site's workers
    average their gradients through one of them)."""
    if not sites:
        return direct_plan(workers)
    if len(sites) != workers + 1:
        raise ValueError(f"need a site for the server and each of {workers} workers, got {len(sites)}")
    by_site: dict[str, list[int]] = {}
    for rank in range(1, workers + 1):
        by_site.setdefault(sites[rank], []).append(rank)
    sends: list[int] = []
    forwards: dict[int, tuple[int, ...]] = {}
    for site, ranks in by_site.items():
        if (site == sites[SERVER] and not every_site) or len(ranks) == 1:
            sends.extend(ranks)
        else:
            sends.append(ranks[0])
            forwards[ranks[0]] = tuple(ranks[1:])
    return RelayPlan(tuple(sorted(sends)), forwards)
