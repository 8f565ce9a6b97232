"""`HybridtrainClient.wait_for_run` rides out a dropped connection or a restarting control plane,
against a real HTTP server on localhost that misbehaves on cue."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.cli import main
from app.cli.client import ApiError, HybridtrainClient, RunTimeout
from app.cli.run_commands import EXIT_UNREACHABLE


def _run(status: str) -> dict:
    return {"id": 7, "status": status, "reason": None, "workers": [{"rank": 0, "status": status}],
            "max_steps": 10, "target": None, "started_at": None}


class ScriptedServer:
    """Answers GET /api/v1/runs/7 with the next scripted behaviour: "drop" (close the socket
    without a word), an HTTP status, or a run status; the last one repeats."""

    def __init__(self, script: list[str | int]) -> None:
        self.script = list(script)
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                outer.requests.append(self.path)
                if self.path.startswith("/api/v1/runs/7/metrics"):
                    self._json(200, {"run_id": 7, "series": [], "last_t": None})
                    return
                step = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                if step == "drop":
                    self.close_connection = True
                    self.connection.close()
                elif isinstance(step, int):
                    self._json(step, {"detail": "restarting"})
                else:
                    self._json(200, _run(step))

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._json(201, _run("queued"))

            def _json(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # Polled every 20 ms, not serve_forever's 500: shutdown() waits for the next poll.
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def polls(self) -> int:
        return sum(1 for p in self.requests if p == "/api/v1/runs/7")


@pytest.fixture
def serve() -> Iterator:
    servers: list[ScriptedServer] = []

    def start(script: list[str | int]) -> ScriptedServer:
        server = ScriptedServer(script)
        server.thread.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.httpd.shutdown()
        server.httpd.server_close()


def _wait(server: ScriptedServer, **kwargs) -> dict:
    with HybridtrainClient(server.url, "t", timeout_s=5) as client:
        return client.wait_for_run(7, poll_s=0.01, **kwargs)


def test_dropped_connections_are_retried_until_the_run_answers(serve):
    server = serve(["drop", "drop", "running", "succeeded"])
    assert _wait(server, retry_for_s=10)["status"] == "succeeded"
    assert server.polls() == 4


@pytest.mark.parametrize("code", [502, 503, 504])
def test_a_restarting_control_plane_is_retried(serve, code):
    server = serve([code, code, code, "succeeded"])
    assert _wait(server, retry_for_s=10)["status"] == "succeeded"


def test_each_retry_is_reported_with_a_growing_pause(serve):
    server = serve([503, 503, 503, "succeeded"])
    pauses: list[float] = []
    _wait(server, retry_for_s=10, on_retry=lambda exc, pause: pauses.append(pause))
    assert pauses == [0.01, 0.02, 0.04]


def test_the_wait_gives_up_as_unreachable_after_retry_for_s(serve):
    server = serve(["running", 503])
    with pytest.raises(ApiError, match="gave up on run 7 after 0.2 s") as exc:
        _wait(server, retry_for_s=0.2)
    assert exc.value.status_code == 0


def test_a_client_error_is_not_retried(serve):
    server = serve([404])
    with pytest.raises(ApiError) as exc:
        _wait(server, retry_for_s=10)
    assert (exc.value.status_code, server.polls()) == (404, 1)


def test_the_timeout_still_applies_while_retrying(serve):
    server = serve(["drop"])
    with pytest.raises(RunTimeout, match="no answer from the control plane"):
        _wait(server, retry_for_s=10, timeout_s=0.1)


def test_runs_create_wait_exits_4_once_the_control_plane_stays_away(serve, capsys):
    server = serve([503])
    code = main(["runs", "create", "--name", "r", "--nodes", "1", "--server", server.url, "--token", "t",
                 "--wait", "--retry-for", "0.2"])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE, err
    assert "503: restarting; retrying in" in err and "gave up on run 7" in err
