"""The data sets' part of a plan: the bytes its nodes fetch from the stores over the run, and
their egress (docs/predict.md, section 5a).

1. Readers: a node whose agent reads through a site cache fetches through it, so its site
   fetches each shard once (one reader per site); any other node fetches for itself.
2. Epochs E of each data set: max_steps * B / samples; else the run's `epochs`; else one.
3. Epochs fetched: every node reads nearly every shard of each epoch (its slice of each global
   batch spans the shards of the batch's window, hybridtrain.datasets.epoch_order), so a reader
   fetches the whole data set per epoch it fetches. A cache that holds the data set (a node
   cache whose bound is at least its size; a site cache, whose bound the control plane does not
   know) fetches the first epoch only, min(E, 1); a smaller one fetches every epoch, E (an
   upper bound: the next epoch reads the shards in a new order, so an LRU cache smaller than
   the data set keeps little of it).
4. Bytes = size * epochs fetched, priced as the store's egress to the reader's site by the
   traffic classes of gradients (`app.billing.price_reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime

from app.billing import NodeUsage, PriceLookup, Site, StoreRead, egress_usd, price_reads
from app.perfmodel.inputs import PredictError


@dataclass(frozen=True)
class DataSetSpec:
    """A data set a run reads: its store's place, its size and its samples."""

    name: str
    store: Site
    size_bytes: int
    samples: int
    shards: int = 1


@dataclass(frozen=True)
class DataCache:
    """How a node's agent reads data sets: through a site cache or not, and its node cache's bound
    in bytes (None: not reported, taken to hold any data set)."""

    site_cache: bool = False
    bytes: int | None = None


@dataclass(frozen=True)
class ReadPrediction:
    """One data set's bytes one reader (a site through its cache, or one node) fetches over the
    run, and their egress; `node_names` are the nodes it serves, the first one billed."""

    dataset: str
    site: str
    node_names: tuple[str, ...]
    via: str  # "site cache" or "node cache"
    epochs_fetched: float
    bytes: int
    traffic_class: str
    usd: float


@dataclass(frozen=True)
class DataReads:
    """Every reader's fetches of the run's data sets, and the samples the run trains on, over
    which the plan spreads their cost."""

    reads: tuple[ReadPrediction, ...] = ()
    epochs: dict[str, float] = field(default_factory=dict)
    run_samples: float = 0.0
    unpriced: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reads)

    @property
    def usd(self) -> float:
        return sum(r.usd for r in self.reads)

    @property
    def usd_per_sample(self) -> float:
        """The reads' dollars over the run's samples (0 without data sets)."""
        return self.usd / self.run_samples if self.run_samples > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready, with the totals."""
        return {"reads": [asdict(r) | {"node_names": list(r.node_names)} for r in self.reads],
                "epochs": dict(self.epochs), "run_samples": self.run_samples, "bytes": self.bytes,
                "usd": self.usd, "unpriced": list(self.unpriced), "assumptions": list(self.assumptions)}


NO_READS = DataReads()


def predict_reads(datasets: Sequence[DataSetSpec], nodes: Sequence[tuple[NodeUsage, DataCache]], *,
                  global_batch: int, max_steps: int | None, epochs: float | None, prices: PriceLookup,
                  at: datetime) -> DataReads:
    """What `nodes` (each a plan's node, once, with its agent's caches) fetch of `datasets` over a
    run of `max_steps` steps of `global_batch` (else `epochs` epochs, else one), priced at `at`."""
    if not datasets:
        return NO_READS
    if global_batch < 1:
        raise PredictError("global_batch", f"global_batch must be >= 1, got {global_batch}")
    for d in datasets:
        if d.samples < 1 or d.size_bytes < 0:
            raise PredictError("datasets", f"data set {d.name}: samples {d.samples} and size {d.size_bytes} "
                                           "must be >= 1 and >= 0")
    most = max(d.samples for d in datasets)
    if max_steps is not None:
        run_samples = float(max_steps * global_batch)
        span = f"{max_steps} steps of {global_batch} samples"
    elif epochs is not None:
        run_samples = epochs * most
        span = f"{epochs:g} epochs"
    else:
        run_samples = float(most)
        span = "one epoch (the run's length is not known)"
    readers = _readers(nodes)
    reads, unpriced, fetched = [], [], {}
    sites = {u.name: u.site for u, _ in nodes}
    for d in datasets:
        e = run_samples / d.samples
        fetched[d.name] = e
        planned = []
        for site, names, via, bound in readers:
            holds = bound is None or bound >= d.size_bytes
            n = min(e, 1.0) if holds else e
            planned.append((site, names, via, n, int(round(d.size_bytes * n))))
        costs, missing = price_reads([StoreRead(d.store, names[0], b) for _, names, _, _, b in planned],
                                     sites, prices, at)
        by_node = {c.dst: c for c in costs}
        unpriced += [m for m in missing if m not in unpriced]
        for site, names, via, n, b in planned:
            cost = by_node[names[0]]
            # Exact dollars (the link's are rounded to a micro-dollar): a run's few reads spread
            # over its samples would otherwise be off by the rounding.
            reads.append(ReadPrediction(d.name, site.name, names, via, n, b, cost.traffic_class.value,
                                        float(egress_usd(b, cost.usd_per_gb))))
    notes = [f"data sets read over {span}: {', '.join(f'{k} {v:.3g} epochs' for k, v in fetched.items())}",
             "each reader (a site's cache, else a node's) fetches the whole data set in each epoch it fetches; "
             "a cache that holds it fetches only the first"]
    if any(bound is None and via == "node cache" for _, _, via, bound in readers):
        notes.append("a node whose agent reported no cache bound is taken to hold the data sets")
    if any(via == "site cache" for _, _, via, _ in readers):
        notes.append("a site cache is taken to hold the data sets")
    return DataReads(tuple(reads), fetched, run_samples, tuple(unpriced), tuple(notes))


def _readers(nodes: Sequence[tuple[NodeUsage, DataCache]]) -> list[tuple[Site, tuple[str, ...], str, int | None]]:
    """(site, node names, via, cache bound) per reader: one per site for nodes behind a site
    cache, one per node otherwise; in the order the nodes come."""
    out: list[tuple[Site, tuple[str, ...], str, int | None]] = []
    shared: dict[Site, int] = {}
    for usage, cache in nodes:
        if not cache.site_cache:
            out.append((usage.site, (usage.name,), "node cache", cache.bytes))
        elif usage.site in shared:
            site, names, via, bound = out[shared[usage.site]]
            out[shared[usage.site]] = (site, (*names, usage.name), via, bound)
        else:
            shared[usage.site] = len(out)
            out.append((usage.site, (usage.name,), "site cache", None))
    return out


__all__ = ["DataCache", "DataReads", "DataSetSpec", "NO_READS", "ReadPrediction", "predict_reads"]
