"""`hybridtrain local`: the control plane and one agent for this machine, on the embedded
defaults (SQLite database and SQLite broker under ./var/), with nothing else to install.

1. Migrate the database.
2. Make sure there is an admin token (HYBRIDTRAIN_ADMIN_TOKEN, or one created once and kept
   in var/local-admin-token) so the dashboard and the CLI can sign in.
3. Make sure this machine is a node: site "local" (on-prem) and a node named after the host,
   declaring the GPUs found here (none on a CPU-only machine), and that cluster "local" exists
   (made once with this node; id 1 on a fresh var/), so `runs create --cluster 1` works at once.
4. Start the agent as a child process (it joins with a fresh join token the first time, with
   its saved agent token afterwards), then serve the control plane until stopped; stopping
   stops the agent, which stops its roles.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

TOKEN_FILE = Path("var/local-admin-token")
AGENT_STATE_DIR = Path("var/agent")
LOCAL_SITE = "local"
LOCAL_CLUSTER = "local"


def add_local_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `hybridtrain local` to the parser."""
    parser = sub.add_parser(
        "local",
        help="run the control plane and an agent for this machine (embedded defaults)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--continent", default="europe", help="of the local site (egress pricing)")
    parser.add_argument("--no-agent", action="store_true", help="serve the control plane only")
    parser.add_argument("--log-level", default="info")
    parser.set_defaults(func=run_local)


def _client_host(host: str) -> str:
    # A wildcard bind is reachable on loopback; agents and trainers here use that.
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _admin_token(settings, factory) -> str:  # type: ignore[no-untyped-def]
    """The local admin token: from the environment, var/local-admin-token, or made now."""
    from app.db import session_scope
    from app.models import TokenScope
    from app.queries.tokens import create_token, token_by_secret

    if settings.admin_token:
        return str(settings.admin_token)
    if TOKEN_FILE.exists():
        secret = TOKEN_FILE.read_text().strip()
        with factory() as session:
            if token_by_secret(session, secret=secret) is not None:
                return secret
    with session_scope(factory) as session:
        _, secret = create_token(session, name=f"local-admin-{os.urandom(3).hex()}", scope=TokenScope.admin)
    TOKEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(TOKEN_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    return secret


def ensure_local_node(factory, *, continent: str, need_join_token: bool) -> tuple[int, int, str | None]:  # type: ignore[no-untyped-def]
    """The ids of this machine's node and of cluster "local" (each created if missing), and a
    join token when one is needed."""
    from sqlalchemy import select

    from agents.hardware import detect
    from app.db import session_scope
    from app.models import GpuModel, Node, Site
    from app.queries.nodes import create_node, rotate_join_token
    from app.queries.sites import create_site
    from app.schemas.nodes import GpuCount, NodeCreate
    from app.schemas.sites import SiteCreate

    hostname = socket.gethostname()[:128] or "localhost"
    with session_scope(factory) as session:
        site = session.scalar(select(Site).where(Site.name == LOCAL_SITE))
        if site is None:
            site = create_site(
                session,
                data=SiteCreate(name=LOCAL_SITE, kind="onprem", provider="onprem", continent=continent),
            )
        node = session.scalar(select(Node).where(Node.site_id == site.id, Node.name == hostname))
        join_token = None
        if node is None:
            catalog = set(session.scalars(select(GpuModel.name)).all())
            detected = detect().gpu_counts()
            gpus = [GpuCount(model=g["model"], count=g["count"]) for g in detected if g["model"] in catalog]
            node, join_token = create_node(
                session,
                data=NodeCreate(site_id=site.id, name=hostname, address="127.0.0.1", gpus=gpus),
            )
        elif need_join_token:
            join_token = rotate_join_token(session, node_id=node.id)
        return node.id, ensure_local_cluster(session, node), join_token


def ensure_local_cluster(session, node) -> int:  # type: ignore[no-untyped-def]
    """The id of cluster "local", created with `node` if missing; a "local" cluster that an admin
    emptied or changed is left as it is, so a restart never undoes an edit."""
    from sqlalchemy import select

    from app.models import Cluster
    from app.queries.clusters import create_cluster
    from app.schemas.clusters import ClusterCreate

    cluster_id = session.scalar(select(Cluster.id).where(Cluster.name == LOCAL_CLUSTER))
    if cluster_id is None:
        cluster_id = create_cluster(session, data=ClusterCreate(
            name=LOCAL_CLUSTER, description="this machine, made by `hybridtrain local`", node_ids=[node.id],
        )).id
    return int(cluster_id)


def local_settings(configured, url: str):  # type: ignore[no-untyped-def]
    """The settings `hybridtrain local` serves with: HYBRIDTRAIN_PUBLIC_URL when it was set (how
    other machines reach this one), else `url`, this machine's own address of the server."""
    if "public_url" in configured.model_fields_set:
        return configured
    return configured.model_copy(update={"public_url": url})


def join_hint(settings, *, bind_host: str, port: int) -> str:  # type: ignore[no-untyped-def]
    """What `hybridtrain local` says about a second machine joining: what to set first, or that
    the node page's lines work as they are."""
    from app.join_reach import join_obstacles

    obstacles = join_obstacles(
        public_url=settings.public_url,
        agent_broker_url=settings.broker_url_for_agents or settings.celery_broker_url,
        bind_host=bind_host,
    )
    if not obstacles:
        return (f"hybridtrain local: other machines join {settings.public_url}: declare a node on the "
                "Nodes page and run the two lines it shows on that machine")
    lines = ["hybridtrain local: a second machine cannot join yet (the Nodes page's lines would fail there):"]
    lines += [f"  - {obstacle}" for obstacle in obstacles]
    make_port = "" if port == 8000 else f" PORT={port}"
    lines.append(f"  e.g. HYBRIDTRAIN_PUBLIC_URL=http://ADDRESS:{port} CELERY_BROKER_URL=redis://ADDRESS:6379/0 "
                 f"make run HOST=0.0.0.0{make_port}   (ADDRESS: this host's, as the other machine reaches it)")
    return "\n".join(lines)


def _start_agent(url: str, broker_url: str, join_token: str | None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "app.cli", "agent", "--server", url,
            "--state-dir", str(AGENT_STATE_DIR), "--broker-url", broker_url]
    if join_token:
        argv += ["--token", join_token]

    def die_with_parent() -> None:
        # Still single-threaded here, so preexec_fn is safe: the agent gets SIGTERM (and
        # stops its roles) if `hybridtrain local` itself is killed.
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)

    return subprocess.Popen(argv, preexec_fn=die_with_parent, start_new_session=True)


def run_local(args: argparse.Namespace) -> int:
    """Serve the control plane with a local agent until interrupted."""
    import uvicorn

    from app import db
    from app.config import get_settings
    from app.main import create_app

    url = f"http://{_client_host(args.host)}:{args.port}"
    settings = local_settings(get_settings(), url)
    db.upgrade(settings.database_url)
    engine = db.make_engine(settings)
    factory = db.make_sessionmaker(engine)
    _admin_token(settings, factory)

    agent = None
    if not args.no_agent:
        resumable = (AGENT_STATE_DIR / "agent.json").exists()
        node_id, cluster_id, join_token = ensure_local_node(
            factory, continent=args.continent, need_join_token=not resumable
        )
        agent = _start_agent(url, settings.celery_broker_url, join_token)
        print(f"hybridtrain local: agent pid {agent.pid} for node {node_id}; "
              f"cluster {cluster_id} (\"{LOCAL_CLUSTER}\") holds it: runs create --cluster {cluster_id}",
              file=sys.stderr)
    engine.dispose()
    print(
        f"hybridtrain local: dashboard {url}/  API {url}/docs\n"
        f"hybridtrain local: sign in with the admin token in {TOKEN_FILE} "
        f"(or HYBRIDTRAIN_ADMIN_TOKEN); CLI: export HYBRIDTRAIN_URL={url} "
        f"HYBRIDTRAIN_TOKEN=$(cat {TOKEN_FILE})",
        file=sys.stderr, flush=True,
    )
    print(join_hint(settings, bind_host=args.host, port=args.port), file=sys.stderr, flush=True)
    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal to the
    # handler it found; this one lets the agent be stopped below instead of dying on the spot.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_keep_alive=settings.keep_alive_s)
    except KeyboardInterrupt:
        pass
    finally:
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
    return 0
