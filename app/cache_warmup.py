"""A run's first epoch through cold caches, as its page and its API show it: how far the epoch
got (shards and %), and the bytes each site fetched from the store and from its site cache.

Nothing is reported for it alone. The epoch's progress is the run's step: step t has read
t * B samples of the epoch's order (trainer/loader.py), so a fraction f = t * B / samples of it,
and floor(f * shards) of the index's shards (the order reads the shards a window at a time,
hybridtrain.datasets.epoch_order). The bytes are the workers' `data_bytes` (from the store) and
`data_cache_bytes` (from the site cache) metrics, whose `peer` is the data set's id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from hybridtrain.packing import human_bytes

# The workers' metrics of bytes fetched (hybridtrain.contract.SYSTEM_METRICS).
FROM_STORE = "data_bytes"
FROM_SITE_CACHE = "data_cache_bytes"
WARMING, WARM, STOPPED = "warming", "warm", "stopped"


@dataclass(frozen=True)
class WarmupDataset:
    """A data set the run fetches from a store, as its index counted it."""

    id: int
    name: str
    shards: int
    samples: int


@dataclass(frozen=True)
class SiteReads:
    """What one site's workers fetched of a data set: from the store, and from their site cache."""

    site: str
    node_ids: tuple[int, ...]
    store_bytes: int
    site_cache_bytes: int

    @property
    def summary(self) -> str:
        nodes = ", ".join(str(i) for i in self.node_ids)
        out = f"{self.site} (node{'s' if len(self.node_ids) != 1 else ''} {nodes}): " \
              f"{human_bytes(self.store_bytes)} from the store"
        if self.site_cache_bytes:
            out += f", {human_bytes(self.site_cache_bytes)} from the site cache"
        return out


@dataclass(frozen=True)
class Warmup:
    """One data set's first epoch: warming (under way), warm (done) or stopped (the run ended
    within it), its shards read, and the bytes fetched per site."""

    dataset: str
    state: str
    shards_read: int
    shards: int
    fraction: float
    sites: tuple[SiteReads, ...] = ()

    @property
    def store_bytes(self) -> int:
        return sum(s.store_bytes for s in self.sites)

    @property
    def summary(self) -> str:
        """One line, e.g. "warming caches: 12 / 40 shards (30 %), 180.0 MiB from the store"."""
        fetched = f"{human_bytes(self.store_bytes)} from the store"
        if self.state == WARM:
            return f"caches warm: the first epoch read its {self.shards} shards, {fetched}"
        head = "warming caches" if self.state == WARMING else "the run stopped in its first epoch"
        return f"{head}: {self.shards_read} / {self.shards} shards ({self.fraction:.0%}), {fetched}"

    def to_dict(self) -> dict:
        """JSON-ready, with the lines the page shows."""
        return {"dataset": self.dataset, "state": self.state, "shards_read": self.shards_read,
                "shards": self.shards, "fraction": self.fraction, "store_bytes": self.store_bytes,
                "summary": self.summary,
                "sites": [{"site": s.site, "node_ids": list(s.node_ids), "store_bytes": s.store_bytes,
                           "site_cache_bytes": s.site_cache_bytes, "summary": s.summary} for s in self.sites]}


def warmup(datasets: Sequence[WarmupDataset], *, step: int | None, global_batch: int, active: bool,
           reads: Mapping[tuple[str, int, int], int], rank_sites: Mapping[int, tuple[str, int]]) -> list[Warmup]:
    """Each data set's first epoch after `step` steps of `global_batch` (None: none yet), with
    `reads` the bytes per (metric, rank, data set id) and `rank_sites` each worker rank's (site,
    node id); `active` while the run is in flight."""
    out = []
    for d in datasets:
        fraction = min(1.0, (step or 0) * global_batch / d.samples) if d.samples > 0 else 1.0
        state = WARM if fraction >= 1.0 else (WARMING if active else STOPPED)
        shards_read = d.shards if state == WARM else min(d.shards, math.floor(fraction * d.shards + 1e-9))
        out.append(Warmup(d.name, state, shards_read, d.shards, fraction, _sites(d.id, reads, rank_sites)))
    return out


def _sites(dataset_id: int, reads: Mapping[tuple[str, int, int], int],
           rank_sites: Mapping[int, tuple[str, int]]) -> tuple[SiteReads, ...]:
    sites: dict[str, dict] = {}
    for rank, (site, node_id) in sorted(rank_sites.items()):
        entry = sites.setdefault(site, {"nodes": [], FROM_STORE: 0, FROM_SITE_CACHE: 0})
        if node_id not in entry["nodes"]:
            entry["nodes"].append(node_id)
        for name in (FROM_STORE, FROM_SITE_CACHE):
            entry[name] += reads.get((name, rank, dataset_id), 0)
    return tuple(SiteReads(site, tuple(e["nodes"]), e[FROM_STORE], e[FROM_SITE_CACHE]) for site, e in sites.items())


@dataclass
class WarmupFeed:
    """The page's live view of the warm-up: the stored totals it started from, brought up to date
    by new metric rows; `take` hands out the view when it changed."""

    datasets: Sequence[WarmupDataset]
    global_batch: int
    rank_sites: Mapping[int, tuple[str, int]]
    step: int | None = None
    reads: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _shown: list[dict] | None = None

    def add(self, rows: Iterable[tuple[str, int, int | None, int, float | None]]) -> None:
        """Take new metric rows as (name, rank, peer, step, value)."""
        for name, rank, peer, step, value in rows:
            if name == "loss":
                self.step = max(self.step or 0, step)
            elif name in (FROM_STORE, FROM_SITE_CACHE) and peer is not None and peer >= 0 and value:
                key = (name, rank, peer)
                self.reads[key] = self.reads.get(key, 0) + int(value)

    def view(self, *, active: bool) -> list[dict]:
        return [w.to_dict() for w in warmup(self.datasets, step=self.step, global_batch=self.global_batch,
                                            active=active, reads=self.reads, rank_sites=self.rank_sites)]

    def take(self, *, active: bool) -> list[dict] | None:
        """The view if it differs from the one last handed out (or shown on the page), else None."""
        now = self.view(active=active)
        if now == self._shown:
            return None
        self._shown = now
        return now
