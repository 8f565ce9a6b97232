"""How long each node was part of a run, from its ranks' starts and ends and the run's
membership events: a node is billed only while one of its ranks belonged to the run.

A rank belongs from its start (or, when it joins at a step boundary, from that join) until it
is lost, leaves or ends; a later join opens a new span. A node's time is the union of its
ranks' spans, so a server and a worker on one node bill the node once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from hybridtrain.contract import EVENT_WORKER_JOINED, EVENT_WORKER_LEFT, EVENT_WORKER_LOST

MEMBERSHIP_KINDS = frozenset({EVENT_WORKER_JOINED, EVENT_WORKER_LEFT, EVENT_WORKER_LOST})

Span = tuple[datetime, datetime]


@dataclass(frozen=True)
class MembershipChange:
    """A rank joined, left or was lost at `t` (a run event whose subject is that rank)."""

    t: datetime
    kind: str


def rank_spans(
    started: datetime | None,
    finished: datetime | None,
    changes: Iterable[MembershipChange],
    *,
    end: datetime,
) -> list[Span]:
    """The spans in which one rank was part of the run, in time order.

    `started` and `finished` are its role's start and end (None: not started, still running);
    `end` closes what is still open (the run's end, or now for a live bill).
    """
    marks: list[tuple[datetime, int, str]] = []
    if started is not None:
        marks.append((started, 0, "start"))
    # At one instant a loss closes before a join opens: a rank re-admitted at once stays in.
    order = {EVENT_WORKER_LOST: 1, EVENT_WORKER_LEFT: 1, EVENT_WORKER_JOINED: 2}
    marks.extend((c.t, order[c.kind], c.kind) for c in changes if c.kind in order)
    closing = finished if finished is not None else end
    marks.sort(key=lambda m: (m[0], m[1]))

    spans: list[Span] = []
    opened: datetime | None = None
    opened_by_start = False
    for t, _, kind in marks:
        if t > closing:
            break
        if kind == "start":
            if opened is None:
                opened, opened_by_start = t, True
        elif kind == EVENT_WORKER_JOINED:
            if opened is None:
                opened, opened_by_start = t, False
            elif opened_by_start:
                # Started, then admitted at a step boundary: it belongs from the admission.
                opened, opened_by_start = t, False
        elif opened is not None:  # lost or left
            spans.append((opened, t))
            opened = None
    if opened is not None and closing > opened:
        spans.append((opened, closing))
    return [(a, b) for a, b in spans if b > a]


def union_seconds(spans: Sequence[Span]) -> float:
    """Seconds covered by at least one of `spans` (overlaps count once)."""
    total = 0.0
    current: Span | None = None
    for a, b in sorted(spans):
        if current is None or a > current[1]:
            if current is not None:
                total += (current[1] - current[0]).total_seconds()
            current = (a, b)
        elif b > current[1]:
            current = (current[0], b)
    if current is not None:
        total += (current[1] - current[0]).total_seconds()
    return total
