"""The test app served over real HTTP by uvicorn in a thread, for tests that drive the CLI or
load the server with concurrent clients."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import pytest
import uvicorn
from fastapi import FastAPI

from tests.app.conftest import ADMIN_TOKEN


@contextmanager
def served(app: FastAPI, name: str, *, lifespan: Literal["on", "off"] = "off") -> Iterator[str]:
    """The base URL of `app` served on a free loopback port (lifespan "off": no monitor)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the control plane did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def cli_server(app: FastAPI, name: str) -> Iterator[list[str]]:
    """`--server URL --token T` of `app` served on a free port (no lifespan: no monitor)."""
    with served(app, name) as url:
        yield ["--server", url, "--token", ADMIN_TOKEN]
