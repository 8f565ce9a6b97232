"""Final bills: stored when a run and its ranks have ended, equal to the live bill, read by the
overview instead of the run's metrics, and cleared by whatever changes them later."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Connection, create_engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app import db
from app.config import Settings
from app.dispatch import Dispatcher
from app.lifecycle import Exit, end_run, rank_exited, settle_cancel
from app.models import (
    Dataset, EgressPrice, Node, NodeGpu, NodeStatus, Run, RunStatus, RunWorker, Site, WorkerStatus,
)
from app.monitor import Monitor
from app.queries.costs import run_bill
from app.queries.datasets import delete_dataset
from app.queries.events import store_trainer_events
from app.queries.final_bills import settle_final_bills, spend_of_all_runs, store_final_bills
from app.queries.gpu_models import gpu_models_by_name
from app.queries.metrics import store_metrics
from app.queries.nodes import delete_node, update_node
from app.queries.prices import create_egress_price, revise_egress_price
from app.queries.runs import get_run
from app.queries.sites import update_site
from app.schemas.nodes import NodeUpdate
from app.schemas.prices import EgressPriceCreate, EgressPriceRevision
from app.schemas.reports import TrainerEventRecord
from app.schemas.runs import MetricRecord
from app.schemas.sites import SiteUpdate
from app.security import hash_secret, new_secret
from app.web.run_data import overview, run_rows
from hybridtrain.contract import EVENT_WORKER_LEFT

GIB = 2**30
HOUR = timedelta(hours=1)


def _nodes(session: Session) -> tuple[Node, Node]:
    """An on-prem node ($0.25/h) and a spot GCP T4 node in us-west (the seeded Table 1 region)."""
    tag = uuid.uuid4().hex[:8]
    lab = Site(name=f"lab-{tag}", kind="onprem", provider="onprem", continent="asia")
    gcp = Site(name=f"gcp-{tag}", kind="cloud", provider="gcp", region="us-west", zone="us-west-a",
               continent="north_america")
    t4 = gpu_models_by_name(session, names=["T4"])["T4"]
    onprem = Node(site=lab, name=f"lab-{tag}", status=NodeStatus.online, amortised_usd_per_h=0.25,
                  join_token_hash=hash_secret(new_secret("htj_")))
    cloud = Node(site=gcp, name=f"t4-{tag}", status=NodeStatus.online, instance_type="n1-standard-8", spot=True,
                 join_token_hash=hash_secret(new_secret("htj_")), gpus=[NodeGpu(gpu_model=t4, count=1)])
    session.add_all([lab, gcp, onprem, cloud])
    session.flush()
    return onprem, cloud


def _run(session: Session, nodes: tuple[Node, Node], *, started: datetime, ended: bool = True,
         worker_status: WorkerStatus | None = None, datasets: list[str] | None = None) -> Run:
    """A ps-bz-gc run of an hour: the server on-prem, a worker in GCP sending it 2 GiB; ended
    (succeeded, both ranks too) or running."""
    onprem, cloud = nodes
    finished = started + HOUR if ended else None
    server_status = WorkerStatus.succeeded if ended else WorkerStatus.running
    statuses = (server_status, worker_status or server_status)
    run = Run(
        name="billed", status=RunStatus.succeeded if ended else RunStatus.running, strategy="ps-bz-gc",
        task="hybridtrain.tasks.digits:smallcnn", global_batch_size=64, max_steps=2, allocation="flops",
        compression={}, metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test", datasets=datasets,
        launched_at=started, started_at=started, finished_at=finished,
        workers=[
            RunWorker(rank=rank, role=role, node_id=node.id, node_name=node.name, batch_size=batch,
                      status=statuses[rank], started_at=started,
                      finished_at=None if statuses[rank] == WorkerStatus.running else finished or datetime.now(UTC))
            for rank, role, node, batch in ((0, "ps", onprem, None), (1, "worker", cloud, 64))
        ],
    )
    session.add(run)
    session.flush()
    store_metrics(session, run_id=run.id, records=[
        _record(1, "bytes_sent", GIB, step=step, t=started + step * timedelta(seconds=1), peer=0)
        for step in (1, 2)
    ])
    session.flush()
    return run


def _record(rank: int, name: str, value: float, *, step: int, t: datetime, peer: int | None = None) -> MetricRecord:
    return MetricRecord(rank=rank, role="worker" if rank else "ps", step=step, t=t.timestamp(), name=name,
                        value=value, peer=peer)


def _stored(session: Session, run: Run) -> tuple[Decimal | None, bool | None, datetime | None]:
    return tuple(session.execute(
        select(Run.billed_usd, Run.billed_unpriced, Run.billed_at).where(Run.id == run.id)
    ).one())


def _live_usd(session: Session, run: Run) -> Decimal:
    session.expire(run)
    return run_bill(session, run=get_run(session, run_id=run.id)).total_usd


@pytest.fixture
def nodes(session: Session) -> tuple[Node, Node]:
    return _nodes(session)


@pytest.fixture
def stored_run(session: Session, nodes: tuple[Node, Node]) -> Run:
    """An ended run of two hours ago whose final bill is stored."""
    run = _run(session, nodes, started=datetime.now(UTC) - 2 * HOUR)
    assert store_final_bills(session, [run], now=datetime.now(UTC)) == 1
    return run


# -- stored when final, equal to the live bill --------------------------------------------------------


def test_a_run_that_fails_stores_its_bill_as_it_ends(session: Session, nodes: tuple[Node, Node]) -> None:
    run = _run(session, nodes, started=datetime.now(UTC) - HOUR, ended=False)

    end_run(session, run=run, status=RunStatus.failed, reason="broken", now=datetime.now(UTC))

    usd, unpriced, at = _stored(session, run)
    assert at is not None and unpriced is False
    assert usd == _live_usd(session, run) > 0


def test_a_succeeded_run_waits_for_its_last_worker_before_storing_its_bill(
    session: Session, settings: Settings, nodes: tuple[Node, Node]
) -> None:
    run = _run(session, nodes, started=datetime.now(UTC) - HOUR, ended=False)
    server, worker = run.workers
    rank_exited(session, run=run, worker=server, node_name=server.node_name, exit=Exit(exit_code=0),
                settings=settings, now=datetime.now(UTC))
    assert run.status == RunStatus.succeeded
    assert _stored(session, run) == (None, None, None)  # the worker still runs, and still costs

    rank_exited(session, run=run, worker=worker, node_name=worker.node_name, exit=Exit(exit_code=0),
                settings=settings, now=datetime.now(UTC) + timedelta(minutes=1))

    assert _stored(session, run)[0] == _live_usd(session, run)


def test_a_cancelled_run_stores_its_bill_once_its_ranks_are_reported_gone(
    session: Session, nodes: tuple[Node, Node]
) -> None:
    run = _run(session, nodes, started=datetime.now(UTC) - HOUR, ended=False, worker_status=WorkerStatus.cancelled)
    run.status = RunStatus.cancelling
    run.workers[0].status, run.workers[0].finished_at = WorkerStatus.cancelled, datetime.now(UTC)

    assert settle_cancel(session, run=run, now=datetime.now(UTC))

    assert _stored(session, run)[0] == _live_usd(session, run)


def test_stored_bills_equal_live_bills_on_both_sides_of_a_price_revision(
    session: Session, nodes: tuple[Node, Node]
) -> None:
    early = _run(session, nodes, started=datetime.now(UTC) - 5 * HOUR)
    price = session.scalar(select(EgressPrice).where(
        EgressPrice.provider == "gcp", EgressPrice.traffic_class == "internet", EgressPrice.continent.is_(None)))
    revise_egress_price(session, price_id=price.id, data=EgressPriceRevision(usd_per_gb=5.0))
    late = _run(session, nodes, started=datetime.now(UTC) + timedelta(seconds=1))

    store_final_bills(session, [early, late], now=datetime.now(UTC))

    assert _stored(session, early)[0] == _live_usd(session, early)
    assert _stored(session, late)[0] == _live_usd(session, late)
    assert _stored(session, late)[0] > _stored(session, early)[0]  # each at its own start's prices


def test_a_run_still_in_flight_gets_no_stored_bill(session: Session, nodes: tuple[Node, Node]) -> None:
    run = _run(session, nodes, started=datetime.now(UTC) - HOUR, ended=False)

    assert store_final_bills(session, [run], now=datetime.now(UTC)) == 0
    assert _stored(session, run) == (None, None, None)


# -- read by the overview ---------------------------------------------------------------------------


def _statements(session: Session) -> list[tuple[str, object]]:
    """Every statement the session's connection runs from now on, with its parameters."""
    seen: list[tuple[str, object]] = []
    event.listen(session.connection(), "before_cursor_execute",
                 lambda _conn, _cursor, sql, params, _ctx, _many: seen.append((sql, params)))
    return seen


def _values(params: object) -> set[object]:
    """A statement's parameters, lists flattened."""
    values = params.values() if isinstance(params, dict) else params or ()
    return {x for v in values for x in (v if isinstance(v, list | tuple) else [v])}  # type: ignore[union-attr]


def test_the_overview_reads_stored_bills_without_summing_their_runs_metrics(
    session: Session, stored_run: Run
) -> None:
    statements = _statements(session)

    spend = overview(session)

    assert spend.spend_usd >= _stored(session, stored_run)[0] > 0
    metric_reads = [params for sql, params in statements if "run_metrics" in sql]
    assert not any(stored_run.id in _values(params) for params in metric_reads)


def test_the_spend_of_all_runs_adds_the_live_bills_of_runs_without_a_stored_one(
    session: Session, nodes: tuple[Node, Node], stored_run: Run
) -> None:
    now = datetime.now(UTC)
    before = spend_of_all_runs(session, now=now)
    live = _run(session, nodes, started=now - 3 * HOUR)  # ended, its bill not stored yet

    after = spend_of_all_runs(session, now=now)

    assert after.usd - before.usd == _live_usd(session, live)
    assert live.id in after.live and stored_run.id not in after.live


def test_the_runs_list_shows_an_ended_runs_stored_bill(session: Session, stored_run: Run) -> None:
    session.execute(Run.__table__.update().where(Run.id == stored_run.id).values(billed_usd=Decimal("1.5")))
    session.expire(stored_run)

    [row] = run_rows(session, [get_run(session, run_id=stored_run.id)])

    assert row.spend_usd == Decimal("1.5")


# -- cleared by what changes them, stored again by the liveness monitor -----------------------------------


def test_late_metrics_a_bill_sums_clear_it(session: Session, stored_run: Run) -> None:
    store_metrics(session, run_id=stored_run.id, records=[
        _record(1, "bytes_sent", GIB, step=3, t=stored_run.finished_at, peer=0)])

    assert _stored(session, stored_run) == (None, None, None)


def test_late_metrics_no_bill_sums_leave_it(session: Session, stored_run: Run) -> None:
    store_metrics(session, run_id=stored_run.id, records=[_record(1, "loss", 0.1, step=3, t=stored_run.finished_at)])

    assert _stored(session, stored_run)[2] is not None


def test_after_late_metrics_the_spend_and_the_next_stored_bill_count_them(
    session: Session, stored_run: Run
) -> None:
    now = datetime.now(UTC)
    stored_usd = _stored(session, stored_run)[0]
    before = spend_of_all_runs(session, now=now).usd
    store_metrics(session, run_id=stored_run.id, records=[
        _record(1, "bytes_sent", 10 * GIB, step=3, t=stored_run.finished_at, peer=0)])
    live = _live_usd(session, stored_run)

    assert spend_of_all_runs(session, now=now).usd - before == live - stored_usd > 0
    settle_final_bills(session, now=datetime.now(UTC), limit=1000)
    assert _stored(session, stored_run)[0] == live


def test_a_late_membership_change_clears_the_bill(session: Session, stored_run: Run) -> None:
    store_trainer_events(session, run_id=stored_run.id, records=[TrainerEventRecord(
        rank=0, role="ps", step=2, t=stored_run.finished_at.timestamp() - 60, event=EVENT_WORKER_LEFT, subject=1,
        stream="events-0", seq=1)])

    assert _stored(session, stored_run) == (None, None, None)


def test_settling_stores_only_the_bills_of_ended_runs_whose_ranks_all_ended(
    session: Session, nodes: tuple[Node, Node]
) -> None:
    ended = _run(session, nodes, started=datetime.now(UTC) - 2 * HOUR)
    straggling = _run(session, nodes, started=datetime.now(UTC) - 2 * HOUR, worker_status=WorkerStatus.running)
    running = _run(session, nodes, started=datetime.now(UTC) - HOUR, ended=False)

    settle_final_bills(session, now=datetime.now(UTC), limit=1000)

    assert _stored(session, ended)[0] == _live_usd(session, ended)
    assert _stored(session, straggling)[2] is None and _stored(session, running)[2] is None


def test_the_liveness_monitor_stores_missing_bills(
    connection: Connection, session: Session, settings: Settings, redis_url: str, nodes: tuple[Node, Node]
) -> None:
    run = _run(session, nodes, started=datetime.now(UTC) - 2 * HOUR)
    session.commit()
    factory = sessionmaker(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)

    monitor = Monitor(factory, settings, Dispatcher(redis_url))

    while monitor.settle_bills_once():
        pass

    assert _stored(session, run)[0] == _live_usd(session, run)


def test_changing_what_prices_a_node_clears_its_runs_bills(session: Session, stored_run: Run) -> None:
    update_node(session, node_id=stored_run.workers[1].node_id, data=NodeUpdate(spot=False))

    assert _stored(session, stored_run) == (None, None, None)


def test_relabelling_a_node_leaves_its_runs_bills(session: Session, stored_run: Run) -> None:
    update_node(session, node_id=stored_run.workers[1].node_id, data=NodeUpdate(labels={"rack": "7"}))

    assert _stored(session, stored_run)[2] is not None


def test_deleting_a_node_clears_its_runs_bills(session: Session, stored_run: Run) -> None:
    delete_node(session, node_id=stored_run.workers[1].node_id)

    assert _stored(session, stored_run) == (None, None, None)


def test_changing_a_site_clears_the_bills_of_the_runs_on_its_nodes(session: Session, stored_run: Run) -> None:
    cloud = session.get(Node, stored_run.workers[1].node_id)

    update_site(session, site_id=cloud.site_id, data=SiteUpdate(region="us-east"))

    assert _stored(session, stored_run) == (None, None, None)


def test_a_price_series_started_before_a_run_clears_its_bill(session: Session, stored_run: Run) -> None:
    # North America's own internet rate takes over from the any-continent row for this run.
    create_egress_price(session, data=EgressPriceCreate(
        provider="gcp", traffic_class="internet", continent="north_america", usd_per_gb=0.5,
        effective_from=stored_run.started_at - HOUR))

    assert _stored(session, stored_run) == (None, None, None)


def test_a_price_series_starting_now_leaves_ended_runs_bills(session: Session, stored_run: Run) -> None:
    create_egress_price(session, data=EgressPriceCreate(
        provider="gcp", traffic_class="internet", continent="north_america", usd_per_gb=0.5))

    assert _stored(session, stored_run)[2] is not None


def test_deleting_a_data_set_clears_the_bills_of_the_runs_that_read_it(
    session: Session, nodes: tuple[Node, Node]
) -> None:
    name = f"shards-{uuid.uuid4().hex[:6]}"
    session.add(Dataset(name=name, url="s3://bucket/shards", format="webdataset", size_bytes=GIB, shards=4,
                        samples=1000, store_provider="aws", store_continent="europe", created_by="test"))
    run = _run(session, nodes, started=datetime.now(UTC) - 2 * HOUR, datasets=[name])
    store_final_bills(session, [run], now=datetime.now(UTC))

    delete_dataset(session, name=name)

    assert _stored(session, run) == (None, None, None)


# -- on the embedded database ---------------------------------------------------------------------------


@pytest.fixture
def sqlite_session(tmp_path: Path) -> Iterator[Session]:
    """A session on a migrated SQLite file, as `hybridtrain local` runs."""
    url = f"sqlite+pysqlite:///{tmp_path}/hybridtrain.db"
    db.upgrade(url)
    engine = create_engine(url)
    try:
        with Session(engine, expire_on_commit=False) as session:
            yield session
    finally:
        engine.dispose()


def test_the_embedded_database_stores_a_final_bill_equal_to_the_live_one(sqlite_session: Session) -> None:
    run = _run(sqlite_session, _nodes(sqlite_session), started=datetime.now(UTC) - 2 * HOUR)

    store_final_bills(sqlite_session, [run], now=datetime.now(UTC))
    sqlite_session.commit()

    assert _stored(sqlite_session, run)[0] == _live_usd(sqlite_session, run) > 0


def test_the_embedded_database_clears_a_final_bill_on_late_metrics(sqlite_session: Session) -> None:
    run = _run(sqlite_session, _nodes(sqlite_session), started=datetime.now(UTC) - 2 * HOUR)
    store_final_bills(sqlite_session, [run], now=datetime.now(UTC))
    sqlite_session.commit()

    store_metrics(sqlite_session, run_id=run.id, records=[_record(1, "bytes_sent", GIB, step=3, t=run.finished_at,
                                                                  peer=0)])
    sqlite_session.commit()

    assert _stored(sqlite_session, run) == (None, None, None)


# -- races between a bill being stored and a late record, on Postgres -------------------------------------


@pytest.fixture(scope="module")
def race_url(postgres_url: str) -> Iterator[str]:
    """A migrated Postgres database of this module's own: the race needs two committing connections."""
    name = f"hybridtrain_bills_{uuid.uuid4().hex[:12]}"
    server = make_url(postgres_url)
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = server.set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    try:
        yield url
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _committed_run(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        run = _run(session, _nodes(session), started=datetime.now(UTC) - 2 * HOUR)
        session.commit()
        return run.id


def _late_bytes(factory: sessionmaker[Session], run_id: int, finished: threading.Event) -> threading.Thread:
    """A late report of 10 GiB in a thread of its own, committed as soon as it can be."""
    def report() -> None:
        with factory() as session:
            store_metrics(session, run_id=run_id, records=[
                _record(1, "bytes_sent", 10 * GIB, step=9, t=datetime.now(UTC), peer=0)])
            session.commit()
        finished.set()

    return threading.Thread(target=report)


def test_a_late_report_waits_for_a_bill_being_stored_and_then_clears_it(race_url: str) -> None:
    engine = create_engine(race_url)
    factory = sessionmaker(engine, expire_on_commit=False)
    run_id = _committed_run(factory)
    reported = threading.Event()
    with factory() as storing:
        store_final_bills(storing, [get_run(storing, run_id=run_id)], now=datetime.now(UTC))
        late = _late_bytes(factory, run_id, reported)
        late.start()
        time.sleep(0.5)
        assert not reported.is_set()  # held by the run's row lock
        storing.commit()
    late.join(timeout=10)

    with factory() as session:
        assert _stored(session, get_run(session, run_id=run_id)) == (None, None, None)
    engine.dispose()


def test_a_bill_stored_while_a_late_report_is_uncommitted_counts_it(race_url: str) -> None:
    engine = create_engine(race_url)
    factory = sessionmaker(engine, expire_on_commit=False)
    run_id = _committed_run(factory)
    with factory() as reporting:
        store_metrics(reporting, run_id=run_id, records=[
            _record(1, "bytes_sent", 10 * GIB, step=9, t=datetime.now(UTC), peer=0)])
        stored = threading.Event()

        def store() -> None:
            with factory() as session:
                store_final_bills(session, [get_run(session, run_id=run_id)], now=datetime.now(UTC))
                session.commit()
            stored.set()

        storer = threading.Thread(target=store)
        storer.start()
        time.sleep(0.5)
        assert not stored.is_set()  # waits for the report's key-share lock
        reporting.commit()
    storer.join(timeout=10)

    with factory() as session:
        run = get_run(session, run_id=run_id)
        assert _stored(session, run)[0] == run_bill(session, run=run).total_usd
        assert run_bill(session, run=run).bytes_by_class["internet"] == 12 * GIB
    engine.dispose()
