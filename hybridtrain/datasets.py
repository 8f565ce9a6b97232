"""Sharded data sets: writing webdataset shards, reading them through a bounded node cache and
a site cache, and the map-style torch data set a worker's loader takes its share from.

A data set is a folder (in S3, on a web server, on the nodes' disks or in the control plane's
store) holding `index.json` and webdataset tar shards. The reader fetches a whole shard into
the node's cache (named by its sha256, checked on arrival, evicted least-recently-used past
the cache's bound) and serves samples from it; `epoch_order` shuffles shards and then samples
within windows of a few shards, so the consecutive global batches the run's loader hands out
(each worker its batch-share slice, trainer/loader.py) touch a few shards at a time.
docs/datasets.md is the reference.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridtrain.data_access import (
    FROM_NODE,
    FROM_SITE,
    FROM_STORE,
    INDEX_FILE,
    DatasetAccess,
    DatasetError,
    DatasetIndex,
    Origin,
    ShardInfo,
    parse_index,
)

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024
DEFAULT_CACHE_BYTES = 20 * 1024**3
# Shards whose samples one epoch shuffles together: more mixes better, fewer keeps the shards a
# step touches (and a bounded cache must hold) few.
DEFAULT_WINDOW = 4
_CHUNK = 1024 * 1024
# What `take_reads` sums besides the bytes by source: the samples the loader fetched and their digest.
SAMPLES, DIGEST = "samples", "digest"


# -- writing -------------------------------------------------------------------------------------


def write_dataset(samples: Iterable[Any], out_dir: str | Path, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                  progress: Callable[[int], None] | None = None) -> DatasetIndex:
    """Write `samples` (anything `torch.save` keeps with weights_only: tensors, numbers, tuples,
    dicts) as webdataset shards of about `shard_bytes` plus `index.json` in `out_dir`."""
    return _write(({"__key__": f"{i:010d}", "pth": s} for i, s in enumerate(samples)), Path(out_dir),
                  shard_bytes=shard_bytes, progress=progress)


def pack_dir(src_dir: str | Path, out_dir: str | Path, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
             progress: Callable[[int], None] | None = None) -> DatasetIndex:
    """Shard a folder of files the webdataset way: files sharing a name up to the first dot
    (`0001.jpg`, `0001.cls`) are one sample, whose fields are their extensions."""
    src = Path(src_dir)
    if not src.is_dir():
        raise DatasetError(f"--from: {src} is not a folder")
    groups: dict[str, dict[str, Path]] = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src).as_posix()
        stem, dot, ext = rel.partition(".")
        if not dot or not ext:
            raise DatasetError(f"--from: {rel} has no extension; a sample's files are KEY.EXT")
        groups.setdefault(stem, {})[ext] = path
    if not groups:
        raise DatasetError(f"--from: {src} holds no files")

    def samples() -> Iterator[dict[str, Any]]:
        for key, fields in groups.items():
            yield {"__key__": key, **{ext: p.read_bytes() for ext, p in fields.items()}}

    return _write(samples(), Path(out_dir), shard_bytes=shard_bytes, progress=progress)


def _write(samples: Iterable[dict[str, Any]], out: Path, *, shard_bytes: int,
           progress: Callable[[int], None] | None) -> DatasetIndex:
    import webdataset as wds

    if shard_bytes < 1:
        raise DatasetError(f"shard_bytes must be >= 1, got {shard_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    counts: OrderedDict[str, int] = OrderedDict()
    writer = wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=shard_bytes, verbose=0,
                             encoder=_encode, mtime=0)
    try:
        for n, sample in enumerate(samples, 1):
            writer.write(sample)
            name = Path(writer.fname).name
            counts[name] = counts.get(name, 0) + 1
            if progress is not None:
                progress(n)
    finally:
        writer.close()
    if not counts:
        raise DatasetError("no samples to write")
    shards = [ShardInfo(name=name, samples=n, bytes=(out / name).stat().st_size, sha256=_sha256(out / name))
              for name, n in counts.items()]
    index = DatasetIndex(shards=shards)
    (out / INDEX_FILE).write_text(index.model_dump_json(indent=1))
    return index


def _encode(sample: dict[str, Any]) -> dict[str, bytes]:
    out: dict[str, Any] = {"__key__": sample["__key__"]}
    for key, value in sample.items():
        if key == "__key__":
            continue
        if isinstance(value, bytes):
            out[key] = value
        else:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            out[key] = buffer.getvalue()
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sample_digest(indices: Iterable[int] | np.ndarray) -> int:
    """The sum of a 32-bit hash (splitmix64's finaliser) of each sample index. Sums add up across
    workers and steps, and an epoch's equal `sample_digest(range(n))` with its count equal n only
    when every sample was read once (but for a chance of about 2**-32); a batch's digest stays
    below 2**53, so it travels exactly as a float metric."""
    x = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices), dtype=np.uint64)
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return int((x >> np.uint64(32)).sum(dtype=np.uint64))


def read_index(path: str | Path) -> DatasetIndex:
    """A local data set folder's index; DatasetError naming what is wrong with it."""
    return parse_index(Path(path, INDEX_FILE).read_bytes(), str(path))


# -- the node cache ------------------------------------------------------------------------------


class NodeCache:
    """Shards on this node's disk, named by sha256, at most `max_bytes` of them: a shard read
    again (by another rank, loader process or run) comes from here; the least recently used
    go first. A lock file per shard lets one process fetch while the others wait for it."""

    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if max_bytes < 1:
            raise DatasetError(f"the cache's bound must be >= 1 byte, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, sha256: str) -> Path:
        return self.root / f"{sha256}.tar"

    def get(self, shard: ShardInfo, fill: Callable[[IO[bytes]], str]) -> tuple[Path, str]:
        """The cached shard's path and where its bytes came from this time (`node` when it was
        here); `fill` writes a missing shard and says where it read it."""
        path = self.path(shard.sha256)
        if _touch(path):
            return path, FROM_NODE
        if shard.bytes > self.max_bytes:
            raise DatasetError(f"the node's data cache ({self.max_bytes} bytes) cannot hold shard "
                               f"{shard.name} ({shard.bytes} bytes): raise its bound")
        with self._locked(shard.sha256):
            if _touch(path):
                return path, FROM_NODE
            self._make_room(shard.bytes)
            fd, temp = tempfile.mkstemp(dir=self.root, prefix=".fetch-", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out:
                    source = fill(out)
                check_shard(Path(temp), shard)
                os.replace(temp, path)
            finally:
                Path(temp).unlink(missing_ok=True)
            return path, source

    @contextlib.contextmanager
    def _locked(self, sha256: str) -> Iterator[None]:
        lock = self.root / f"{sha256}.lock"
        with lock.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def used_bytes(self) -> int:
        """Bytes of shards held now."""
        return sum(p.stat().st_size for p in self.root.glob("*.tar"))

    def _make_room(self, incoming: int) -> None:
        held = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in self.root.glob("*.tar")),
                      key=lambda t: t[0])
        used = sum(size for _, size, _ in held)
        for _, size, path in held:
            if used + incoming <= self.max_bytes:
                break
            # A reader with the file open keeps its inode: eviction never breaks a read under way.
            path.unlink(missing_ok=True)
            used -= size
        free = shutil.disk_usage(self.root).free
        if free < incoming:
            raise DatasetError(f"the disk under the data cache {self.root} has {free} bytes free, "
                               f"the shard needs {incoming}")


def _touch(path: Path) -> bool:
    # The mtime is the recency the eviction orders by.
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def check_shard(path: Path, shard: ShardInfo) -> None:
    """DatasetError when the file at `path` is not the shard the index describes."""
    size = path.stat().st_size
    if size != shard.bytes:
        raise DatasetError(f"shard {shard.name} is truncated or corrupt: {size} bytes, the index says {shard.bytes}")
    if _sha256(path) != shard.sha256:
        raise DatasetError(f"shard {shard.name} is corrupt: its sha256 is not the index's {shard.sha256[:12]}")


# -- the site cache ------------------------------------------------------------------------------


class ShardRequest(BaseModel):
    """What a role asks the site cache for: a shard, and the data set's access to fetch it with."""

    model_config = ConfigDict(extra="forbid")

    access: DatasetAccess
    shard: ShardInfo


class IndexRequest(BaseModel):
    """A role asking the site cache for a data set's index (read from the store each time)."""

    model_config = ConfigDict(extra="forbid")

    access: DatasetAccess


@dataclass
class SiteCache:
    """One node's cache served to its site over HTTP: a shard crosses the WAN once per site.

    POST /shards with a `ShardRequest` answers the shard's bytes and `X-Hybridtrain-Cache:
    hit|miss`; a miss is fetched from the store (once, whoever else asks meanwhile) into the
    cache first. POST /index with an `IndexRequest` answers the data set's index, read from the
    store each time (a data set rewritten in place gets its new one), so a role behind a site
    cache never reaches the store itself. GET /health answers 200; GET /stats the counters of
    `stats()`.
    """

    cache: NodeCache
    fetched_bytes: int = 0
    served_bytes: int = 0
    index_bytes: int = 0
    # Per shard (by sha256): its name, the times it was fetched from the store and served.
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _count(self, shard: ShardInfo, fetched: bool) -> None:
        with self._lock:
            counts = self.shards.setdefault(shard.sha256, {"name": shard.name, "fetched": 0, "served": 0})
            counts["served"] += 1
            self.served_bytes += shard.bytes
            if fetched:
                counts["fetched"] += 1
                self.fetched_bytes += shard.bytes

    def _count_index(self, n: int) -> None:
        with self._lock:
            self.index_bytes += n

    def stats(self) -> dict[str, Any]:
        """Bytes of shards fetched from stores (each crossed the WAN) and served to the site,
        bytes of indexes passed on, since the start, and per shard the times it was fetched and
        served: how a site's WAN traffic is measured."""
        with self._lock:
            return {"fetched_bytes": self.fetched_bytes, "served_bytes": self.served_bytes,
                    "index_bytes": self.index_bytes, "shards": {k: dict(v) for k, v in self.shards.items()}}

    def serve(self, host: str, port: int) -> ThreadingHTTPServer:
        """A started server (its thread is a daemon); `shutdown()` stops it."""
        site = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/health":
                    self._answer(200, b"ok\n")
                elif self.path == "/stats":
                    self._answer(200, json.dumps(site.stats()).encode(), "application/json")
                else:
                    self._answer(404, b"")

            def do_POST(self) -> None:  # noqa: N802
                if self.path not in ("/shards", "/index"):
                    self._answer(404, b"")
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(min(length, 1 << 20))
                    if self.path == "/index":
                        self._index(IndexRequest.model_validate_json(body))
                        return
                    request = ShardRequest.model_validate_json(body)
                except (ValueError, ValidationError) as exc:
                    self._answer(422, str(exc).encode()[:2000])
                    return
                try:
                    path, source = site.cache.get(request.shard, Origin(request.access).fetch_into(request.shard))
                except DatasetError as exc:
                    self._answer(502, str(exc).encode())
                    return
                site._count(request.shard, fetched=source == FROM_STORE)
                with path.open("rb") as f:
                    self.send_response(200)
                    self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                    self.send_header("X-Hybridtrain-Cache", "miss" if source == FROM_STORE else "hit")
                    self.end_headers()
                    shutil.copyfileobj(f, self.wfile, _CHUNK)

            def _index(self, request: IndexRequest) -> None:
                buffer = io.BytesIO()
                try:
                    n = Origin(request.access).fetch(INDEX_FILE, buffer)
                except DatasetError as exc:
                    self._answer(502, str(exc).encode())
                    return
                site._count_index(n)
                self._answer(200, buffer.getvalue(), "application/json")

            def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True, name="site-cache").start()
        return server


def index_via_site(access: DatasetAccess) -> bytes:
    """The data set's `index.json` as the site cache at `access.cache_url` read it from the store."""
    import httpx

    assert access.cache_url is not None
    body = IndexRequest(access=access).model_dump_json()
    try:
        response = httpx.post(f"{access.cache_url.rstrip('/')}/index", content=body,
                              headers={"Content-Type": "application/json"}, timeout=60.0)
    except httpx.HTTPError as exc:
        raise DatasetError(f"the site cache {access.cache_url} is unreachable: {exc}") from None
    if response.status_code != 200:
        raise DatasetError(f"the site cache {access.cache_url} could not read the index of {access.url}: "
                           f"{response.text.strip() or response.status_code}")
    return response.content


def fetch_via_site(access: DatasetAccess, shard: ShardInfo, out: IO[bytes]) -> str:
    """Write `shard` from the site cache at `access.cache_url` into `out`; `store` when the
    cache had to fetch it (this read crossed the WAN), `site` when it held it."""
    import httpx

    assert access.cache_url is not None
    body = ShardRequest(access=access, shard=shard).model_dump_json()
    try:
        with httpx.stream("POST", f"{access.cache_url.rstrip('/')}/shards", content=body,
                          headers={"Content-Type": "application/json"}, timeout=300.0) as response:
            if response.status_code != 200:
                response.read()
                raise DatasetError(f"the site cache {access.cache_url} could not serve shard {shard.name}: "
                                   f"{response.text.strip() or response.status_code}")
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
            return FROM_STORE if response.headers.get("X-Hybridtrain-Cache") == "miss" else FROM_SITE
    except httpx.HTTPError as exc:
        raise DatasetError(f"the site cache {access.cache_url} is unreachable: {exc}") from None


# -- reading -------------------------------------------------------------------------------------


def decode_field(ext: str, raw: bytes) -> Any:
    """One field of a sample from its bytes, by its extension; unknown extensions stay bytes.
    Never unpickles: `.pth` loads with torch's weights_only, `.npy` without pickles."""
    last = ext.rsplit(".", 1)[-1].lower()
    if last == "pth":
        return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    if last in ("cls", "id", "index"):
        return int(raw)
    if last == "json":
        return json.loads(raw)
    if last == "txt":
        return raw.decode()
    if last == "npy":
        import numpy as np

        return np.load(io.BytesIO(raw), allow_pickle=False)
    return raw


def read_shard(path: Path, shard: ShardInfo) -> list[Any]:
    """A cached shard's samples in order: the object itself for a `write_dataset` sample (one
    `pth` field), else a dict of its decoded fields."""
    import tarfile

    from webdataset.tariterators import group_by_keys, tar_file_iterator

    try:
        with path.open("rb") as stream:
            files = ({**f, "__url__": shard.name} for f in tar_file_iterator(stream))
            samples = list(group_by_keys(files))
    except (tarfile.TarError, OSError, ValueError) as exc:
        raise DatasetError(f"shard {shard.name} is corrupt: {exc}") from None
    out = []
    for sample in samples:
        fields = {k: v for k, v in sample.items() if not k.startswith("__")}
        try:
            decoded = {k: decode_field(k, v) for k, v in fields.items()}
        except Exception as exc:  # noqa: BLE001 - a user's bytes fail in many ways; name the shard
            raise DatasetError(f"shard {shard.name}: a sample cannot be decoded: {exc}") from None
        out.append(decoded["pth"] if set(decoded) == {"pth"} else decoded)
    if len(out) != shard.samples:
        raise DatasetError(f"shard {shard.name} holds {len(out)} samples, the index says {shard.samples}")
    return out


# A ledger untouched this long belongs to a process long gone (its counts were reported).
_LEDGER_KEEP_S = 7 * 24 * 3600


def _drop_old_ledgers(folder: Path) -> None:
    import time

    cutoff = time.time() - _LEDGER_KEEP_S
    for path in folder.glob("*.log"):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime < cutoff:
                path.unlink()


class ShardedDataset(torch.utils.data.Dataset):
    """A data set of shards as a map-style torch data set (`len`, `[i]`), plus `epoch_order`,
    which the run's loader uses in place of a plain permutation.

    Reads go through the node cache (and the site cache, when the access names one); bytes
    fetched, and the batches the loader fetched, are appended to a ledger that `take_reads`
    sums, so loader processes count too.
    """

    def __init__(self, access: DatasetAccess, cache: NodeCache | None, *, window: int = DEFAULT_WINDOW,
                 index: DatasetIndex | None = None) -> None:
        self.access, self.cache, self.window = access, cache, max(1, window)
        self.origin = Origin(access)
        if cache is None and self.origin.local_root is None:
            raise DatasetError(f"data set {access.name!r} is remote: reading it needs a node cache")
        if cache is not None:
            ledger_dir = cache.root / "reads"
            ledger_dir.mkdir(exist_ok=True)
            _drop_old_ledgers(ledger_dir)
            fd, ledger = tempfile.mkstemp(dir=ledger_dir, prefix=f"{access.name}-", suffix=".log")
            os.close(fd)
            self.ledger: Path | None = Path(ledger)
        else:
            self.ledger = None
        self._ledger_at = 0
        if index is None:
            if access.cache_url and self.origin.local_root is None:
                raw = index_via_site(access)  # read from the store by the site cache, for this role
            else:
                buffer = io.BytesIO()
                self.origin.fetch(INDEX_FILE, buffer)
                raw = buffer.getvalue()
            self._note(FROM_STORE if self.origin.local_root is None else FROM_NODE, len(raw))
            index = parse_index(raw, access.url)
        self.index = index
        self.starts = [0]
        for shard in index.shards:
            self.starts.append(self.starts[-1] + shard.samples)
        self._decoded: OrderedDict[int, list[Any]] = OrderedDict()
        self._orders: dict[tuple[int, int], Any] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of a data set of {len(self)}")
        j = bisect.bisect_right(self.starts, i) - 1
        return self.shard_samples(j)[i - self.starts[j]]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples, as torch's DataLoader fetches them: counted in the ledger (how
        many, and their `sample_digest`), so the run's reports show what each worker read."""
        out = [self[i] for i in indices]
        if self.ledger is not None and indices:
            with self.ledger.open("a") as f:
                f.write(f"{SAMPLES} {len(indices)} {sample_digest(indices)}\n")
        return out

    def shard_samples(self, j: int) -> list[Any]:
        """Shard `j`'s decoded samples (the last few are kept in memory)."""
        if j in self._decoded:
            self._decoded.move_to_end(j)
            return self._decoded[j]
        shard = self.index.shards[j]
        samples = read_shard(self._local(shard), shard)
        self._decoded[j] = samples
        while len(self._decoded) > self.window + 1:
            self._decoded.popitem(last=False)
        return samples

    def _local(self, shard: ShardInfo) -> Path:
        root = self.origin.local_root
        if root is not None:
            path = root / shard.name
            if not path.is_file():
                raise DatasetError(f"cannot read {self.origin.where(shard.name)}: no such file on this node")
            # Read in place, so never hashed here: its size still catches a truncated copy.
            if path.stat().st_size != shard.bytes:
                raise DatasetError(f"shard {shard.name} is truncated or corrupt: {path.stat().st_size} bytes, "
                                   f"the index says {shard.bytes}")
            return path
        assert self.cache is not None
        access = self.access

        def fill(out: IO[bytes]) -> str:
            if access.cache_url:
                return fetch_via_site(access, shard, out)
            self.origin.fetch(shard.name, out)
            return FROM_STORE

        path, source = self.cache.get(shard, fill)
        self._note(source, shard.bytes)
        return path

    def _note(self, source: str, n: int) -> None:
        if self.ledger is not None and source != FROM_NODE:
            # One short O_APPEND write per shard: loader processes never interleave a line.
            with self.ledger.open("a") as f:
                f.write(f"{source} {n}\n")

    def take_reads(self) -> dict[str, int]:
        """Bytes fetched since the last call, by where from (`store`: over the WAN, `site`:
        from the site cache), and the `samples` the loader fetched with their `digest`, summed
        over this process and its loader processes."""
        totals = {FROM_STORE: 0, FROM_SITE: 0, SAMPLES: 0, DIGEST: 0}
        if self.ledger is None:
            return totals
        with self.ledger.open("rb") as f:
            f.seek(self._ledger_at)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._ledger_at += len(complete)
        for line in complete.decode().splitlines():
            what, *numbers = line.split()
            if what == SAMPLES:
                totals[SAMPLES] += int(numbers[0])
                totals[DIGEST] += int(numbers[1])
            else:
                totals[what] = totals.get(what, 0) + int(numbers[0])
        return totals

    def epoch_order(self, seed: int, epoch: int) -> Any:
        """Epoch `epoch`'s sample order: the shards shuffled, then samples shuffled within each
        run of `window` shards. The same on every rank; each sample once."""
        key = (seed, epoch)
        if key not in self._orders:
            gen = torch.Generator().manual_seed(seed * 100_003 + epoch)
            shards = torch.randperm(len(self.index.shards), generator=gen).tolist()
            parts = []
            for w in range(0, len(shards), self.window):
                ids = torch.cat([torch.arange(self.starts[j], self.starts[j + 1]) for j in shards[w:w + self.window]])
                parts.append(ids[torch.randperm(len(ids), generator=gen)])
            self._orders = {key: torch.cat(parts)}
        return self._orders[key]


# -- what a role was handed ----------------------------------------------------------------------


class DatasetsFile(BaseModel):
    """The file an agent writes for a role (`--datasets-file`): its data sets and its cache."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetAccess] = Field(default_factory=list)
    cache_dir: str | None = None
    cache_bytes: int = Field(default=DEFAULT_CACHE_BYTES, ge=1)


@dataclass
class _Registry:
    handed: DatasetsFile | None = None
    opened: list[ShardedDataset] | None = None


_REGISTRY = _Registry()


def use_datasets(handed: DatasetsFile) -> None:
    """Make the data sets of this role's launch order what `dataset(name)` finds (the trainer's
    command line calls this once, from `--datasets-file`)."""
    _REGISTRY.handed, _REGISTRY.opened = handed, []


def load_datasets_file(path: str | Path) -> DatasetsFile:
    """A `--datasets-file`, validated; DatasetError naming the problem."""
    try:
        return DatasetsFile.model_validate_json(Path(path).read_bytes())
    except (OSError, ValidationError) as exc:
        raise DatasetError(f"--datasets-file {path}: {exc}") from None


def dataset(name: str, *, url: str | None = None, cache_dir: str | Path | None = None,
            cache_bytes: int = DEFAULT_CACHE_BYTES, window: int = DEFAULT_WINDOW) -> ShardedDataset:
    """The data set `name` of this run as a torch data set; give it to `hybridtrain.data_loader`
    (or a Task's train_data) and each worker reads its batch share of every epoch.

    Outside a run, `url` (a folder on this machine or an https:// one) and `cache_dir` say where.
    """
    handed = _REGISTRY.handed
    if url is not None:
        access = DatasetAccess(id=1, name=name, url=url)
        return ShardedDataset(access, NodeCache(cache_dir, cache_bytes) if cache_dir else None, window=window)
    if handed is None:
        raise DatasetError(f"data set {name!r}: this process was not launched with data sets; "
                           "name them in the run (`runs create --dataset NAME`) or pass url=")
    for access in handed.datasets:
        if access.name == name:
            root = cache_dir or handed.cache_dir
            cache = NodeCache(root, handed.cache_bytes) if root else None
            opened = ShardedDataset(access, cache, window=window)
            assert _REGISTRY.opened is not None
            _REGISTRY.opened.append(opened)
            return opened
    names = ", ".join(a.name for a in handed.datasets) or "none"
    raise DatasetError(f"data set {name!r} is not one this run uses (it uses: {names})")


def opened_datasets() -> list[ShardedDataset]:
    """The data sets this role opened through `dataset(name)`: the trainer reports their reads."""
    return list(_REGISTRY.opened or [])
