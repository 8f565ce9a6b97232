"""Checkpoints in the control plane's store, so a run restarted on another node resumes.

The contract (`TrainConfig.checkpoint_url`, the run's store):
- `PUT {url}?step=N`, body the file's bytes (application/octet-stream), headers
  `Authorization: Bearer {report_token}` and `X-Content-Sha256: <hex>`; any 2xx means stored.
- `GET {url}`: the latest checkpoint, with headers `X-Checkpoint-Step` and `X-Content-Sha256`;
  404 means there is none yet.

Uploads run on a background thread with retries and backoff: training never waits for one,
and the file stays in checkpoint_dir whatever happens to the upload.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import sys
import threading
import time
from pathlib import Path

import httpx

log = logging.getLogger("trainer.checkpoint_store")

SHA_HEADER = "X-Content-Sha256"
STEP_HEADER = "X-Checkpoint-Step"


class ChecksumMismatch(ValueError):
    """A downloaded checkpoint's bytes do not hash to what the store said."""


def _headers(token: str | None, **extra: str) -> dict[str, str]:
    headers = dict(extra)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def upload(url: str, token: str | None, step: int, data: bytes, *, timeout_s: float = 60.0) -> None:
    """One PUT of a checkpoint; raises on anything but 2xx."""
    digest = hashlib.sha256(data).hexdigest()
    resp = httpx.put(url, params={"step": step}, content=data, timeout=timeout_s,
                     headers=_headers(token, **{SHA_HEADER: digest, "Content-Type": "application/octet-stream"}))
    resp.raise_for_status()


def download(url: str, token: str | None, *, timeout_s: float = 120.0, attempts: int = 5,
             min_step: int = 0) -> tuple[int, bytes | None] | None:
    """The store's latest checkpoint as (step, bytes), its checksum verified; (step, None) when
    it is older than `min_step`, its bytes left unread (a newer file is at hand); None when the
    store has none (404). Transient failures are retried with backoff."""
    delay = 0.5
    for attempt in range(attempts):
        try:
            # Streamed: the headers say the step before the body (tens of MB) is read.
            with httpx.stream("GET", url, headers=_headers(token), timeout=timeout_s) as resp:
                if resp.status_code == 404:
                    return None
                if resp.status_code < 500 or attempt == attempts - 1:
                    return _latest(url, resp, min_step)
        except httpx.TransportError:
            if attempt == attempts - 1:
                raise
        time.sleep(delay)
        delay *= 2
    return None


def _latest(url: str, resp: httpx.Response, min_step: int) -> tuple[int, bytes | None]:
    resp.raise_for_status()
    step = resp.headers.get(STEP_HEADER)
    if step is None or not step.isdigit():
        raise ValueError(f"checkpoint from {url}: no {STEP_HEADER} header")
    if int(step) < min_step:
        return int(step), None
    data = resp.read()
    want = resp.headers.get(SHA_HEADER, "")
    got = hashlib.sha256(data).hexdigest()
    if want.lower() != got:
        raise ChecksumMismatch(f"checkpoint from {url}: sha256 {got} does not match the store's "
                               f"{SHA_HEADER} {want or '(missing)'}; refusing to resume from it")
    return int(step), data


class Uploader:
    """Uploads checkpoint files in the background, newest first, retrying with backoff."""

    def __init__(self, url: str, token: str | None, *, backoff_s: float = 1.0, max_backoff_s: float = 30.0) -> None:
        self.url, self.token = url, token
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.uploaded: list[int] = []
        # Steps the store refused for good (a 4xx: the run has ended, the file is too large).
        self.refused: list[int] = []
        self._queue: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="checkpoint-upload")
        self._thread.start()

    def submit(self, step: int, path: Path) -> None:
        """Upload the file of `step` (a newer one supersedes a pending older one)."""
        self._idle.clear()
        self._queue.put((step, Path(path)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            # Only the newest pending checkpoint matters: a restart resumes from the latest.
            while not self._queue.empty():
                nxt = self._queue.get()
                if nxt is None:
                    self._queue.put(None)
                    break
                item = nxt
            self._upload(*item)
            if self._queue.empty():
                self._idle.set()

    def _upload(self, step: int, path: Path) -> None:
        delay = self.backoff_s
        while not self._stop:
            try:
                data = path.read_bytes()
            except OSError as exc:  # pruned meanwhile: a newer one is on its way
                log.warning("checkpoint of step %d is gone before its upload: %s", step, exc)
                return
            try:
                upload(self.url, self.token, step, data)
                self.uploaded.append(step)
                return
            except httpx.HTTPStatusError as exc:
                code = exc.response.status_code
                if 400 <= code < 500 and code not in (408, 429):
                    print(f"[checkpoint] upload of step {step} refused ({code}): {exc.response.text[:200]}",
                          file=sys.stderr, flush=True)
                    self.refused.append(step)
                    return
                why = f"HTTP {code}"
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            log.warning("checkpoint upload of step %d failed (%s); retrying in %.1f s", step, why, delay)
            time.sleep(delay)
            delay = min(self.max_backoff_s, delay * 2)

    def close(self, deadline_s: float = 60.0) -> bool:
        """Wait up to `deadline_s` for pending uploads; True if everything was stored (the
        newest checkpoint submitted is in the store, not refused)."""
        done = self._idle.wait(deadline_s)
        self._stop = True
        self._queue.put(None)
        if not done:
            print(f"[checkpoint] an upload to {self.url} was still pending after {deadline_s:.0f} s; the file "
                  "stays in the checkpoint directory", file=sys.stderr, flush=True)
        last_refused = bool(self.refused) and (not self.uploaded or self.refused[-1] > self.uploaded[-1])
        return done and not last_refused


def load_latest(cfg) -> dict | None:
    """The run's latest checkpoint state for --resume: the newer of the store's (its checksum
    verified) and the newest file in checkpoint_dir, so a server restarted where it ran does not
    lose a checkpoint that was written but not yet uploaded when it died (the store's bytes are
    then not fetched); None (and a line saying so) when there is none, and the run starts from
    step 0."""
    from trainer import checkpoint

    steps = checkpoint.saved_steps(cfg.checkpoint_dir)
    local_step = steps[-1] if steps else 0
    local = checkpoint.run_path(cfg.checkpoint_dir, local_step) if steps else None
    if cfg.checkpoint_url:
        got = download(cfg.checkpoint_url, cfg.report_token, min_step=local_step)
        if got is not None and got[1] is not None:
            step, data = got
            state = checkpoint.read(data, cfg)
            print(f"[checkpoint] --resume: step {step} from the run's store", file=sys.stderr, flush=True)
            return state
        if local is None:
            print("[checkpoint] --resume: the run's store has no checkpoint yet; starting from step 0",
                  file=sys.stderr, flush=True)
            return None
        # The upload of this file had not finished: the store holds an older step or none.
        stored = f"the store's latest is step {got[0]}" if got is not None else "the store has none yet"
        print(f"[checkpoint] --resume: step {local_step} from {local} ({stored}: its upload had not "
              "finished)", file=sys.stderr, flush=True)
        return checkpoint.read(local, cfg)
    if local is None:
        print(f"[checkpoint] --resume: no checkpoint in {cfg.checkpoint_dir}; starting from step 0",
              file=sys.stderr, flush=True)
        return None
    print(f"[checkpoint] --resume: {local}", file=sys.stderr, flush=True)
    return checkpoint.read(local, cfg)
