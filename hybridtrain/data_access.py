"""How a role reaches a data set: what its launch order carries, the shard index's shape, and
`Origin`, which reads a data set's files from its store (S3, a web server, the control plane's
store, or the node's disk) and names the reason when it cannot.

Shared by the control plane (which builds a `DatasetAccess` per data set a run uses), the
agent (which validates it in the launch order and hands it to the trainer in a file only the
role can read, since it may carry the store's credentials) and the reader in
`hybridtrain.datasets`. Torch-free, so the control plane imports it.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlparse

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Where a data set may live: an S3(-compatible) bucket, a web server, a path on the nodes, or
# the control plane's own store (filled by `hybridtrain datasets upload`).
SCHEMES = ("s3", "https", "http", "file", "store")
DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
INDEX_FILE = "index.json"
SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
FORMAT = "webdataset"
# The URL of a data set uploaded into the control plane's own store.
STORE_URL = "store:"
URL_MAX = 2000
_CHUNK = 1024 * 1024
# Where a shard's bytes came from, as the reads ledger and the metrics name them.
FROM_STORE, FROM_SITE, FROM_NODE = "store", "site", "node"


class DatasetError(Exception):
    """A data set cannot be read: an unreadable URL, a missing credential, a corrupt shard, a
    cache too small. The message is the one-line reason a run's page shows."""


def check_dataset_url(url: str) -> str:
    """`url` if it names a data set's folder in a scheme the reader knows; ValueError saying why not."""
    if len(url) > URL_MAX:
        raise ValueError(f"url: at most {URL_MAX} characters")
    if any(c in url for c in "\0\r\n"):
        raise ValueError("url: contains a control character")
    if url.startswith("/"):
        return url  # a path that exists on the nodes
    parsed = urlparse(url)
    if parsed.scheme not in SCHEMES:
        raise ValueError(f"url: expected s3://, https://, http://, file:// or an absolute path, got {url!r}")
    if parsed.scheme in ("s3", "https", "http") and not parsed.netloc:
        raise ValueError(f"url: {url!r} names no bucket or host")
    if parsed.query or parsed.fragment:
        raise ValueError(f"url: {url!r} may carry no query or fragment")
    return url


class ShardInfo(BaseModel):
    """One shard of a data set: its file name in the data set's folder, samples, bytes, sha256."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    samples: int = Field(ge=1)
    bytes: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not SHARD_NAME.match(value) or value == INDEX_FILE:
            raise ValueError(f"shard name {value!r}: expected a plain file name")
        return value


class DatasetIndex(BaseModel):
    """`index.json`: the shards in order; sample i of the data set is found by their counts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: str = FORMAT
    version: int = 1
    shards: list[ShardInfo] = Field(min_length=1)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def size_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value != FORMAT:
            raise ValueError(f"format: expected {FORMAT!r}, got {value!r}")
        return value


class DatasetAccess(BaseModel):
    """One data set as a role reads it: where it is, the credentials for the store, and the
    site cache to read through (None: straight from the store)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: int = Field(ge=1)
    name: str = Field(min_length=1, max_length=128)
    # The folder holding index.json and the shards; `store:` names the control plane's own
    # store, reached at `store_url` with `token`.
    url: str = Field(max_length=URL_MAX)
    store_url: str | None = Field(default=None, max_length=URL_MAX)
    token: str | None = Field(default=None, max_length=200)
    # An S3-compatible endpoint (None: AWS's own) and the keys, from the control plane's settings.
    endpoint_url: str | None = Field(default=None, max_length=URL_MAX)
    region: str | None = Field(default=None, max_length=64)
    access_key_id: str | None = Field(default=None, max_length=256)
    secret_access_key: str | None = Field(default=None, max_length=256)
    # The site cache (`hybridtrain datasets serve-cache`), an http(s) base URL.
    cache_url: str | None = Field(default=None, max_length=URL_MAX)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not DATASET_NAME.match(value):
            raise ValueError(f"name {value!r}: use 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_dataset_url(value)

    @field_validator("store_url", "endpoint_url", "cache_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
            raise ValueError(f"expected an http(s) URL without query, got {value!r}")
        return value


def parse_index(raw: bytes, where: str) -> DatasetIndex:
    """`index.json`'s bytes as a DatasetIndex; DatasetError naming `where` when they are not one."""
    try:
        return DatasetIndex.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise DatasetError(f"{where}/{INDEX_FILE} is not a data set index: {loc}: {first['msg']}") from None


# -- the stores ----------------------------------------------------------------------------------


class Origin:
    """Where a data set's files live; `fetch` writes one of them to `out` and returns its bytes."""

    def __init__(self, access: DatasetAccess) -> None:
        self.access = access
        self.url = access.url.rstrip("/")
        self._s3: Any = None
        self._s3_pid = 0

    @property
    def local_root(self) -> Path | None:
        """The folder on this node, for a data set on the nodes' disks (read in place, never cached)."""
        if self.url.startswith("/"):
            return Path(self.url)
        if self.url.startswith("file://"):
            return Path(urlparse(self.url).path)
        return None

    def fetch(self, name: str, out: IO[bytes]) -> int:
        """Copy file `name` of the data set into `out`; DatasetError with the reason it cannot."""
        if not SHARD_NAME.match(name):
            raise DatasetError(f"{name!r} is not a file of a data set")
        root = self.local_root
        try:
            if root is not None:
                with (root / name).open("rb") as f:
                    return _copy(f, out)
            scheme = urlparse(self.url).scheme
            if scheme == "s3":
                return self._fetch_s3(name, out)
            return self._fetch_http(name, out)
        except DatasetError:
            raise
        except OSError as exc:
            raise DatasetError(f"cannot read {self.where(name)}: {exc.strerror or exc}") from None

    def fetch_into(self, shard: ShardInfo) -> Callable[[IO[bytes]], str]:
        """A NodeCache `fill` that reads `shard` from this store."""
        def fill(out: IO[bytes]) -> str:
            self.fetch(shard.name, out)
            return FROM_STORE

        return fill

    def where(self, name: str) -> str:
        """The file's address as messages name it (never with credentials)."""
        return f"{self.url}/{name}"

    def _fetch_s3(self, name: str, out: IO[bytes]) -> int:
        import botocore.exceptions

        parsed = urlparse(self.url)
        key = "/".join(p for p in (parsed.path.strip("/"), name) if p)
        if not (self.access.access_key_id and self.access.secret_access_key):
            raise DatasetError(f"cannot read {self.where(name)}: no credential for the store "
                               "(the control plane's HYBRIDTRAIN_DATASET_S3_ACCESS_KEY_ID and _SECRET_ACCESS_KEY)")
        try:
            response = self._client().get_object(Bucket=parsed.netloc, Key=key)
            return _copy(response["Body"], out)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "error")
            raise DatasetError(f"cannot read {self.where(name)}: the store answered {code}") from None
        except botocore.exceptions.BotoCoreError as exc:
            raise DatasetError(f"cannot read {self.where(name)}: {exc}") from None

    def _client(self) -> Any:
        # A DataLoader process forked from this one must not share the parent's connections.
        if self._s3 is None or self._s3_pid != os.getpid():
            self._s3_pid = os.getpid()
            import boto3
            from botocore.config import Config

            self._s3 = boto3.client(
                "s3", endpoint_url=self.access.endpoint_url, region_name=self.access.region or "us-east-1",
                aws_access_key_id=self.access.access_key_id,
                aws_secret_access_key=self.access.secret_access_key,
                config=Config(retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10, read_timeout=60),
            )
        return self._s3

    def _fetch_http(self, name: str, out: IO[bytes]) -> int:
        import httpx

        if urlparse(self.url).scheme == "store":
            if not self.access.store_url:
                raise DatasetError(f"cannot read {self.where(name)}: the launch order names no control plane store")
            url = f"{self.access.store_url.rstrip('/')}/{quote(name)}"
        else:
            url = f"{self.url}/{quote(name)}"
        headers = {"Authorization": f"Bearer {self.access.token}"} if self.access.token else {}
        try:
            with httpx.stream("GET", url, headers=headers, timeout=60.0, follow_redirects=True) as response:
                if response.status_code != 200:
                    raise DatasetError(f"cannot read {self.where(name)}: HTTP {response.status_code}")
                n = 0
                for chunk in response.iter_bytes(_CHUNK):
                    out.write(chunk)
                    n += len(chunk)
                return n
        except httpx.HTTPError as exc:
            raise DatasetError(f"cannot read {self.where(name)}: {exc}") from None

    def index(self) -> DatasetIndex:
        """The data set's index, read from the store."""
        buffer = io.BytesIO()
        self.fetch(INDEX_FILE, buffer)
        return parse_index(buffer.getvalue(), self.url)


def _copy(source: Any, out: IO[bytes]) -> int:
    n = 0
    while chunk := source.read(_CHUNK):
        out.write(chunk)
        n += len(chunk)
    return n
