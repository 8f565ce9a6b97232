"""The node's bundle cache against a real HTTP server: fetched once, verified, unpacked safely."""

from __future__ import annotations

import io
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_testing import FakeControlPlane, make_bundle, sha256_of

from agents.bundles import BundleCache
from agents.client import ControlPlaneClient
from agents.errors import BundleError
from agents.spec import BundleRef

TOKEN = "run-secret"
PATH = "/api/v1/runs/7/bundle"


@pytest.fixture
def client(control_plane: FakeControlPlane) -> Iterator[ControlPlaneClient]:
    http = ControlPlaneClient(control_plane.url, timeout_s=5)
    yield http
    http.close()


@pytest.fixture
def cache(tmp_path: Path, client: ControlPlaneClient) -> BundleCache:
    return BundleCache(tmp_path / "state", client, retry_s=0)


def _serve(plane: FakeControlPlane, files: dict[str, str], path: str = PATH) -> BundleRef:
    data = make_bundle(files)
    plane.files[path] = (TOKEN, data)
    return BundleRef(sha256=sha256_of(data), path=path)


def test_ensure_downloads_and_verifies_the_archive(control_plane, cache):
    ref = _serve(control_plane, {"train.py": "print('hi')\n"})

    archive = cache.ensure(ref, TOKEN)

    assert archive == cache.dir / f"{ref.sha256}.tar.gz"
    assert sha256_of(archive.read_bytes()) == ref.sha256
    assert control_plane.downloads_of(PATH) == 1


def test_second_ensure_of_a_cached_bundle_does_not_hit_the_server(control_plane, cache, tmp_path, client):
    ref = _serve(control_plane, {"train.py": "x = 1\n"})
    cache.ensure(ref, TOKEN)

    cache.ensure(ref, TOKEN)
    # A new cache on the same state dir (an agent restart) finds it on disk too.
    BundleCache(tmp_path / "state", client).ensure(ref, TOKEN)

    assert control_plane.downloads_of(PATH) == 1


def test_concurrent_ensures_of_one_bundle_download_it_once(control_plane, cache):
    ref = _serve(control_plane, {"train.py": "x = 1\n"})
    control_plane.download_delay_s = 0.3
    results: list[Path | BaseException] = []

    def fetch() -> None:
        try:
            results.append(cache.ensure(ref, TOKEN))
        except BaseException as exc:  # collected for the assertion below
            results.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    assert len(results) == 4 and len(set(results)) == 1 and isinstance(results[0], Path)
    assert control_plane.downloads_of(PATH) == 1


def test_ensure_refuses_an_archive_whose_sha256_does_not_match(control_plane, cache):
    ref = _serve(control_plane, {"train.py": "x = 1\n"})
    wrong = BundleRef(sha256="0" * 64, path=ref.path)

    with pytest.raises(BundleError, match=r"bundle 000000000000\u2026: sha256 mismatch"):
        cache.ensure(wrong, TOKEN)

    # Nothing half-verified is left behind to be trusted later.
    assert list(cache.dir.iterdir()) == []


def test_ensure_names_the_http_status_of_a_missing_bundle(cache):
    ref = BundleRef(sha256="3f2a" + "0" * 60, path="/api/v1/runs/404/bundle")

    with pytest.raises(BundleError, match=r"^bundle 3f2a00000000\u2026: HTTP 404 from the control plane$"):
        cache.ensure(ref, TOKEN)


def test_ensure_names_a_refused_token(control_plane, cache):
    ref = _serve(control_plane, {"train.py": "x = 1\n"})

    with pytest.raises(BundleError, match="HTTP 401 from the control plane"):
        cache.ensure(ref, "wrong-token")


def test_ensure_reports_an_unreachable_control_plane_without_hanging(tmp_path):
    http = ControlPlaneClient("http://127.0.0.1:1", timeout_s=2)
    try:
        cache = BundleCache(tmp_path / "state", http, retry_s=0)
        with pytest.raises(BundleError, match="cannot download it: control plane at .* unreachable"):
            cache.ensure(BundleRef(sha256="a" * 64, path=PATH), TOKEN)
    finally:
        http.close()


def test_ensure_refuses_an_archive_over_the_size_limit(control_plane, tmp_path, client):
    ref = _serve(control_plane, {"big.bin": "x" * 10_000})
    cache = BundleCache(tmp_path / "state", client, max_bytes=100, retry_s=0)

    with pytest.raises(BundleError, match="larger than 100 bytes"):
        cache.ensure(ref, TOKEN)


def test_unpack_extracts_the_files_into_dest(control_plane, cache, tmp_path):
    ref = _serve(control_plane, {"train.py": "print(1)\n", "pkg/__init__.py": "", "pkg/mod.py": "y = 2\n"})

    dest = cache.unpack(cache.ensure(ref, TOKEN), tmp_path / "run" / "code", ref=ref)

    assert (dest / "train.py").read_text() == "print(1)\n"
    assert (dest / "pkg" / "mod.py").read_text() == "y = 2\n"
    # The temporary tree was renamed into place: nothing else is left next to it.
    assert [p.name for p in dest.parent.iterdir()] == ["code"]


def test_unpack_into_an_existing_dest_keeps_it(control_plane, cache, tmp_path):
    ref = _serve(control_plane, {"train.py": "print(1)\n"})
    archive = cache.ensure(ref, TOKEN)
    dest = cache.unpack(archive, tmp_path / "code")
    (dest / "marker").write_text("rank 0 was here")

    cache.unpack(archive, dest)

    assert (dest / "marker").read_text() == "rank 0 was here"


def _member(name: str, kind: bytes = tarfile.REGTYPE, *, size: int = 1, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, size if kind == tarfile.REGTYPE else 0, link, 0o644
    return info


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (_member("../escape.py"), "not a safe relative path"),
        (_member("pkg/../../escape.py"), "not a safe relative path"),
        (_member("/etc/evil"), "not a safe relative path"),
        (_member("link", tarfile.SYMTYPE, link="/etc/passwd"), "is a link"),
        (_member("hard", tarfile.LNKTYPE, link="train.py"), "is a link"),
        (_member("dev", tarfile.CHRTYPE), "not a regular file or directory"),
        (_member("fifo", tarfile.FIFOTYPE), "not a regular file or directory"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "device", "fifo"],
)
def test_unpack_refuses_an_archive_with_an_unsafe_member(cache, tmp_path, member, why):
    archive = tmp_path / "bad.tar.gz"
    archive.write_bytes(make_bundle({"train.py": "x = 1\n"}, extra=[member]))
    dest = tmp_path / "run" / "code"

    with pytest.raises(BundleError, match=why):
        cache.unpack(archive, dest)

    assert not dest.exists() and not (tmp_path / "escape.py").exists()
    assert list(dest.parent.iterdir()) == []


def test_unpack_refuses_an_archive_that_is_not_a_gzip_tar(cache, tmp_path):
    archive = tmp_path / "junk.tar.gz"
    archive.write_bytes(b"not an archive at all")

    with pytest.raises(BundleError, match="not a readable gzip tar"):
        cache.unpack(archive, tmp_path / "code")


def test_unpack_refuses_an_archive_that_expands_beyond_the_limit(control_plane, tmp_path, client):
    ref = _serve(control_plane, {"zeros.bin": "\0" * 50_000})
    cache = BundleCache(tmp_path / "state", client, max_unpacked_bytes=10_000, retry_s=0)

    with pytest.raises(BundleError, match="unpacks to more than 10000 bytes"):
        cache.unpack(cache.ensure(ref, TOKEN), tmp_path / "code")


def test_unpack_refuses_an_archive_that_expands_beyond_the_shared_ratio(cache, tmp_path):
    # 64 MiB of zeros gzips to ~64 KiB: a thousandfold, beyond bundle_limits' 200.
    archive = tmp_path / "bomb.tar.gz"
    with tarfile.open(archive, mode="w:gz") as tar:
        info = tarfile.TarInfo("zeros.bin")
        info.size = 64 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))

    with pytest.raises(BundleError, match="unpacks to more than 200 times"):
        cache.unpack(archive, tmp_path / "code")
    assert not (tmp_path / "code").exists()


def test_ensure_reports_a_cache_directory_it_cannot_write(control_plane, cache, tmp_path):
    ref = _serve(control_plane, {"train.py": "x = 1\n"})
    # A file where the directory should be fails even for root, unlike permissions.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cache.dir = blocker

    with pytest.raises(BundleError, match="cannot store it in .*not-a-dir"):
        cache.ensure(ref, TOKEN)
