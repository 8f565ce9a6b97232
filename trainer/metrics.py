"""Metrics as JSON lines (docs/architecture.md): to a file and, in batches, to the control plane.

The HTTP reporter runs in a daemon thread behind a bounded queue: training only ever does a
non-blocking put. Failed batches are retried with exponential backoff; a record is dropped only
when the queue is full or a batch has exhausted its retries, and every drop is counted and
warned about. `close()` flushes what is left within a deadline.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import IO, Any

from hybridtrain.contract import SYSTEM_METRICS, check_metric_name

log = logging.getLogger("trainer.metrics")



class HttpReporter:
    """POSTs `{"records": [...]}` batches with a bearer token from a background thread."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        max_queue: int = 50_000,
        batch_size: int = 500,
        interval_s: float = 1.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        client: Any = None,
    ) -> None:
        import httpx

        self.url = url
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.dropped = 0
        self.sent = 0
        self._queue: queue.Queue[dict] = queue.Queue(maxsize=max_queue)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = client or httpx.Client(timeout=timeout_s, headers=headers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-reporter", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        """Queue a record without ever blocking; count it as dropped when the queue is full."""
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._drop(1, "queue full")

    def _drop(self, n: int, why: str) -> None:
        self.dropped += n
        log.warning("metrics reporter dropped %d record(s) (%s); %d dropped so far", n, why, self.dropped)

    def _take_batch(self, wait_s: float) -> list[dict]:
        batch: list[dict] = []
        deadline = time.monotonic() + wait_s
        while len(batch) < self.batch_size:
            timeout = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=max(0.0, timeout)) if timeout > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _post(self, batch: list[dict], give_up_at: float) -> None:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                resp = self._client.post(self.url, json={"records": batch})
                if 200 <= resp.status_code < 300:
                    self.sent += len(batch)
                    return
                # A 4xx other than 408/429 will not get better by retrying.
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    self._drop(len(batch), f"HTTP {resp.status_code}")
                    return
                why = f"HTTP {resp.status_code}"
            except Exception as exc:  # noqa: BLE001 - any transport failure is retried the same way
                why = type(exc).__name__
            if attempt == self.retries or time.monotonic() + delay > give_up_at:
                self._drop(len(batch), f"{why} after {attempt + 1} attempt(s)")
                return
            time.sleep(delay)
            delay = min(delay * 2, 30.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self._take_batch(self.interval_s)
            if batch:
                self._post(batch, give_up_at=float("inf"))
        self._final_flush()

    def _final_flush(self) -> None:
        give_up_at = time.monotonic() + self._flush_deadline_s
        while time.monotonic() < give_up_at:
            batch = self._take_batch(0.0)
            if not batch:
                return
            self._post(batch, give_up_at)
        left = self._queue.qsize()
        if left:
            self._drop(left, "flush deadline at exit")

    _flush_deadline_s = 10.0

    def close(self, deadline_s: float = 10.0) -> None:
        """Flush what is queued (for at most `deadline_s`) and stop the thread."""
        self._flush_deadline_s = deadline_s
        self._stop.set()
        self._thread.join(timeout=deadline_s + self.interval_s + 5.0)
        self._client.close()


class MetricsLogger:
    """One rank's metrics: builds the records and hands them to the file and the reporter."""

    def __init__(
        self,
        rank: int,
        role: str,
        path: str | None = None,
        reporter: HttpReporter | None = None,
    ) -> None:
        self.rank = rank
        self.role = role
        self.reporter = reporter
        self._file: IO[str] | None = open(path, "a", buffering=1 << 16) if path else None
        self.last: dict[str, float] = {}
        self._checked: set[str] = set()

    def log(self, step: int, name: str, value: float, peer: int | None = None) -> None:
        """Record one measurement."""
        if name not in SYSTEM_METRICS and name not in self._checked:
            check_metric_name(name)  # a task's own metric: any name of the contract's form
            self._checked.add(name)
        record: dict[str, Any] = {
            "rank": self.rank, "role": self.role, "step": step, "t": round(time.time(), 6),
            "name": name, "value": float(value),
        }
        if peer is not None:
            record["peer"] = peer
        self.last[name] = float(value)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        if self.reporter is not None:
            self.reporter.put(record)

    def log_bytes(self, step: int, sent: dict[int, int], recv: dict[int, int]) -> None:
        """Per-link byte counts of one step."""
        for peer, n in sorted(sent.items()):
            self.log(step, "bytes_sent", n, peer=peer)
        for peer, n in sorted(recv.items()):
            self.log(step, "bytes_recv", n, peer=peer)

    def close(self) -> None:
        """Flush the file and the reporter."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.reporter is not None:
            self.reporter.close()
