"""Queries of data sets, and what a run's roles are handed to read them."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from app.config import Settings
from app.errors import DuplicateError, InUseError, InvalidFieldError, NotFoundError
from app.billing import NodeUsage
from app.cache_warmup import FROM_SITE_CACHE, FROM_STORE, WarmupDataset, WarmupFeed
from app.models import Dataset, Node, Run, RunMetric, RunStatus
from app.perfmodel.data import DataCache, DataSetSpec
from app.perfmodel.data import predict_reads as model_reads
from app.models.runs import ACTIVE_RUN_STATUSES
from app.queries.final_bills import clear_bills_reading
from app.schemas.datasets import DatasetCreate
from hybridtrain.data_access import STORE_URL, DatasetAccess, DatasetError, Origin


def store_access(settings: Settings, *, dataset_id: int, name: str, url: str) -> DatasetAccess:
    """How a node reads data set `name` at `url`, with the store's credentials from `settings`."""
    key = settings.dataset_s3_access_key_id
    secret = settings.dataset_s3_secret_access_key
    s3 = url.startswith("s3://")
    return DatasetAccess(
        id=dataset_id, name=name, url=url,
        endpoint_url=settings.dataset_s3_endpoint_url if s3 else None,
        region=settings.dataset_s3_region if s3 else None,
        access_key_id=key.get_secret_value() if s3 and key else None,
        secret_access_key=secret.get_secret_value() if s3 and secret else None,
    )


def register_dataset(session: Session, *, data: DatasetCreate, settings: Settings, created_by: str) -> Dataset:
    """Read the data set's index from its store and add its row; 422 on `url` when the index
    cannot be read (unreadable URL, missing credential, not an index). A path on the nodes is
    read here too: register it from a machine that sees the same path, or give a URL."""
    if session.scalar(select(Dataset.id).where(Dataset.name == data.name)) is not None:
        raise DuplicateError("data set", "name", data.name)
    url = data.url
    if url == STORE_URL:
        url = str(uploaded_folder(settings, data.name))
    try:
        index = Origin(store_access(settings, dataset_id=1, name=data.name, url=url)).index()
    except DatasetError as exc:
        raise InvalidFieldError("url", str(exc).replace(url, data.url)) from None
    if data.url == STORE_URL:
        for shard in index.shards:
            path = Path(url) / shard.name
            if not path.is_file() or path.stat().st_size != shard.bytes:
                raise InvalidFieldError("url", f"shard {shard.name} of the index was not uploaded whole")
    dataset = Dataset(
        name=data.name, url=data.url, format=index.format, size_bytes=index.size_bytes,
        shards=len(index.shards), samples=index.samples, store_provider=data.store_provider,
        store_continent=data.store_continent, store_region=data.store_region,
        store_zone=data.store_zone, created_by=created_by,
    )
    session.add(dataset)
    session.flush()
    return dataset


def uploaded_folder(settings: Settings, name: str) -> Path:
    """Where the control plane keeps the files uploaded for data set `name`; 422 on `url` when
    it keeps none (no dataset_dir)."""
    if settings.dataset_dir is None:
        raise InvalidFieldError("url", "this control plane keeps no data sets: set HYBRIDTRAIN_DATASET_DIR")
    return settings.dataset_dir.resolve() / name


def remove_uploaded(settings: Settings, name: str) -> None:
    """Remove the uploaded files of a deleted data set, if it had any."""
    if settings.dataset_dir is not None:
        shutil.rmtree(settings.dataset_dir.resolve() / name, ignore_errors=True)


def get_dataset(session: Session, *, name: str, field: str | None = None) -> Dataset:
    """The data set named `name`, or NotFoundError."""
    dataset = session.scalar(select(Dataset).where(Dataset.name == name))
    if dataset is None:
        raise NotFoundError("data set", name, field=field)
    return dataset


def list_datasets(session: Session, *, skip: int, limit: int) -> tuple[Sequence[Dataset], int]:
    """A page of data sets, by name."""
    rows = session.scalars(select(Dataset).order_by(Dataset.name).offset(skip).limit(limit)).all()
    return rows, session.scalar(select(func.count()).select_from(Dataset)) or 0


def dataset_in_use_by(session: Session, *, name: str) -> int | None:
    """The id of a queued or running run that reads the data set (None when none does)."""
    for run_id, names in session.execute(
        select(Run.id, Run.datasets).where(Run.status.in_(ACTIVE_RUN_STATUSES), Run.datasets.is_not(None))
    ):
        if name in (names or []):
            return int(run_id)
    return None


def delete_dataset(session: Session, *, name: str) -> Dataset:
    """Remove a data set's row (never an outside store's files); InUseError while a run reads it.
    The caller removes the files uploaded for it after the commit."""
    dataset = get_dataset(session, name=name)
    run_id = dataset_in_use_by(session, name=name)
    if run_id is not None:
        raise InUseError(f"data set {name!r} is read by run {run_id}, which has not finished")
    # The reads of the runs that used it are priced no more.
    clear_bills_reading(session, dataset=name)
    session.delete(dataset)
    return dataset


def check_run_datasets(session: Session, *, names: Sequence[str], settings: Settings) -> list[Dataset]:
    """The data sets a run request names; 422 on `datasets` for an unknown one, or one in S3
    while the control plane has no credential for S3."""
    found = []
    for name in names:
        dataset = get_dataset(session, name=name, field="datasets")
        if dataset.url.startswith("s3://") and not (
            settings.dataset_s3_access_key_id and settings.dataset_s3_secret_access_key
        ):
            raise InvalidFieldError(
                "datasets", f"data set {name!r} is in S3 and the control plane has no credential for it "
                "(HYBRIDTRAIN_DATASET_S3_ACCESS_KEY_ID, HYBRIDTRAIN_DATASET_S3_SECRET_ACCESS_KEY)")
        found.append(dataset)
    return found


def run_dataset_access(session: Session, *, run: Run, settings: Settings) -> list[DatasetAccess]:
    """What the run's roles are handed for each data set it reads (in its launch orders); an
    uploaded one is read from this control plane with the rank's own token (set per order)."""
    out = []
    for name in run.datasets or []:
        dataset = session.scalar(select(Dataset).where(Dataset.name == name))
        if dataset is None:
            continue
        access = store_access(settings, dataset_id=dataset.id, name=dataset.name, url=dataset.url)
        if dataset.url == STORE_URL:
            store_url = f"{settings.public_url.rstrip('/')}/api/v1/runs/{run.id}/datasets/{dataset.name}/files"
            access = access.model_copy(update={"store_url": store_url})
        out.append(access)
    return out


def read_from_store(dataset: Dataset) -> bool:
    """Whether a run's nodes fetch `dataset` from a store (a folder on the nodes' own disks is
    read in place: nothing fetched, nothing billed)."""
    return not (dataset.url.startswith("/") or dataset.url.startswith("file://"))


def dataset_specs(session: Session, *, names: Sequence[str]) -> list[DataSetSpec]:
    """The model's view of the named data sets that are fetched from a store (unknown names skipped)."""
    from app.queries.costs import dataset_store_site

    datasets = [d for d in (session.scalar(select(Dataset).where(Dataset.name == n)) for n in names) if d]
    return [DataSetSpec(d.name, dataset_store_site(d), d.size_bytes, d.samples, d.shards)
            for d in datasets if read_from_store(d)]


def node_data_cache(node: Node) -> DataCache:
    """How `node`'s agent said it reads data sets (its hardware report's `data_cache`); an agent
    that said nothing reads through no site cache, with its cache's bound unknown."""
    report = (node.detected_hardware or {}).get("data_cache") or {}
    bound = report.get("bytes")
    return DataCache(site_cache=bool(report.get("site_cache")), bytes=int(bound) if bound else None)


def predict_reads(session: Session, *, names: Sequence[str], node_ids: Sequence[int], global_batch: int,
                  max_steps: int | None, epochs: float | None = None,
                  at: datetime | None = None) -> list[dict[str, object]]:
    """Per data set and reader of a plan (a site's cache, else each node): the bytes fetched
    from the store over the run and their egress at the prices in force `at` (now), as
    `app.perfmodel.data.predict_reads` predicts them."""
    from app.queries.costs import billing_site
    from app.queries.price_lookups import CachedPriceLookup, DbPriceLookup

    specs = dataset_specs(session, names=names)
    nodes = session.scalars(select(Node).where(Node.id.in_(set(node_ids))).options(selectinload(Node.site))).all()
    if not specs or not nodes:
        return []
    by_id = {n.id: n for n in nodes}
    ordered = [by_id[i] for i in dict.fromkeys(node_ids) if i in by_id]
    # Only the reads are priced here: each node's site, not its own price, is needed.
    reads = model_reads(specs, [(NodeUsage(str(n.id), billing_site(n.site), 0.0), node_data_cache(n)) for n in ordered],
                        global_batch=global_batch, max_steps=max_steps, epochs=epochs,
                        prices=CachedPriceLookup(DbPriceLookup(session)), at=at or datetime.now(UTC))
    return [{"dataset": r.dataset, "node_id": int(r.node_names[0]), "node_ids": [int(n) for n in r.node_names],
             "site": r.site, "via": r.via, "epochs": r.epochs_fetched,
             "bytes": r.bytes, "traffic_class": r.traffic_class, "usd": r.usd} for r in reads.reads]


def warmup_feed(session: Session, *, run: Run, max_metric_id: int | None = None) -> WarmupFeed | None:
    """The run's first epoch through its caches as its stored metrics tell it (those with ids up
    to `max_metric_id`, where the page's live stream goes on from), or None when the run
    fetches no data set from a store (app.cache_warmup)."""
    datasets = [d for d in (session.scalar(select(Dataset).where(Dataset.name == n)) for n in run.datasets or [])
                if d is not None and read_from_store(d)]
    if not datasets:
        return None
    workers = [w for w in run.workers if w.role == "worker" and w.node_id is not None]
    nodes = {n.id: n for n in session.scalars(
        select(Node).where(Node.id.in_({w.node_id for w in workers})).options(selectinload(Node.site)))}
    rank_sites = {w.rank: (nodes[w.node_id].site.name, w.node_id) for w in workers if w.node_id in nodes}
    scope = [RunMetric.run_id == run.id]
    if max_metric_id is not None:
        scope.append(RunMetric.id <= max_metric_id)
    totals = session.execute(
        select(RunMetric.name, RunMetric.rank, RunMetric.peer, func.sum(RunMetric.value))
        .where(*scope, RunMetric.name.in_((FROM_STORE, FROM_SITE_CACHE)), RunMetric.peer >= 0)
        .group_by(RunMetric.name, RunMetric.rank, RunMetric.peer)
    )
    step = session.scalar(select(func.max(RunMetric.step)).where(*scope, RunMetric.name == "loss"))
    return WarmupFeed(
        datasets=[WarmupDataset(d.id, d.name, d.shards, d.samples) for d in datasets],
        global_batch=run.global_batch_size, rank_sites=rank_sites, step=step,
        reads={(str(name), int(rank), int(peer)): int(total or 0) for name, rank, peer, total in totals},
    )


def run_warmup(session: Session, *, run: Run, max_metric_id: int | None = None) -> list[dict] | None:
    """The run's data sets' first epoch as its page and API show it (`Warmup.to_dict`), from the
    metrics up to `max_metric_id` (all); None when it fetches none from a store or is queued."""
    if run.status == RunStatus.queued:
        return None
    feed = warmup_feed(session, run=run, max_metric_id=max_metric_id)
    return None if feed is None else feed.view(active=run.status in ACTIVE_RUN_STATUSES)
