"""The run page shows the run's events: a timeline above the charts, markers on their time
axis, and (through `EventFeed`) each new event once as it arrives."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import Run, RunStatus, RunWorker, WorkerStatus
from app.queries.events import record_event
from app.security import hash_secret, new_secret
from app.web.figures import event_markers, with_events
from app.web.live import EventFeed, event_view
from tests.app.conftest import ADMIN_TOKEN

T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


@dataclass
class Row:
    id: int
    t: datetime
    kind: str
    subject: int | None = None
    step: int | None = None
    detail: str = ""
    source: str = "trainer"


def test_an_event_is_placed_on_the_charts_time_axis_in_seconds_since_the_start():
    view = event_view(Row(7, T0 + timedelta(seconds=90), "worker_lost", subject=3, step=40), T0.timestamp())
    assert view["x"] == 90.0 and view["label"] == "worker lost: rank 3" and view["at"] == "2026-11-24T12:01:30Z"


def test_checkpoints_are_listed_but_not_drawn_over_the_charts():
    t0 = T0.timestamp()
    views = [event_view(Row(1, T0, "checkpoint"), t0), event_view(Row(2, T0, "worker_joined", subject=2), t0)]
    assert [m["name"] for m in event_markers(views)] == ["event:2"]
    figure = with_events({"data": [], "layout": {"title": "loss"}}, views)
    assert figure["layout"]["shapes"][0]["x0"] == 0.0


def test_the_event_feed_hands_out_each_new_event_once_oldest_first():
    feed = EventFeed(after_id=10, t0=T0.timestamp(), settle_s=1.0)
    late = Row(12, T0 + timedelta(seconds=5), "worker_left", subject=1)
    early = Row(11, T0 + timedelta(seconds=2), "worker_lost", subject=2)
    feed.read([early, late], now=100.0)
    first = feed.take()
    feed.read([early, late], now=100.5)  # read again before they settle: not handed out twice
    assert [e["id"] for e in first] == [11, 12] and feed.take() == [] and feed.sent == 12
    feed.read([early, late, Row(13, T0, "resumed")], now=102.0)
    assert [e["id"] for e in feed.take()] == [13] and feed.floor >= 12


def _signed_in(make_client: Callable[[str | None], TestClient]) -> TestClient:
    page = make_client(None)
    login = page.get("/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', login.text)
    assert csrf is not None
    answer = page.post("/login", data={"token": ADMIN_TOKEN, "next": "/", "csrf_token": csrf.group(1)},
                       follow_redirects=False)
    assert answer.status_code == 303, answer.text
    return page


def test_the_run_page_shows_its_timeline_and_marks_membership_changes_on_the_charts(
    session: Session, make_client: Callable[[str | None], TestClient]
):
    started = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
    run = Run(name="elastic", status=RunStatus.degraded, strategy="ps", task="hybridtrain.tasks.digits:smallcnn",
              global_batch_size=64, max_steps=100, allocation="equal", compression={},
              metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test", started_at=started,
              workers=[RunWorker(rank=r, role=role, node_name=f"n{r}", status=WorkerStatus.running, started_at=started)
                       for r, role in ((0, "ps"), (1, "worker"), (2, "worker"))])
    session.add(run)
    session.flush()
    record_event(session, run=run, kind="worker_lost", subject=2, step=40, detail="silent for 3 steps",
                 t=started + timedelta(seconds=120), source="trainer")
    record_event(session, run=run, kind="checkpoint", step=50, t=started + timedelta(seconds=150), source="trainer")
    session.commit()

    html = _signed_in(make_client).get(f"/runs/{run.id}").text

    timeline = html[html.index('id="timeline"'):html.index('id="charts"')]
    assert "worker lost: rank 2" in timeline and "silent for 3 steps" in timeline and "step 40" in timeline
    assert 'data-kind="checkpoint"' in timeline
    assert "status-degraded" in html
    figures = json.loads(re.search(r'id="run-figures">(.*?)</script>', html, re.S).group(1))  # type: ignore[union-attr]
    assert [s["x0"] for s in figures["loss"]["layout"]["shapes"]] == [120.0]
    events = json.loads(re.search(r'id="run-events">(.*?)</script>', html, re.S).group(1))  # type: ignore[union-attr]
    assert events["after"] == max(e["id"] for e in events["events"])
