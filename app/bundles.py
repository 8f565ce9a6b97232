"""Bundles of users' code: reading an upload within the size limit, checking the archive, and
keeping its bytes (in the database, or as files in `bundle_dir`).

An archive is accepted when it is a gzipped tar whose members are only regular files and
directories under relative paths without `..` (the agent checks the same again on unpacking).
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import tempfile
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import HybridtrainError, InvalidFieldError, NotFoundError
from app.models import Bundle, BundleStorage
from hybridtrain.bundle_limits import unpack_refusal

CHUNK = 1024 * 1024
# Uploads up to this size stay in memory while they are checked; larger ones spill to disk.
_SPOOL_IN_MEMORY = 4 * 1024 * 1024


class BundleTooLargeError(HybridtrainError):
    """The upload is larger than `bundle_max_bytes` (answered 413, naming the field `file`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"file: the bundle is larger than the limit of {limit} bytes "
            "(HYBRIDTRAIN_BUNDLE_MAX_BYTES)"
        )
        self.field = "file"
        self.limit = limit


@dataclass
class Upload:
    """An uploaded archive, spooled: its bytes, size and sha256, and what the client declared."""

    file: IO[bytes]
    size: int
    sha256: str
    filename: str | None = None
    declared_sha256: str | None = None

    def close(self) -> None:
        self.file.close()


class _Spool:
    """Collects chunks into a spooled temp file, hashing them and enforcing the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.file: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY)  # noqa: SIM115
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.file.close()
            raise BundleTooLargeError(self.limit)
        self.digest.update(chunk)
        self.file.write(chunk)

    def finish(self, *, filename: str | None, declared_sha256: str | None) -> Upload:
        self.file.seek(0)
        return Upload(self.file, self.size, self.digest.hexdigest(), filename, declared_sha256)


async def spool_stream(
    chunks: AsyncIterator[bytes], *, limit: int, filename: str | None = None,
    declared_sha256: str | None = None,
) -> Upload:
    """Read an upload chunk by chunk; BundleTooLargeError as soon as it passes `limit`."""
    spool = _Spool(limit)
    async for chunk in chunks:
        spool.write(chunk)
    return spool.finish(filename=filename, declared_sha256=declared_sha256)


def spool_file(
    source: IO[bytes], *, limit: int, filename: str | None = None,
    declared_sha256: str | None = None,
) -> Upload:
    """`spool_stream` for a file object (a multipart part)."""
    spool = _Spool(limit)
    while chunk := source.read(CHUNK):
        spool.write(chunk)
    return spool.finish(filename=filename, declared_sha256=declared_sha256)


def clean_filename(name: str | None) -> str | None:
    """The last path component of a client's file name, printable and at most 255 characters."""
    if not name:
        return None
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())[:255].strip()
    return base or None


def check_declared_sha256(upload: Upload) -> None:
    """InvalidFieldError('sha256') when the client declared a digest the bytes do not have."""
    declared = upload.declared_sha256
    if declared is None:
        return
    if declared.strip().lower() != upload.sha256:
        raise InvalidFieldError(
            "sha256",
            f"sha256 mismatch: declared {declared.strip()[:64]!r}, the upload is {upload.sha256}",
        )


def unsafe_member_reason(member: tarfile.TarInfo) -> str | None:
    """Why `member` may not be unpacked (None when it may): links, devices, `..`, absolute paths."""
    if not (member.isfile() or member.isdir()):
        return f"{member.name!r} is not a regular file or directory"
    name = member.name
    if not name or name.startswith("/") or "\\" in name or "\x00" in name:
        return f"{name!r} is not a relative path"
    if ".." in PurePosixPath(name).parts:
        return f"{name!r} leaves the archive's folder"
    return None


def count_files(fileobj: IO[bytes]) -> int:
    """The regular files in a gzipped tar; InvalidFieldError('file') for anything unsafe, or
    for an archive the agents would refuse to unpack (hybridtrain/bundle_limits.py), found
    from the members' headers before their contents are decompressed."""
    archive_bytes = fileobj.seek(0, os.SEEK_END)
    fileobj.seek(0)
    files = members = unpacked = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r:gz") as archive:
            for member in archive:
                reason = unsafe_member_reason(member)
                if reason is not None:
                    raise InvalidFieldError("file", f"unsafe archive member: {reason}")
                members += 1
                unpacked += member.size
                refused = unpack_refusal(members=members, unpacked_bytes=unpacked, archive_bytes=archive_bytes)
                if refused is not None:
                    raise InvalidFieldError("file", f"the agents would refuse to unpack this bundle: {refused}")
                files += member.isfile()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise InvalidFieldError("file", f"not a gzipped tar archive: {exc}") from None
    finally:
        fileobj.seek(0)
    if files == 0:
        raise InvalidFieldError("file", "the archive holds no files")
    return files


# --- storage ------------------------------------------------------------------------------------


def bundle_path(bundle_dir: Path, sha256: str) -> Path:
    """Where a bundle kept in `bundle_dir` lies."""
    return bundle_dir / f"{sha256}.tar.gz"


def write_atomically(target: Path, source: IO[bytes]) -> None:
    """Copy `source` to `target` so that a reader (or a crash) never sees half a file under
    the final name (bundles and checkpoints alike)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=".upload-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            source.seek(0)
            while chunk := source.read(CHUNK):
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def store_bundle(
    session: Session, *, upload: Upload, files: int, created_by: str, bundle_dir: Path | None
) -> Bundle:
    """Add the bundle row (and its file in `bundle_dir`, when set); the caller commits."""
    bundle = Bundle(
        sha256=upload.sha256, size_bytes=upload.size, filename=upload.filename, files=files,
        created_by=created_by,
    )
    upload.file.seek(0)
    if bundle_dir is None:
        bundle.stored_in = BundleStorage.db
        bundle.content = upload.file.read()
    else:
        bundle.stored_in = BundleStorage.dir
        write_atomically(bundle_path(bundle_dir, upload.sha256), upload.file)
    session.add(bundle)
    session.flush()
    return bundle


def read_content(session: Session, *, bundle: Bundle, bundle_dir: Path | None) -> bytes | Path:
    """The archive's bytes (kept in the database) or the path of its file."""
    if bundle.stored_in == BundleStorage.dir:
        if bundle_dir is None or not bundle_path(bundle_dir, bundle.sha256).is_file():
            raise NotFoundError("archive of bundle", bundle.sha256)
        return bundle_path(bundle_dir, bundle.sha256)
    content = session.scalar(select(Bundle.content).where(Bundle.sha256 == bundle.sha256))
    if content is None:
        raise NotFoundError("archive of bundle", bundle.sha256)
    return content


def iter_file(path: Path) -> Iterator[bytes]:
    """A file's bytes in chunks (a download never holds a whole archive in memory)."""
    with path.open("rb") as source:
        while chunk := source.read(CHUNK):
            yield chunk


def remove_file(bundle_dir: Path | None, sha256: str) -> None:
    """Remove a deleted bundle's file, if it had one."""
    if bundle_dir is not None:
        bundle_path(bundle_dir, sha256).unlink(missing_ok=True)
