"""docs/screenshots.py (`make screenshots`) fills a fresh control plane through its API and the
agents' and trainers' routes, and photographs the real pages in Chromium: run whole into a
temporary folder, it writes a picture of every page asked for and nothing else."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "screenshots.py"
# The pictures the README and the docs show, and the run page's panels.
PICTURES = ("tokens", "run", "run-recovery", "run-timeline")

pytestmark = pytest.mark.browser


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (ValueError if it is no PNG)."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path.name} is not a PNG")
    return struct.unpack(">II", head[16:24])


def distinct_rows(path: Path) -> int:
    """How many different scanlines the PNG has (a blank page has one or two)."""
    data = path.read_bytes()
    chunks, i = [], 8
    while i < len(data):
        length = struct.unpack(">I", data[i:i + 4])[0]
        kind = data[i + 4:i + 8]
        if kind == b"IDAT":
            chunks.append(data[i + 8:i + 8 + length])
        i += 12 + length
    width, height = png_size(path)
    raw = zlib.decompress(b"".join(chunks))
    stride = len(raw) // height
    return len({raw[r * stride + 1:(r + 1) * stride] for r in range(height)})


def checkout_state() -> str:
    """What git sees changed in the checkout, untracked files included."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, bool]:
    """The script run once into a temporary folder: the folder, what it printed, and whether the
    checkout was left as it was."""
    out = tmp_path_factory.mktemp("screenshots")
    before = checkout_state()
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--only", ",".join(PICTURES)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout, checkout_state() == before


def test_the_script_writes_each_picture_asked_for_and_nothing_else(pictures: tuple[Path, str, bool]) -> None:
    out, _, untouched = pictures
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.png" for name in PICTURES)
    assert untouched, "the script changed the checkout"


def test_each_picture_is_a_page_with_content(pictures: tuple[Path, str, bool]) -> None:
    out, _, _ = pictures
    for name in PICTURES:
        width, height = png_size(out / f"{name}.png")
        assert width >= 600 and height >= 100, (name, width, height)
        assert distinct_rows(out / f"{name}.png") > 40, name


def test_whole_pages_are_taken_at_the_fixed_viewport_width(pictures: tuple[Path, str, bool]) -> None:
    out, _, _ = pictures
    assert png_size(out / "tokens.png")[0] == 1440
    assert png_size(out / "run.png")[0] == 1440
    assert png_size(out / "run.png")[1] > 900  # the whole page, not the first screen


def test_it_prints_a_line_per_picture_and_the_runs_it_made(pictures: tuple[Path, str, bool]) -> None:
    _, stdout, _ = pictures
    for name in PICTURES:
        assert f"{name}.png:" in stdout
    assert "a spot worker leaving, a restart and a node added, finished" in stdout
    assert "queued behind it" in stdout


def test_without_chromium_it_says_so_and_fails(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"),
                           "--chromium", str(tmp_path / "chromium")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"no Chromium at {tmp_path / 'chromium'}" in done.stderr
    assert "make chromium" in done.stderr
    assert not (tmp_path / "out").exists()
