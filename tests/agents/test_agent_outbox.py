"""The agent's durable outbox on a real SQLite file: order, retries, refusals, restarts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from agent_testing import wait_until

from agents.errors import ControlPlaneRejected, ControlPlaneUnavailable
from agents.outbox import EVENT, LOGS, REPORT, Message, Outbox


class Transport:
    """Records deliveries; answers with a queued error first when one is set."""

    def __init__(self) -> None:
        self.delivered: list[tuple[str, int, dict[str, Any]]] = []
        self.down = False
        self.errors: list[Exception] = []
        self.lock = threading.Lock()

    def _take(self, kind: str, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            if self.down:
                raise ControlPlaneUnavailable("connection refused")
            if self.errors:
                raise self.errors.pop(0)
            self.delivered.append((kind, run_id, body))
        return {"ok": True}

    def role_event(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        return self._take(EVENT, run_id, body)

    def logs(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        return self._take(LOGS, run_id, body)

    def reports(self, run_id: int, body: dict[str, Any]) -> dict[str, Any]:
        return self._take(REPORT, run_id, body)


def _outbox(path: Path, transport: Transport) -> Outbox:
    return Outbox(path, transport, first_delay_s=0.05, max_delay_s=0.2)


def test_outbox_delivers_in_the_order_things_were_put_once_the_control_plane_is_back(tmp_path):
    transport = Transport()
    transport.down = True
    box = _outbox(tmp_path, transport).start()
    try:
        for i in range(5):
            box.put(EVENT, 1, {"i": i})
        box.put_many([Message(REPORT, 1, {"records": [1]}),
                       Message(LOGS, 1, {"lines": [{"seq": 0}]})])

        transport.down = False

        assert box.drain(10)
        assert [(k, b.get("i")) for k, _, b in transport.delivered] == (
            [(EVENT, i) for i in range(5)] + [(REPORT, None), (LOGS, None)])
        assert transport.delivered[5] == (REPORT, 1, {"records": [1]})
    finally:
        box.close()


def test_what_an_outbox_left_undelivered_is_delivered_by_the_next_one_on_the_state_dir(tmp_path):
    transport = Transport()
    transport.down = True
    first = _outbox(tmp_path, transport).start()
    first.put(EVENT, 7, {"event": "exited"})
    first.close()

    transport.down = False
    second = _outbox(tmp_path, transport).start()
    try:
        assert second.drain(10)
        assert transport.delivered == [(EVENT, 7, {"event": "exited"})]
    finally:
        second.close()


def test_outbox_drops_a_message_refused_for_good_and_delivers_the_next(tmp_path):
    transport = Transport()
    transport.errors = [ControlPlaneRejected("422", status_code=422)]
    box = _outbox(tmp_path, transport).start()
    try:
        box.put(EVENT, 1, {"i": 0})
        box.put(EVENT, 1, {"i": 1})
        assert box.drain(10)
        assert [b["i"] for _, _, b in transport.delivered] == [1]
    finally:
        box.close()


def test_outbox_retries_a_message_answered_429(tmp_path):
    transport = Transport()
    transport.errors = [ControlPlaneRejected("429", status_code=429)] * 2
    box = _outbox(tmp_path, transport).start()
    try:
        box.put(EVENT, 1, {"i": 0})
        assert box.drain(10)
        assert [b["i"] for _, _, b in transport.delivered] == [0]
    finally:
        box.close()


def test_outbox_hands_each_answer_to_its_callback(tmp_path):
    transport = Transport()
    answers = []
    box = _outbox(tmp_path, transport)
    box.on_delivered = lambda entry, answer: answers.append((entry.body, answer))
    box.start()
    try:
        box.put(EVENT, 3, {"event": "started"})
        wait_until(lambda: answers, 10, "the answer")
        assert answers == [({"event": "started"}, {"ok": True})]
    finally:
        box.close()


def test_outbox_file_is_readable_by_its_owner_only(tmp_path):
    box = _outbox(tmp_path, Transport())
    box.close()
    assert (tmp_path / "outbox.db").stat().st_mode & 0o077 == 0
