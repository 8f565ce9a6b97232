"""The Celery app that carries launch, cancel and profile orders to node agents, and its
configuration.

Every node consumes only its own queue (`node.<id>`); the control plane publishes there after
its database commit. Task names are constants so the control plane can `send_task` them by
name without importing the agent's tasks (or torch).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from celery import Celery
from kombu.transport import sqlalchemy as kombu_sqlalchemy

LAUNCH_ROLE = "hybridtrain.launch_role"
CANCEL_RUN = "hybridtrain.cancel_run"

# A launch that has not started within this window is dropped by the worker (the control
# plane passes it as `expires=`): a node that comes back after an outage must not start a
# role of a run that the control plane has long since failed for not starting.
LAUNCH_EXPIRES_S = 120.0
CANCEL_EXPIRES_S = 600.0

# Redis only: how long a delivered but unacknowledged message stays invisible before Redis
# hands it out again. `launch_role` and `cancel_run` ack late; the longest of them is a launch
# that downloads its bundle (`bundle_download_timeout_s`, 150 s, then a spawn), a cancel takes
# the kill grace plus the sweep (under a minute). Five minutes never re-delivers an order that
# is still running, yet one lost with an agent killed mid-order comes back within minutes.
REDIS_VISIBILITY_TIMEOUT_S = 300

# kombu's SQL transport polls every 1 s by default, which adds about a second to every
# launch; 50 ms measured about 55 ms per task. It cannot go through `transport_options`
# (the channel hands those to `create_engine`, which rejects the keyword), hence a subclass.
SQL_POLLING_INTERVAL_S = 0.05


class PollingSQLTransport(kombu_sqlalchemy.Transport):
    """kombu's SQLAlchemy transport polling every 50 ms instead of every second."""

    polling_interval = SQL_POLLING_INTERVAL_S


_SQL_PREFIXES = ("sqla+", "sqlalchemy+")


def is_embedded_broker(broker_url: str) -> bool:
    """Whether the URL names kombu's SQL transport (the no-server default)."""
    return broker_url.startswith(_SQL_PREFIXES)


def is_redis_broker(broker_url: str) -> bool:
    """Whether the URL names a Redis broker (the production default)."""
    return broker_url.startswith(("redis://", "rediss://", "redis+socket://"))


def node_key_prefix(node_id: int) -> str:
    """The prefix of every Redis key of a node's queue: its own broker user is limited to it."""
    return f"hybridtrain.node.{node_id}:"


def node_transport_options(broker_url: str, node_id: int) -> dict[str, str]:
    """kombu transport options that put a node's queue under its key prefix (Redis only).

    kombu keeps one `unacked` hash per key space, holding every consumer's messages in
    flight; without a prefix per node, a node allowed to ack its own orders could read
    every other node's orders (and the run secrets in them)."""
    return {"global_keyprefix": node_key_prefix(node_id)} if is_redis_broker(broker_url) else {}


def _embedded_path(broker_url: str) -> str | None:
    """The SQLite file of an embedded broker URL; None for other brokers and in-memory ones."""
    if not is_embedded_broker(broker_url):
        return None
    db_url = broker_url.split("+", 1)[1]
    if not db_url.startswith("sqlite"):
        return None
    path = db_url.split(":///", 1)[1] if ":///" in db_url else ""
    return path if path and path != ":memory:" else None


def embedded_broker_exists(broker_url: str) -> bool:
    """Whether an embedded broker's file is on this machine (the control plane creates it)."""
    path = _embedded_path(broker_url)
    return path is None or Path(path).exists()


def redact_url(url: str) -> str:
    """The URL with its password masked, for logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def prepare_embedded_broker(broker_url: str) -> None:
    """Create the embedded broker's SQLite file and folder, in WAL mode; no-op for others.

    Called by the processes that use the broker (agent, control plane) rather than at import,
    so importing this module never writes to the working directory.
    """
    # SQLite cannot create the file's folder, and WAL lets the control plane publish while
    # several agents poll the same file without "database is locked" errors.
    import sqlite3

    path = _embedded_path(broker_url)
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path, timeout=30) as conn:
        conn.execute("PRAGMA journal_mode=WAL")


def configure(celery: Celery, broker_url: str, *, node_id: int | None = None) -> Celery:
    """Point `celery` at `broker_url` and apply the task settings chosen for long jobs; with
    `node_id`, as that node's agent (its queue's keys under the node's prefix)."""
    conf: dict[str, object] = {
        "broker_url": broker_url,
        # A broker that restarts or is not up yet is waited for, however long: an agent that
        # gave up would leave its node deaf to orders while it still heartbeats.
        "broker_connection_retry_on_startup": True,
        "broker_connection_retry": True,
        "broker_connection_max_retries": None,
        # No result backend: a role's outcome travels over HTTP (run events), no caller ever
        # waits on a task result, and results would pile up in Redis for nothing.
        "result_backend": None,
        "task_ignore_result": True,
        # JSON only: the broker may be reachable from other hosts, and pickle would turn a
        # forged message into code execution on every agent.
        "task_serializer": "json",
        "accept_content": ["json"],
        # Early ack by default (profiles, probes: cheap to order again, costly to run twice).
        # `launch_role` and `cancel_run` opt into late acks in agents.tasks: both are
        # idempotent (a launch of a rank this node already ran is a no-op, by its record in
        # the state dir), so an order taken by an agent that dies before finishing it is
        # delivered again instead of lost.
        "task_acks_late": False,
        # A late-acked order whose worker process died goes back to the queue.
        "task_reject_on_worker_lost": True,
        # Orders survive a broker restart: persistent messages on durable queues (kombu
        # declares the queues that task_create_missing_queues makes durable); on Redis, as far
        # as its own persistence (AOF or RDB) is configured.
        "task_default_delivery_mode": "persistent",
        # And a consumer whose channel fails right after connecting reconnects too.
        "broker_channel_error_retry": True,
        # One message reserved at a time: a node's queue has one consumer, and with acks_late
        # tasks a prefetched message sits unacknowledged behind a running cancel for nothing.
        "worker_prefetch_multiplier": 1,
        # No time limits: the agent runs the "threads" pool (its tasks share the process
        # that supervises the roles), which cannot enforce them. Task bodies are bounded by
        # construction instead: a launch spawns after at most one bundle download (its own
        # deadline), a cancel waits at most the kill grace, a profile at most its timeout,
        # and every HTTP call carries a timeout.
        "task_time_limit": None,
        "task_soft_time_limit": None,
        # The agent logs through its own handlers; Celery must not replace them or swallow
        # the agent's stdout.
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        # No remote control (`celery inspect`, `celery control shutdown`): nothing of ours uses
        # it, with shared broker credentials it would let any agent command every worker, and
        # a node's own Redis user may not PSUBSCRIBE its broadcast channel (an ACL checks a
        # pattern literally), so the consumer would reconnect forever. Gossip and mingle are
        # off too (see agents.agent).
        "worker_enable_remote_control": False,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        # Queues are named per node and created on first use.
        "task_create_missing_queues": True,
    }
    if is_embedded_broker(broker_url):
        db_url = broker_url.split("+", 1)[1]
        conf.update(
            broker_url=db_url,
            broker_transport=f"{__name__}:PollingSQLTransport",
            # Handed to create_engine: wait for SQLite's write lock rather than fail.
            broker_transport_options=(
                {"connect_args": {"timeout": 30}} if db_url.startswith("sqlite") else {}
            ),
        )
    else:
        conf.update(
            # Reset what an earlier configure() for the embedded broker may have set.
            broker_transport=None,
            broker_transport_options={
                "visibility_timeout": REDIS_VISIBILITY_TIMEOUT_S,
                **(node_transport_options(broker_url, node_id) if node_id is not None else {}),
            },
        )
    celery.conf.update(conf)
    return celery


def make_celery(broker_url: str) -> Celery:
    """A fresh Celery app on `broker_url`, e.g. for the control plane's dispatcher."""
    return configure(Celery("hybridtrain", set_as_current=False), broker_url)


def _default_broker_url() -> str:
    from agents.config import EMBEDDED_BROKER_URL, get_settings

    # Unset, the agent takes its broker from the control plane once registered.
    return get_settings().broker_url or EMBEDDED_BROKER_URL


# The agent's app; `agents.tasks` registers its tasks here and `hybridtrain agent` may point
# it at another broker (configure() again) before its worker starts.
app = make_celery(_default_broker_url())
