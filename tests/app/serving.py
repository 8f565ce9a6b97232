"""The test app served over real HTTP by uvicorn in a thread, for tests that drive the CLI or
load the server with concurrent clients."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
import uvicorn
from fastapi import FastAPI

from tests.app.conftest import ADMIN_TOKEN

MiB = 1024 * 1024


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


def drive_asgi(
    app: FastAPI, method: str, path: str, headers: dict[str, str], chunks: Iterator[bytes | float]
) -> tuple[int, bytes, int]:
    """Drive the app directly: its status, its body, and how many body bytes it pulled (a
    float among the chunks is a pause of the client's, in seconds)."""
    pulled = 0
    status = 0
    answer = bytearray()
    queue = list(headers.items())

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        chunk = next(chunks, None)
        while isinstance(chunk, float):  # a pause of the client's, in seconds
            await asyncio.sleep(chunk)
            chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        pulled += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            answer.extend(message.get("body", b""))

    path, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in queue],
        "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 80), "state": {},
    }
    asyncio.run(app(scope, receive, send))
    return status, bytes(answer), pulled


def body_chunks(total: int, size: int = MiB) -> Iterator[bytes]:
    """`total` bytes of a body, a chunk at a time, made only when pulled."""
    sent = 0
    while sent < total:
        yield b"x" * size
        sent += size
