"""A role's output on its way to the control plane: one reader thread per role copies each
line to `runs/<run>/rank<R>.log` and to a bounded buffer (the oldest lines dropped and
counted when it is full), and one shipper thread moves buffered lines into the durable outbox
every `interval_s`, holding them back while the outbox already holds `outbox_lines` of them
(the control plane is long gone). A role's final flush, after its exit, always goes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from agents.outbox import LOGS, Message, Outbox
from agents.roles import MAX_LINE_CHARS, RoleProcess

# Lines per LOGS message.
LOG_BATCH_LINES = 500


class LogShipper:
    """Reads roles' output into their buffers and ships the buffers to the outbox."""

    def __init__(self, outbox: Outbox, roles: Callable[[], list[RoleProcess]], closing: threading.Event, *,
                 buffer_lines: int = 2000, outbox_lines: int = 200_000, interval_s: float = 1.0) -> None:
        self.outbox = outbox
        self.roles = roles
        self.closing = closing
        self.buffer_lines = buffer_lines
        self.outbox_lines = outbox_lines
        self.interval_s = interval_s
        self._thread = threading.Thread(target=self._ship_loop, name="log-shipper", daemon=True)

    def start(self) -> None:
        """Start shipping every `interval_s` until `closing` is set."""
        self._thread.start()

    def read(self, role: RoleProcess) -> None:
        """Copy the role's output to its log file and buffer until it closes (a reader thread's body)."""
        assert role.proc is not None and role.proc.stdout is not None
        with open(role.log_path, "ab", buffering=0) as sink:
            for raw in iter(role.proc.stdout.readline, b""):
                sink.write(raw)
                line = raw.decode("utf-8", "replace").rstrip("\r\n")[:MAX_LINE_CHARS]
                with role.lock:
                    role.tail.append(line)
                    if len(role.pending) >= self.buffer_lines:
                        role.pending.popleft()
                        role.dropped += 1
                    role.pending.append({"seq": role.next_seq, "t": time.time(), "line": line})
                    role.next_seq += 1
        role.proc.stdout.close()

    def _ship_loop(self) -> None:
        while not self.closing.wait(self.interval_s):
            for role in self.roles():
                if role.state == "running":
                    self.flush(role)

    def flush(self, role: RoleProcess, *, final: bool = False) -> None:
        """Move the role's buffered lines to the outbox in batches of LOG_BATCH_LINES, with the
        count of lines dropped since the last batch; held back while the outbox is full, unless
        `final`."""
        with role.ship_lock:
            messages = []
            with role.lock:
                if not role.pending:
                    return
                if not final and self.outbox.pending_log_lines() + len(role.pending) > self.outbox_lines:
                    return
                dropped, role.dropped = role.dropped, 0
                while role.pending:
                    batch = [role.pending.popleft() for _ in range(min(LOG_BATCH_LINES, len(role.pending)))]
                    messages.append(Message(LOGS, role.spec.run_id,
                                            {"rank": role.spec.rank, "lines": batch, "dropped": dropped}))
                    dropped = 0
            self.outbox.put_many(messages)
