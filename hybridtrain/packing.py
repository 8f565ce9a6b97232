"""Pack a work dir into a code bundle: a deterministic gzipped tar named by its sha256.

The same tree always gives the same bytes (sorted members, mtime 0, owner 0, modes 0644/0755,
gzip header without name or time), so an unchanged work dir has the same sha256 and is not
uploaded twice. Ignore rules come from `.hybridtrainignore`, else `.gitignore` (the work dir's
top-level file, gitignore semantics); VCS data, caches and virtual environments never travel.
Shared by the command-line client (`runs create --workdir`) and the paper benchmark, which
uploads a workload of the user's own code the same way (the testbed never imports app/).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

IGNORE_FILES = (".hybridtrainignore", ".gitignore")
# Never part of a bundle, whatever the ignore file says: they are large, machine-specific, or
# rebuilt on the node anyway.
_ALWAYS_SKIPPED_DIRS = frozenset({".git", "__pycache__", ".venv"})
_ALWAYS_SKIPPED_SUFFIXES = (".pyc",)
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class PackError(Exception):
    """The work dir cannot become a bundle; the message is one line for the user."""


@dataclass(frozen=True)
class PackedBundle:
    """A packed work dir: the archive bytes, their sha256 and what went in."""

    sha256: str
    data: bytes
    files: int
    size_bytes: int
    members: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Entry:
    rel: str
    path: Path
    is_dir: bool
    size: int
    executable: bool


class _TooBig(Exception):
    pass


class _CappedBuffer(io.BytesIO):
    # Stops writing as soon as the archive passes the limit, so a work dir whose files compress
    # badly never sits in memory whole.
    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self._max = max_bytes

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self._max:
            raise _TooBig
        return super().write(data)


def pack_workdir(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> PackedBundle:
    """The deterministic bundle of the directory `path`; PackError when it cannot be one."""
    root = Path(path)
    if not root.is_dir():
        raise PackError(f"work dir {str(path)!r} is not a directory")
    root = root.resolve()
    spec = _ignore_spec(root)
    warnings: list[str] = []
    entries = _collect(root, spec, warnings)
    files = [e for e in entries if not e.is_dir]
    total = sum(e.size for e in files)
    if total > max_bytes:
        raise PackError(_too_big_message(root, files, total, max_bytes))
    buffer = _CappedBuffer(max_bytes)
    try:
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=6) as gz:
            with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for entry in entries:
                    _add(tar, entry)
    except _TooBig:
        # Tar headers and padding can push a tree just under the limit over it.
        raise PackError(_too_big_message(root, files, None, max_bytes)) from None
    data = buffer.getvalue()
    return PackedBundle(
        sha256=hashlib.sha256(data).hexdigest(), data=data, files=len(files), size_bytes=len(data),
        members=tuple(e.rel for e in files), warnings=tuple(warnings),
    )


def _ignore_spec(root: Path) -> pathspec.GitIgnoreSpec | None:
    # The first ignore file present wins outright: a .hybridtrainignore is the user saying
    # what to send, so .gitignore rules (which often exclude data the code needs) do not apply.
    for name in IGNORE_FILES:
        candidate = root / name
        if candidate.is_file():
            try:
                lines = candidate.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise PackError(f"cannot read {candidate}: {exc}") from exc
            try:
                return pathspec.GitIgnoreSpec.from_lines(lines)
            except Exception as exc:  # pathspec raises several types for a bad pattern
                raise PackError(f"{candidate}: bad pattern: {exc}") from exc
    return None


def _ignored(spec: pathspec.GitIgnoreSpec | None, rel: str, is_dir: bool) -> bool:
    if spec is None:
        return False
    return spec.match_file(rel + "/" if is_dir else rel)


def _collect(root: Path, spec: pathspec.GitIgnoreSpec | None, warnings: list[str]) -> list[_Entry]:
    entries: list[_Entry] = []
    stack = [(root, "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            names = sorted(os.listdir(directory))
        except OSError as exc:
            raise PackError(f"cannot list {directory}: {exc.strerror}") from exc
        subdirs: list[tuple[Path, str]] = []
        for name in names:
            full = directory / name
            rel = f"{prefix}{name}"
            try:
                st = full.lstat()
            except OSError as exc:
                raise PackError(f"cannot read {full}: {exc.strerror}") from exc
            is_dir = stat.S_ISDIR(st.st_mode)
            if is_dir and name in _ALWAYS_SKIPPED_DIRS:
                continue
            if not is_dir and name.endswith(_ALWAYS_SKIPPED_SUFFIXES):
                continue
            if stat.S_ISLNK(st.st_mode):
                link_is_dir = full.is_dir()
                if _ignored(spec, rel, link_is_dir):
                    continue
                _check_link(root, full, rel, warnings)
                continue
            if _ignored(spec, rel, is_dir):
                continue
            if is_dir:
                entries.append(_Entry(rel, full, True, 0, True))
                subdirs.append((full, rel + "/"))
            elif stat.S_ISREG(st.st_mode):
                entries.append(_Entry(rel, full, False, st.st_size, bool(st.st_mode & stat.S_IXUSR)))
            else:
                warnings.append(f"skipped {rel}: not a regular file or directory")
        stack.extend(subdirs)
    # Sorted by path, so the member order never depends on the file system's listing order.
    return sorted(entries, key=lambda e: e.rel)


def _check_link(root: Path, link: Path, rel: str, warnings: list[str]) -> None:
    # A link out of the work dir would make the bundle depend on this machine (or leak a file
    # the user never meant to send); one inside it is only a duplicate and is left out.
    target = link.resolve(strict=False)
    if target != root and root not in target.parents:
        raise PackError(
            f"{rel} is a symlink to {os.readlink(link)}, outside the work dir; copy the file "
            "in or list the link in .hybridtrainignore"
        )
    warnings.append(f"skipped {rel}: a symlink (bundles carry regular files only)")


def _add(tar: tarfile.TarFile, entry: _Entry) -> None:
    info = tarfile.TarInfo(entry.rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o755 if entry.executable else 0o644
    if entry.is_dir:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        return
    info.size = entry.size
    try:
        with entry.path.open("rb") as fh:
            tar.addfile(info, fh)
    except OSError as exc:
        raise PackError(f"cannot read {entry.rel}: {exc.strerror or exc}") from exc


def _too_big_message(root: Path, files: list[_Entry], total: int | None, max_bytes: int) -> str:
    biggest = sorted(files, key=lambda e: (-e.size, e.rel))[:3]
    named = ", ".join(f"{e.rel} ({human_bytes(e.size)})" for e in biggest)
    what = f"holds {human_bytes(total)}" if total is not None else "packs"
    return (
        f"work dir {root} {what}, over the {human_bytes(max_bytes)} bundle limit; "
        f"biggest files: {named}; list data files in .hybridtrainignore"
    )


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
