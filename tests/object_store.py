"""A real S3 endpoint for tests: moto's standalone server (`moto_server`), a process on a free
loopback port, and helpers to put a data set folder into one of its buckets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# moto accepts any key pair; the tests still pass them as a real store needs them.
ACCESS_KEY, SECRET_KEY, REGION = "test-key-id", "test-secret-key", "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """A running moto server: its endpoint and a boto3 client of it."""

    endpoint: str
    pid: int

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)

    def put_folder(self, folder: Path, bucket: str, prefix: str) -> str:
        """Upload every file of `folder` under s3://bucket/prefix/; the data set's URL."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        for path in sorted(folder.iterdir()):
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
        return f"s3://{bucket}/{prefix}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[S3Server]:
    """Start `moto_server` on a free port, wait until it answers, stop it (and only it) after."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MOTO_CALL_RESET_API": "false"}, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}")
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not answer within 60 s") from None
                time.sleep(0.2)
        yield S3Server(endpoint, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
