"""Bundles of the user's code on a node: fetched once, verified by sha256, unpacked safely.

A bundle is a gzipped tar named by the sha256 of its bytes (docs/architecture.md, "Bundles").
`BundleCache.ensure` keeps each archive once per node under `state_dir/bundles/<sha>.tar.gz`:
a file there was hashed while it was downloaded and only renamed into place when the digest
matched, so its presence alone means "verified". `unpack` re-validates every member (the
control plane checked them on upload, but the agent trusts nothing it did not check itself)
and extracts into a temporary directory that is renamed into place, so a half-unpacked tree
is never seen and the ranks of one run on one node share one copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import time
import zlib
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from agents.client import ControlPlaneClient, call_with_retry
from agents.errors import (
    AgentAuthError,
    BundleError,
    ControlPlaneError,
    ControlPlaneRejected,
    ControlPlaneUnavailable,
)
from agents.spec import BundleRef
from hybridtrain import bundle_limits

log = logging.getLogger(__name__)

# The control plane refuses uploads above its own limit (64 MiB by default, configurable);
# the agent's bound only has to stop a runaway stream, so it sits well above that.
DEFAULT_MAX_BYTES = 1 << 30
# A small archive can expand enormously (a "zip bomb"); the unpacked tree is bounded too, by
# the limits the control plane also holds uploads to (hybridtrain/bundle_limits.py).
DEFAULT_MAX_UNPACKED_BYTES = bundle_limits.MAX_UNPACKED_BYTES
DEFAULT_MAX_MEMBERS = bundle_limits.MAX_MEMBERS
# Below the control plane's launch timeout (180 s by default): a launch still downloading
# when the run has already been failed for not starting would only start to be stopped.
DEFAULT_DOWNLOAD_DEADLINE_S = 150.0
# Connection failures and 5xx are retried this long before the role fails.
DOWNLOAD_RETRY_S = 30.0


class _HashingFile:
    """Writes to `file` while hashing, within a size and time budget."""

    def __init__(self, file: BinaryIO, ref: BundleRef, *, max_bytes: int, deadline: float) -> None:
        self.file = file
        self.ref = ref
        self.max_bytes = max_bytes
        self.deadline = deadline
        self.size = 0
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.max_bytes:
            raise BundleError(f"bundle {self.ref.short}: larger than {self.max_bytes} bytes")
        if time.monotonic() > self.deadline:
            raise BundleError(f"bundle {self.ref.short}: download did not finish in time")
        self.digest.update(data)
        self.file.write(data)


class BundleCache:
    """The node's bundles: `ensure` fetches an archive once, `unpack` extracts it once."""

    def __init__(
        self,
        state_dir: Path,
        client: ControlPlaneClient,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
        max_members: int = DEFAULT_MAX_MEMBERS,
        deadline_s: float = DEFAULT_DOWNLOAD_DEADLINE_S,
        retry_s: float = DOWNLOAD_RETRY_S,
    ) -> None:
        self.dir = Path(state_dir) / "bundles"
        self.client = client
        self.max_bytes = max_bytes
        self.max_unpacked_bytes = max_unpacked_bytes
        self.max_members = max_members
        self.deadline_s = deadline_s
        self.retry_s = retry_s
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        # Partial downloads of an agent that died mid-transfer are never renamed into place.
        for partial in self.dir.glob(".dl-*"):
            partial.unlink(missing_ok=True)

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def path_of(self, sha256: str) -> Path:
        """Where the archive of `sha256` lives once fetched."""
        return self.dir / f"{sha256}.tar.gz"

    def ensure(self, ref: BundleRef, token: str) -> Path:
        """The verified archive of `ref`, fetched with `token` unless already on this node.

        Concurrent calls for one digest fetch it once: the others wait for the first.
        Raises BundleError saying why the archive cannot be had.
        """
        final = self.path_of(ref.sha256)
        with self._lock(ref.sha256):
            if final.exists():
                return final
            try:
                call_with_retry(self._download, ref, token, final, deadline_s=self.retry_s)
            except AgentAuthError as exc:
                raise BundleError(
                    f"bundle {ref.short}: HTTP {exc.status_code} from the control plane "
                    "(credentials refused)"
                ) from exc
            except ControlPlaneRejected as exc:
                raise BundleError(f"bundle {ref.short}: HTTP {exc.status_code} from the control plane") from exc
            except ControlPlaneUnavailable as exc:
                raise BundleError(f"bundle {ref.short}: cannot download it: {exc}") from exc
            except ControlPlaneError as exc:  # pragma: no cover - the tree has no other leaves
                raise BundleError(f"bundle {ref.short}: {exc}") from exc
            except OSError as exc:
                raise BundleError(f"bundle {ref.short}: cannot store it in {self.dir}: {exc}") from exc
            log.info("fetched bundle %s (%d bytes)", ref.short, final.stat().st_size)
            return final

    def _download(self, ref: BundleRef, token: str, final: Path) -> None:
        fd, tmp_name = tempfile.mkstemp(prefix=".dl-", dir=self.dir)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as file:
                sink = _HashingFile(
                    file, ref, max_bytes=self.max_bytes,
                    deadline=time.monotonic() + self.deadline_s,
                )
                self.client.download(ref.path, token=token, sink=sink)
                file.flush()
                os.fsync(file.fileno())
            if sink.digest.hexdigest() != ref.sha256:
                raise BundleError(
                    f"bundle {ref.short}: sha256 mismatch (received {sink.size} bytes "
                    f"hashing to {sink.digest.hexdigest()[:12]}\u2026)"
                )
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def unpack(self, archive: Path, dest: Path, *, ref: BundleRef | None = None) -> Path:
        """Extract `archive` into `dest` unless `dest` already exists; returns `dest`.

        Only regular files and directories with relative paths and no `..` are accepted;
        anything else refuses the whole archive (BundleError) and leaves `dest` absent.
        """
        dest = Path(dest)
        label = ref.short if ref is not None else archive.name.split(".", 1)[0][:12] + "\u2026"
        with self._lock(f"unpack:{dest.resolve()}"):
            if dest.exists():
                return dest
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
            try:
                self._extract(archive, tmp, label)
                try:
                    os.rename(tmp, dest)
                except OSError:
                    # Another unpacker won the race; its tree is the same archive's.
                    if not dest.is_dir():
                        raise
            except OSError as exc:
                raise BundleError(f"bundle {label}: cannot unpack it: {exc}") from exc
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
            return dest

    def _extract(self, archive: Path, into: Path, label: str) -> None:
        try:
            with tarfile.open(archive, "r:gz") as tar:
                members = tar.getmembers()
                self._check_members(members, label, archive_bytes=archive.stat().st_size)
                tar.extractall(into, members=members, filter="data")
        except tarfile.FilterError as exc:
            raise BundleError(f"bundle {label}: unsafe member refused: {exc}") from exc
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise BundleError(f"bundle {label}: not a readable gzip tar: {exc}") from exc

    def _check_members(self, members: list[tarfile.TarInfo], label: str, *, archive_bytes: int) -> None:
        if len(members) > self.max_members:
            raise BundleError(f"bundle {label}: more than {self.max_members} members")
        total = 0
        for member in members:
            check_member(member, label)
            total += member.size
            if total > self.max_unpacked_bytes:
                raise BundleError(f"bundle {label}: unpacks to more than {self.max_unpacked_bytes} bytes")
        refused = bundle_limits.expansion_refusal(unpacked_bytes=total, archive_bytes=archive_bytes)
        if refused is not None:
            raise BundleError(f"bundle {label}: {refused}")


def check_member(member: tarfile.TarInfo, label: str) -> None:
    """Raise BundleError unless `member` is a regular file or directory at a safe relative path."""
    name = member.name
    if member.issym() or member.islnk():
        raise BundleError(f"bundle {label}: {name!r} is a link; only files and directories are allowed")
    if not (member.isreg() or member.isdir()):
        raise BundleError(
            f"bundle {label}: {name!r} is not a regular file or directory (devices, fifos "
            "and links are refused)"
        )
    path = PurePosixPath(name)
    if not name or "\0" in name or "\\" in name or path.is_absolute() or ".." in path.parts:
        raise BundleError(f"bundle {label}: {name!r} is not a safe relative path")


def remove_tree(path: Path) -> None:
    """Delete `path` and everything under it, if it exists."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
