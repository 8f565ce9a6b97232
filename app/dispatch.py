"""Orders to node agents, published as Celery tasks on each node's own queue.

Queries decide *what* to send and return `LaunchOrder`/`CancelOrder`/`ProfileOrder`/`ProbeOrder`
values;
the caller commits first and only then hands them to `Dispatcher.send`, so an agent never acts
on a run (or profile) the database does not hold (conventions: enqueue after commit).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridtrain.contract import PROBE_LINKS_TASK, PROFILE_TASK

log = logging.getLogger(__name__)


def node_queue(node_id: int) -> str:
    """The Celery queue that the agent of `node_id` consumes."""
    return f"node.{node_id}"


@dataclass(frozen=True)
class LaunchOrder:
    """Start one rank of a run on a node."""

    node_id: int
    run_id: int
    rank: int
    spec: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class CancelOrder:
    """Stop every role of a run on a node."""

    node_id: int
    run_id: int
    reason: str
    # Only roles launched for an earlier attempt than this (a restart's cancel): the agent may
    # take the new attempt's launch before the cancel, which must then leave it running.
    before_attempt: int | None = None


@dataclass(frozen=True)
class ProfileOrder:
    """Measure a task's speed on a node (`python -m trainer.profile` in a child of the agent)."""

    node_id: int
    profile_id: int
    spec: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class ProbeOrder:
    """Measure the links from a node to other nodes' probe servers.

    `spec` is {"targets": [{"node_id", "host", "port", "round", "start_at"}], "seconds": float};
    the agent probes each target at its `start_at` (epoch seconds), in rounds that share no
    node and no site-to-site pipe (docs/architecture.md, "Link probes")."""

    node_id: int
    spec: dict[str, Any] = field(hash=False)


# A probe order still queued after this long is dropped: links measured much later than asked
# would answer a question nobody is waiting on any more.
PROBE_EXPIRES_S = 600.0

# A profile order still queued after this long is dropped: its requester has moved on, and a
# node that was away should not start measuring stale requests when it returns.
PROFILE_EXPIRES_S = 600.0

Order = LaunchOrder | CancelOrder | ProfileOrder | ProbeOrder


class Dispatcher:
    """Publishes orders to the broker; thread-safe (Celery's producer pool)."""

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self._celery: Any = None
        self._lock = threading.Lock()

    def _app(self) -> Any:
        # Made on first use: building the app touches the embedded broker's file, which an
        # app that never launches anything (tests of the inventory) should not create.
        with self._lock:
            if self._celery is None:
                from agents.celery_app import make_celery, prepare_embedded_broker

                prepare_embedded_broker(self.broker_url)
                self._celery = make_celery(self.broker_url)
            return self._celery

    def send(self, orders: Iterable[Order]) -> None:
        """Publish the orders; raises kombu's OperationalError when the broker is down."""
        from agents.celery_app import node_transport_options

        # A broker that is briefly away is retried a few times, then the error surfaces: the
        # caller fails the run with it rather than hanging the request.
        retry = {"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2}
        celery = self._app()
        by_node: dict[int, list[Order]] = {}
        for order in orders:
            by_node.setdefault(order.node_id, []).append(order)
        for node_id, node_orders in by_node.items():
            # On Redis each node's queue lives under its own key prefix (its agent's broker
            # user sees nothing else), so the orders go through a connection with that prefix.
            options = node_transport_options(self.broker_url, node_id)
            with celery.connection_for_write(transport_options=options) as connection:
                for order in node_orders:
                    self._publish(celery, connection, order, retry)

    @staticmethod
    def _publish(celery: Any, connection: Any, order: Order, retry: dict[str, float]) -> None:
        from agents.celery_app import CANCEL_EXPIRES_S, CANCEL_RUN, LAUNCH_EXPIRES_S, LAUNCH_ROLE

        queue = node_queue(order.node_id)
        common = {"queue": queue, "connection": connection, "retry": True, "retry_policy": retry}
        if isinstance(order, LaunchOrder):
            celery.send_task(LAUNCH_ROLE, args=[order.run_id, order.rank, order.spec],
                             expires=LAUNCH_EXPIRES_S, **common)
        elif isinstance(order, ProfileOrder):
            celery.send_task(PROFILE_TASK, args=[order.profile_id, order.spec],
                             expires=PROFILE_EXPIRES_S, **common)
        elif isinstance(order, ProbeOrder):
            celery.send_task(PROBE_LINKS_TASK, args=[order.spec], expires=PROBE_EXPIRES_S, **common)
        else:
            kwargs = {} if order.before_attempt is None else {"before_attempt": order.before_attempt}
            celery.send_task(CANCEL_RUN, args=[order.run_id, order.reason], kwargs=kwargs,
                             expires=CANCEL_EXPIRES_S, **common)
        log.info("sent %s to %s", order.__class__.__name__, queue)

    def send_quietly(self, orders: Iterable[Order]) -> None:
        """Publish best-effort orders (cancels after a failure); log instead of raising.

        A cancel that cannot be published is not lost for good: the node's next heartbeat
        learns that the run has ended and stops its roles.
        """
        try:
            self.send(list(orders))
        except Exception as exc:  # noqa: BLE001 - any broker failure; heartbeats catch up
            log.warning("could not publish orders (heartbeats will catch up): %s", exc)

    def close(self) -> None:
        """Release the broker connections."""
        if self._celery is not None:
            self._celery.close()
