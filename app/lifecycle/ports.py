"""The port rank 0 of a run listens on: suggested by the control plane at launch, confirmed
or replaced by rank 0's agent, which names the one it took in the rank's `started` event
(docs/architecture.md, "Scheduling")."""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Run, RunWorker
from app.models.runs import ACTIVE_RUN_STATUSES

# Suggestions are drawn from here, below Linux's ephemeral range (32768-60999), where the
# kernel does not hand out ports to outgoing connections.
MASTER_PORT_BASE = 29500
MASTER_PORT_SPAN = 2000


def suggest_port(session: Session, *, run: Run, avoid: Iterable[int] = ()) -> int:
    """A port for rank 0 to listen on, which its agent takes only if it is free on the node at
    launch (else it binds another and reports it, `LaunchOrder` spec `pick_port`).

    Drawn at random, never from the run id, and not one that another active run's rank 0
    on the same node was given: ids repeat across control planes and 2000 runs apart.
    """
    leader = next((w.node_id for w in run.workers if w.rank == 0), None)
    taken = set(avoid) | set(session.scalars(
        select(Run.master_port).join(RunWorker, RunWorker.run_id == Run.id).where(
            RunWorker.rank == 0, RunWorker.node_id == leader, Run.id != run.id,
            Run.status.in_(ACTIVE_RUN_STATUSES), Run.master_port.is_not(None),
        )
    ).all())
    free = [p for p in range(MASTER_PORT_BASE, MASTER_PORT_BASE + MASTER_PORT_SPAN) if p not in taken]
    return secrets.choice(free or [MASTER_PORT_BASE])
