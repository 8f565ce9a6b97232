"""Whether a machine other than the control plane's own can join with the node page's two lines,
and if not, what to set: the node page and `hybridtrain local` say the same sentences.

A joining agent needs two addresses: the control plane's public URL (it registers there, and
its trainers report there) and the broker it takes its orders from (handed over at
registration: HYBRIDTRAIN_BROKER_URL_FOR_AGENTS, else CELERY_BROKER_URL).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from agents.celery_app import is_embedded_broker, redact_url

# The lines that create a virtual environment and install the agent into it: Debian 12 and
# Ubuntu 24.04 refuse a plain `pip install` into the system's Python (PEP 668).
AGENT_VENV = "~/.hybridtrain"


def _is_loopback(host: str | None) -> bool:
    if not host or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local_only(url: str) -> bool:
    """Whether `url` names this machine only (localhost, 127.0.0.0/8, ::1)."""
    return _is_loopback(urlsplit(url).hostname)


def join_obstacles(*, public_url: str, agent_broker_url: str, bind_host: str | None = None) -> list[str]:
    """Why an agent on another machine cannot join, one sentence each naming what to set; empty
    when nothing stands in its way. `bind_host`, when known, is the address served on."""
    obstacles = []
    if is_local_only(public_url):
        obstacles.append(
            f"The control plane's public URL is {public_url}, which only this machine reaches: "
            "set HYBRIDTRAIN_PUBLIC_URL to this host's address as the other machine reaches it "
            "(e.g. http://10.0.0.5:8000) and serve on that address (`make run HOST=0.0.0.0`)."
        )
    elif bind_host is not None and _is_loopback(bind_host):
        obstacles.append(
            f"The control plane serves on {bind_host} only, so {public_url} does not answer other "
            "machines: serve on all addresses (`make run HOST=0.0.0.0`)."
        )
    if is_embedded_broker(agent_broker_url):
        obstacles.append(
            "Agents take their orders from the embedded SQLite broker, a file only this machine opens: "
            "run Redis and set CELERY_BROKER_URL=redis://ADDRESS:6379/0 (and "
            "HYBRIDTRAIN_BROKER_URL_FOR_AGENTS if agents reach it at another address)."
        )
    elif is_local_only(agent_broker_url):
        obstacles.append(
            f"Agents are handed the broker {redact_url(agent_broker_url)}, which only this machine reaches: "
            "set HYBRIDTRAIN_BROKER_URL_FOR_AGENTS to the broker's address as agents reach it."
        )
    return obstacles
