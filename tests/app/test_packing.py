"""`hybridtrain.packing`: a work dir becomes a deterministic, safe, size-limited code bundle."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from hybridtrain.packing import PackError, pack_workdir


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: m for m in tar.getmembers()}


def _files(data: bytes) -> set[str]:
    return {name for name, m in _members(data).items() if m.isfile()}


def test_the_same_tree_packs_to_the_same_sha256(tmp_path):
    a = _tree(tmp_path / "a", {"train.py": "print(1)\n", "pkg/model.py": "x = 1\n"})
    b = _tree(tmp_path / "b", {"pkg/model.py": "x = 1\n", "train.py": "print(1)\n"})
    assert pack_workdir(a).sha256 == pack_workdir(b).sha256


def test_touching_a_file_does_not_change_the_sha256(tmp_path):
    root = _tree(tmp_path, {"train.py": "print(1)\n"})
    before = pack_workdir(root).sha256
    os.utime(root / "train.py", (1_000_000_000, 1_000_000_000))
    assert pack_workdir(root).sha256 == before


def test_changing_a_file_changes_the_sha256(tmp_path):
    root = _tree(tmp_path, {"train.py": "print(1)\n"})
    before = pack_workdir(root).sha256
    (root / "train.py").write_text("print(2)\n")
    assert pack_workdir(root).sha256 != before


def test_members_carry_no_owner_time_or_odd_modes(tmp_path):
    root = _tree(tmp_path, {"run.sh": "#!/bin/sh\n", "lib/a.py": ""})
    (root / "run.sh").chmod(0o700)
    (root / "lib" / "a.py").chmod(0o600)
    members = _members(pack_workdir(root).data)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members.values()} == {(0, 0, 0, "", "")}
    assert (members["run.sh"].mode, members["lib/a.py"].mode, members["lib"].mode) == (0o755, 0o644, 0o755)


def test_the_gzip_header_has_no_time_or_name(tmp_path):
    data = pack_workdir(_tree(tmp_path, {"a.py": ""})).data
    # RFC 1952: bytes 4-7 are MTIME, bit 3 of FLG says an original file name follows.
    assert data[4:8] == b"\0\0\0\0" and not data[3] & 0x08
    gzip.decompress(data)


def test_the_counts_describe_the_archive(tmp_path):
    packed = pack_workdir(_tree(tmp_path, {"a.py": "1", "d/b.py": "2"}))
    assert (packed.files, packed.size_bytes, packed.members) == (2, len(packed.data), ("a.py", "d/b.py"))


def test_vcs_caches_and_virtualenvs_never_travel(tmp_path):
    root = _tree(tmp_path, {
        "train.py": "", ".git/HEAD": "", "pkg/__pycache__/m.cpython-311.pyc": "", "pkg/m.pyc": "",
        ".venv/bin/python": "", "pkg/m.py": "",
    })
    (root / ".gitignore").write_text("!.venv/\n!*.pyc\n")
    assert _files(pack_workdir(root).data) == {"train.py", "pkg/m.py", ".gitignore"}


def test_gitignore_rules_leave_files_out(tmp_path):
    root = _tree(tmp_path, {".gitignore": "data/\n*.log\n", "train.py": "", "data/x.npy": "", "run.log": ""})
    assert _files(pack_workdir(root).data) == {".gitignore", "train.py"}


def test_hybridtrainignore_wins_over_gitignore(tmp_path):
    root = _tree(tmp_path, {
        ".gitignore": "data/\n", ".hybridtrainignore": "*.log\n", "data/x.csv": "", "run.log": "",
        "train.py": "",
    })
    assert _files(pack_workdir(root).data) == {".gitignore", ".hybridtrainignore", "data/x.csv", "train.py"}


def test_negation_patterns_bring_files_back(tmp_path):
    root = _tree(tmp_path, {
        ".hybridtrainignore": "data/*\n!data/labels.csv\n", "data/big.npy": "", "data/labels.csv": "",
    })
    assert _files(pack_workdir(root).data) == {".hybridtrainignore", "data/labels.csv"}


def test_a_symlink_out_of_the_work_dir_is_refused(tmp_path):
    root = _tree(tmp_path / "work", {"train.py": ""})
    (tmp_path / "secret.txt").write_text("s")
    (root / "creds").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(PackError, match="creds is a symlink .* outside the work dir"):
        pack_workdir(root)


def test_a_symlink_inside_the_work_dir_is_skipped_with_a_warning(tmp_path):
    root = _tree(tmp_path, {"train.py": ""})
    (root / "main.py").symlink_to("train.py")
    packed = pack_workdir(root)
    assert _files(packed.data) == {"train.py"}
    assert packed.warnings == ("skipped main.py: a symlink (bundles carry regular files only)",)


def test_an_ignored_symlink_out_of_the_work_dir_is_not_refused(tmp_path):
    root = _tree(tmp_path / "work", {".gitignore": "outside\n", "train.py": ""})
    (root / "outside").symlink_to(tmp_path)
    assert _files(pack_workdir(root).data) == {".gitignore", "train.py"}


def test_a_work_dir_over_the_limit_is_refused_naming_its_biggest_files(tmp_path):
    root = _tree(tmp_path, {"train.py": "x", "data/big.npy": "0" * 5000, "data/mid.npy": "0" * 3000})
    with pytest.raises(PackError, match=r"over the 4\.0 KiB bundle limit; biggest files: "
                                        r"data/big\.npy \(4\.9 KiB\), data/mid\.npy \(2\.9 KiB\)"):
        pack_workdir(root, max_bytes=4096)


def test_an_archive_over_the_limit_is_refused_even_when_the_files_fit(tmp_path):
    # Random bytes do not compress; the tar headers then push the archive over.
    root = tmp_path
    (root / "noise.bin").write_bytes(os.urandom(4000))
    with pytest.raises(PackError, match="packs, over the 4.0 KiB bundle limit"):
        pack_workdir(root, max_bytes=4096)


def test_a_missing_work_dir_is_one_clear_error(tmp_path):
    with pytest.raises(PackError, match="is not a directory"):
        pack_workdir(tmp_path / "nope")
