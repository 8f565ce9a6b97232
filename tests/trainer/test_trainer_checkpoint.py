"""Checkpoints a restarted run can resume from: one file per checkpoint step, written by the
server (or all-reduce's rank 0), uploaded to the control plane's store and read back from it
(the PUT/GET contract of trainer.checkpoint_store), with any number of workers."""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import torch
from trainer_testing import DIGITS, events, read_metrics, run_cli, series

from hybridtrain.contract import EVENT_CHECKPOINT, EVENT_RESUMED
from trainer import checkpoint
from trainer.checkpoint_store import ChecksumMismatch, Uploader, download
from trainer.config import TrainConfig
from trainer.launch import free_port

TOKEN = "run-token"


class Store:
    """A tiny real checkpoint store: PUT ?step=N keeps the body if its checksum matches, GET
    returns the latest with its step and checksum (or 404); `corrupt` flips a byte on GET."""

    def __init__(self, port: int = 0) -> None:
        self.saved: dict[int, bytes] = {}
        self.puts: list[dict] = []
        self.corrupt = False
        self.refuse = False
        store = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_PUT(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                step = int(parse_qs(urlparse(self.path).query)["step"][0])
                store.puts.append({"step": step, "auth": self.headers.get("Authorization"),
                                   "sha": self.headers.get("X-Content-Sha256"),
                                   "type": self.headers.get("Content-Type")})
                if store.refuse or hashlib.sha256(body).hexdigest() != self.headers.get("X-Content-Sha256"):
                    self.send_response(409 if store.refuse else 422)
                    self.end_headers()
                    return
                store.saved[step] = body
                self.send_response(201)
                self.end_headers()

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    self.send_response(401)
                    self.end_headers()
                    return
                if not store.saved:
                    self.send_response(404)
                    self.end_headers()
                    return
                step = max(store.saved)
                body = store.saved[step]
                sha = hashlib.sha256(body).hexdigest()
                if store.corrupt:
                    body = bytes([body[0] ^ 1]) + body[1:]
                self.send_response(200)
                self.send_header("X-Checkpoint-Step", str(step))
                self.send_header("X-Content-Sha256", sha)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/api/v1/runs/7/checkpoint"
        # Polled every 20 ms, not serve_forever's 500: close() waits for the next poll.
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def store():
    s = Store()
    yield s
    s.close()


def test_an_upload_puts_the_files_bytes_with_their_checksum_and_the_runs_token(store, tmp_path):
    path = tmp_path / "run-step-00000010.pt"
    path.write_bytes(b"checkpoint bytes")
    uploader = Uploader(store.url, TOKEN)
    uploader.submit(10, path)
    assert uploader.close(30)
    assert store.saved == {10: b"checkpoint bytes"}
    assert store.puts == [{"step": 10, "auth": f"Bearer {TOKEN}", "type": "application/octet-stream",
                           "sha": hashlib.sha256(b"checkpoint bytes").hexdigest()}]


def test_an_upload_the_store_refuses_is_not_reported_stored(store, tmp_path):
    # A cancelled run's store answers 409: the server must not say its checkpoint was uploaded.
    path = tmp_path / "run-step-00000010.pt"
    path.write_bytes(b"checkpoint bytes")
    store.refuse = True
    uploader = Uploader(store.url, TOKEN)
    uploader.submit(10, path)
    assert not uploader.close(30)
    assert uploader.refused == [10] and store.saved == {}


def test_an_upload_is_retried_until_the_store_takes_it(tmp_path):
    path = tmp_path / "run-step-00000005.pt"
    path.write_bytes(b"late")
    port = free_port()
    # Nothing listens yet: the first attempts fail, then the store comes up on that port.
    uploader = Uploader(f"http://127.0.0.1:{port}/ck", TOKEN, backoff_s=0.2, max_backoff_s=0.5)
    uploader.submit(5, path)
    time.sleep(1.0)
    late = Store(port)
    try:
        assert uploader.close(30)
        assert late.saved == {5: b"late"}
    finally:
        late.close()


def test_a_download_returns_the_latest_step_and_its_verified_bytes(store):
    store.saved = {3: b"old", 9: b"newest"}
    assert download(store.url, TOKEN) == (9, b"newest")


def test_a_download_whose_checksum_does_not_match_is_refused(store):
    store.saved = {9: b"newest"}
    store.corrupt = True
    with pytest.raises(ChecksumMismatch, match="does not match"):
        download(store.url, TOKEN)


def test_a_store_checkpoint_older_than_the_one_at_hand_is_not_fetched(store):
    # Corrupt bytes would be refused if they were read: they are not, only the step is.
    store.saved = {9: b"older"}
    store.corrupt = True
    assert download(store.url, TOKEN, min_step=10) == (9, None)


def test_an_empty_store_means_no_checkpoint(store):
    assert download(store.url, TOKEN) is None


def test_a_checkpoint_of_another_experiment_is_refused(tmp_path):
    cfg = TrainConfig(strategy="ps-gc", workers=3)
    path = checkpoint.save(tmp_path, 10, {"x": 1}, cfg)
    assert checkpoint.read(path, TrainConfig(strategy="ps-gc", workers=2))["step"] == 10  # workers may change
    with pytest.raises(ValueError, match="density"):
        checkpoint.read(path, TrainConfig(strategy="ps-gc", workers=3, density=0.05))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    cfg = TrainConfig()
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, {}, cfg)
    assert checkpoint.saved_steps(tmp_path) == [20, 30]
    assert checkpoint.latest(tmp_path) == checkpoint.run_path(tmp_path, 30)


def _ps_run(tmp_path: Path, workers: int, steps: int, *extra: str, name: str) -> tuple:
    proc = run_cli(*DIGITS, "--strategy", "ps-gc", "--workers", str(workers), "--max-steps", str(steps),
                   "--eval-every", "1000", "--checkpoint-every", "10", *extra,
                   "--metrics-out", str(tmp_path / f"{name}.jsonl"))
    assert proc.returncode == 0, proc.stderr
    return proc, read_metrics(tmp_path / f"{name}.jsonl")


@pytest.fixture(scope="module")
def uploaded(tmp_path_factory) -> tuple[Path, dict[int, bytes], list[dict]]:
    """A 2-worker, 20-step run that writes a checkpoint every 10 steps into its directory and
    uploads each to a store: (that directory, what the store kept, the run's records). Tests
    resume from copies of it."""
    tmp = tmp_path_factory.mktemp("uploaded")
    first = Store()
    try:
        _, records = _ps_run(tmp, 2, 20, "--checkpoint-url", first.url, "--report-token", TOKEN,
                             "--checkpoint-dir", str(tmp / "node-a"), name="first")
        return tmp / "node-a", dict(first.saved), records
    finally:
        first.close()


def test_the_server_writes_one_checkpoint_file_per_checkpoint_step(uploaded):
    directory, _, records = uploaded
    assert sorted(p.name for p in directory.iterdir()) == ["run-step-00000010.pt", "run-step-00000020.pt"]
    assert [e["step"] for e in events(records, EVENT_CHECKPOINT)] == [10, 20]
    state = torch.load(directory / "run-step-00000020.pt", weights_only=False)
    assert state["params"].numel() == series(records, "params")[0]
    assert state["optimizer"] and state["server"]["ranks"] == [1, 2]


def test_a_checkpoint_taken_while_the_run_goes_on_holds_its_own_steps_model_and_server_state(tmp_path):
    # The step-5 checkpoint of a 10-step run is answered and written while step 6 trains; it
    # must equal the one a 5-step run writes at its end (a constant rate: same steps, same run).
    # One dense warm-up step, so that step 5's server residual is not empty.
    args = ["--task-args", '{"lr": 0.1, "schedule": "constant"}', "--checkpoint-every", "5", "--warmup-steps", "1"]
    for name, steps in (("short", 5), ("long", 10)):
        proc = run_cli(*DIGITS, *args, "--strategy", "ps-gc", "--workers", "2", "--max-steps", str(steps),
                       "--eval-every", "1000", "--checkpoint-dir", str(tmp_path / name))
        assert proc.returncode == 0, proc.stderr
    short = torch.load(tmp_path / "short" / "run-step-00000005.pt", weights_only=False)
    long = torch.load(tmp_path / "long" / "run-step-00000005.pt", weights_only=False)
    assert torch.equal(short["params"], long["params"])
    assert torch.equal(short["server"]["residual"], long["server"]["residual"])
    short_opt, long_opt = (checkpoint.from_bytes(c["optimizer"])["state"] for c in (short, long))
    assert short_opt.keys() == long_opt.keys() and all(
        torch.equal(short_opt[k][b], long_opt[k][b]) for k in short_opt for b in short_opt[k])
    assert (tmp_path / "long" / "run-step-00000010.pt").exists()


def test_a_run_resumes_from_the_servers_checkpoint_with_a_different_number_of_workers(tmp_path):
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    _, first = _ps_run(tmp_path, 3, 20, *ck, name="first")
    proc, resumed = _ps_run(tmp_path, 2, 30, *ck, "--resume", name="resumed")
    assert "resumed from step 20 with 2 workers" in proc.stderr
    assert [e["step"] for e in events(resumed, EVENT_RESUMED)] == [20]
    loss = series(resumed, "loss")
    assert min(loss) == 21 and max(loss) == 30
    # It continued the trained model, not a fresh one.
    assert loss[21] < series(first, "loss")[1] - 0.5


def test_a_run_uploads_its_checkpoints_and_a_restart_elsewhere_resumes_from_the_store(uploaded, store, tmp_path):
    _, saved, _ = uploaded
    assert sorted(saved) in ([10, 20], [20])  # a newer file supersedes a pending older one
    store.saved = dict(saved)
    # Another node: an empty checkpoint directory; the store has the run's latest.
    url = ["--checkpoint-url", store.url, "--report-token", TOKEN]
    proc, resumed = _ps_run(tmp_path, 2, 30, *url, "--checkpoint-dir", str(tmp_path / "node-b"), "--resume",
                            name="resumed")
    assert "step 20 from the run's store" in proc.stderr
    assert min(series(resumed, "loss")) == 21
    assert max(store.saved) == 30


def test_a_restart_where_the_server_ran_resumes_from_a_checkpoint_its_upload_had_not_finished(uploaded, store,
                                                                                              tmp_path):
    directory, saved, _ = uploaded
    shutil.copytree(directory, tmp_path / "node-a")
    # The server died after writing step 20's file, before its upload was stored.
    store.saved = {step: data for step, data in saved.items() if step != 20}
    url = ["--checkpoint-url", store.url, "--report-token", TOKEN]
    ck = ["--checkpoint-dir", str(tmp_path / "node-a")]
    proc, resumed = _ps_run(tmp_path, 2, 30, *url, *ck, "--resume", name="resumed")
    assert "step 20 from" in proc.stderr and "upload had not finished" in proc.stderr
    assert min(series(resumed, "loss")) == 21


def test_a_resume_with_an_empty_store_starts_from_step_0_and_says_so(store, tmp_path):
    proc, records = _ps_run(tmp_path, 2, 10, "--checkpoint-url", store.url, "--report-token", TOKEN,
                            "--checkpoint-dir", str(tmp_path / "ck"), "--resume", name="run")
    assert "no checkpoint yet; starting from step 0" in proc.stderr
    assert min(series(records, "loss")) == 1


def test_an_allreduce_run_checkpoints_once_on_rank_0_and_resumes_from_it(tmp_path):
    args = [*DIGITS, "--strategy", "allreduce", "--workers", "2", "--eval-every", "1000",
            "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "ck")]
    first = run_cli(*args, "--max-steps", "20", "--metrics-out", str(tmp_path / "first.jsonl"))
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["run-step-00000010.pt", "run-step-00000020.pt"]
    resumed = run_cli(*args, "--max-steps", "30", "--resume", "--metrics-out", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr
    records = read_metrics(tmp_path / "resumed.jsonl")
    assert [e["step"] for e in events(records, EVENT_RESUMED)] == [20]
    for rank in (0, 1):
        assert min(series(records, "loss", rank=rank)) == 21


def test_a_checkpoint_never_holds_the_runs_report_token(tmp_path):
    cfg = TrainConfig(report_token="run-secret", report_url="http://cp/api/v1/runs/1/metrics")
    path = checkpoint.save(tmp_path, 3, {"params": torch.zeros(2)}, cfg)
    assert b"run-secret" not in path.read_bytes()
    assert torch.load(path, weights_only=False)["config"]["report_token"] is None
