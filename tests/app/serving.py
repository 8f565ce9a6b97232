"""The test app served over real HTTP by uvicorn in a thread, for tests that drive the CLI."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from fastapi import FastAPI

from tests.app.conftest import ADMIN_TOKEN


@contextmanager
def cli_server(app: FastAPI, name: str) -> Iterator[list[str]]:
    """`--server URL --token T` of `app` served on a free port (no lifespan: no monitor)."""
    served = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=served.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not served.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the control plane did not start")
        time.sleep(0.02)
    port = served.servers[0].sockets[0].getsockname()[1]
    try:
        yield ["--server", f"http://127.0.0.1:{port}", "--token", ADMIN_TOKEN]
    finally:
        served.should_exit = True
        thread.join(timeout=10)
