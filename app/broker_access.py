"""Which broker a node's agent takes its orders from, and with which credentials.

The control plane hands the broker over at registration (docs/deploy.md, "How an agent gets
its orders"), so the join command needs nothing else. On Redis every node gets an ACL user of
its own whose keys and channels are only its queue's (`agents.celery_app.node_key_prefix`):
a node can neither read another node's orders, with the run secrets in them, nor put an order
on another node's queue. Its password is derived from the secret key and the node's agent
token, never stored, so a re-joined node gets a new one and the old one stops working.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from agents.celery_app import is_embedded_broker, is_redis_broker, node_key_prefix, prepare_embedded_broker
from app.config import Settings

log = logging.getLogger(__name__)

NODE_USER_PREFIX = "hybridtrain-node-"
# Every command but the dangerous ones (KEYS, CONFIG, FLUSHALL, ACL, ...), on the node's own
# keys and channels only. kombu's Redis transport needs lists, hashes, sorted sets, scripts,
# transactions and pub/sub, all inside its key prefix.
NODE_USER_RULES = ("+@all", "-@dangerous")
# A heartbeat checks its node's user: a broker that is away delays the beat by this, no more.
ADMIN_TIMEOUT_S = 2.0


class BrokerAccessError(Exception):
    """The broker refused to set up a node's user (the control plane's user lacks ACL rights)."""


class BrokerOutOfReach(Exception):
    """The broker the control plane would hand out is on loopback, and the agent is not."""


@dataclass(frozen=True)
class AgentBroker:
    """The broker URL an agent consumes its queue from, and whether it carries its own user."""

    url: str
    node_user: bool


def node_user_name(node_id: int, broker_url: str) -> str:
    """The Redis ACL user of a node's agent on the broker database of `broker_url`.

    ACL users belong to the whole Redis server, and two control planes may share one on
    different databases (their queues apart): the database number keeps their nodes' users
    apart too. Database 0 keeps the plain name, which deployments before this one use."""
    db = _redis_db(broker_url)
    return f"{NODE_USER_PREFIX}{node_id}" if db == 0 else f"{NODE_USER_PREFIX}{node_id}-db{db}"


def _redis_db(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


def node_password(secret_key: str, node_id: int, agent_token_hash: str) -> str:
    """The password of a node's broker user: derived, never stored, new with each agent token."""
    message = f"broker-user:{node_id}:{agent_token_hash}".encode()
    return hmac.new(secret_key.encode(), message, hashlib.sha256).hexdigest()


def agent_broker(settings: Settings, *, node_id: int, agent_token_hash: str, client_host: str | None) -> AgentBroker:
    """The broker for the agent of `node_id`, setting up its user on Redis.

    Raises BrokerOutOfReach for a loopback broker asked for from another host, and
    BrokerAccessError when Redis refuses the user."""
    url = settings.broker_url_for_agents or settings.celery_broker_url
    if is_embedded_broker(url):
        # Reachable from this machine only: the file is made now, so an agent that does not
        # find it knows it runs elsewhere.
        absolute = _absolute_embedded(url)
        prepare_embedded_broker(absolute)
        return AgentBroker(absolute, node_user=False)
    host = urlsplit(url).hostname
    if host and _is_loopback(host) and client_host and _is_remote(client_host):
        raise BrokerOutOfReach(
            f"this control plane's broker is at {host}, which an agent on another machine "
            f"({client_host}) cannot reach: set HYBRIDTRAIN_BROKER_URL_FOR_AGENTS on the control plane "
            "to the broker's address as agents reach it (docs/deploy.md)"
        )
    if not node_users_enabled(settings):
        return AgentBroker(url, node_user=False)
    password = node_password(settings.secret_key, node_id, agent_token_hash)
    set_node_user(settings.celery_broker_url, node_id, password)
    return AgentBroker(_with_user(url, node_user_name(node_id, settings.celery_broker_url), password), node_user=True)


def set_node_user(admin_url: str, node_id: int, password: str) -> None:
    """Create or reset the node's ACL user on the Redis at `admin_url`."""
    import redis

    prefix = node_key_prefix(node_id)
    try:
        with _admin(admin_url) as admin:
            admin.execute_command(
                "ACL", "SETUSER", node_user_name(node_id, admin_url), "reset", "on", f">{password}",
                f"~{prefix}*", f"&{prefix}*", *NODE_USER_RULES,
            )
    except redis.RedisError as exc:
        raise BrokerAccessError(
            f"the broker refused to set up node {node_id}'s user ({exc}); give the control plane's "
            "broker user the ACL commands, or set HYBRIDTRAIN_BROKER_NODE_USERS=false to hand "
            "agents the shared broker credentials"
        ) from exc


def node_users_enabled(settings: Settings) -> bool:
    """Whether agents get broker users of their own nodes (Redis, unless switched off)."""
    url = settings.broker_url_for_agents or settings.celery_broker_url
    return is_redis_broker(url) and is_redis_broker(settings.celery_broker_url) and settings.broker_node_users


def drop_node_user(settings: Settings, node_id: int) -> None:
    """Delete a removed node's broker user (and with it its open connections); logs failures."""
    if not node_users_enabled(settings):
        return
    import redis

    try:
        with _admin(settings.celery_broker_url) as admin:
            admin.execute_command("ACL", "DELUSER", node_user_name(node_id, settings.celery_broker_url))
    except redis.RedisError as exc:
        log.warning("could not delete the broker user of node %s: %s", node_id, exc)


def keep_node_user(settings: Settings, *, node_id: int, agent_token_hash: str) -> bool:
    """Re-create the node's user if the broker lost it (a restarted Redis keeps ACL users only
    with an ACL file); True when it had to. Called on the heartbeats of agents that use one."""
    if not node_users_enabled(settings):
        return False
    import redis

    admin = _beats_admin(settings.celery_broker_url)
    try:
        if admin.execute_command("ACL", "GETUSER", node_user_name(node_id, settings.celery_broker_url)) is not None:
            return False
    except redis.RedisError as exc:
        raise BrokerAccessError(f"could not look up node {node_id}'s broker user: {exc}") from exc
    set_node_user(settings.celery_broker_url, node_id, node_password(settings.secret_key, node_id, agent_token_hash))
    return True


@functools.lru_cache(maxsize=8)
def _beats_admin(url: str) -> Any:
    """`_admin`, kept for the heartbeats' checks: a connection of its own per beat cost ~1 ms
    of CPU and ~3 ms of the beat's time; a kept one reconnects by itself after a restart."""
    return _admin(url)


def _admin(url: str) -> Any:
    """A client of the control plane's own broker user; short timeouts, as a request waits on it."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=ADMIN_TIMEOUT_S, socket_connect_timeout=ADMIN_TIMEOUT_S)


def _absolute_embedded(url: str) -> str:
    scheme, _, rest = url.partition(":///")
    if not rest or rest.startswith("/") or rest == ":memory:":
        return url
    return f"{scheme}:///{Path(rest).resolve()}"


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _is_remote(client_host: str) -> bool:
    # Test clients and unix sockets name no IP: only an address proves another host.
    try:
        return not ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
