"""The control plane's own wheel, handed to machines that join, so that the node page's install
line needs no package index of ours: `pip install 'hybridtrain[agent] @ URL/dist/<wheel>'`.

The wheel is built once per control-plane process from the source tree it runs from (an
editable install, as `make run` and the image make), in a scratch copy so the tree stays
clean; a control plane installed from a wheel itself is given one with HYBRIDTRAIN_AGENT_WHEEL.
Its dependencies (torch among them) come from the joining machine's own package index.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from pathlib import Path

logger = logging.getLogger(__name__)

DISTRIBUTION = "hybridtrain"
BUILD_TIMEOUT_S = 180.0


class WheelUnavailable(Exception):
    """This control plane has no wheel to hand out; the message says what to set."""


def _project(root: Path) -> dict[str, object] | None:
    try:
        return tomllib.loads((root / "pyproject.toml").read_text())["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError):
        return None


def source_tree() -> Path | None:
    """The project root this control plane runs from, or None when it was installed from a wheel."""
    root = Path(__file__).resolve().parents[1]
    project = _project(root)
    return root if project is not None and project.get("name") == DISTRIBUTION else None


def _packages(root: Path) -> list[Path]:
    """The top-level package folders pyproject.toml's `packages.find` includes."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(
        path for path in root.iterdir()
        if (path / "__init__.py").is_file() and any(fnmatch.fnmatch(path.name, p) for p in patterns)
    )


def build_wheel(root: Path, out: Path) -> Path:
    """Build the wheel of the project at `root` into `out`, from a copy (setuptools writes
    build/ and *.egg-info/ beside its input); the path of the wheel."""
    with tempfile.TemporaryDirectory(prefix="hybridtrain-wheel-") as scratch:
        copy = Path(scratch) / "src"
        copy.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(root / name, copy / name)
        for package in _packages(root):
            shutil.copytree(package, copy / package.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # No build isolation: setuptools is already here, and a control plane may have no index.
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                   "--wheel-dir", str(out), str(copy)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise WheelUnavailable(f"building the agent wheel took over {BUILD_TIMEOUT_S:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-600:]
        raise WheelUnavailable(
            f"building the agent wheel failed ({tail}); build one with `pip wheel --no-deps .` "
            "and set HYBRIDTRAIN_AGENT_WHEEL to it"
        )
    wheels = sorted(out.glob(f"{DISTRIBUTION}-*.whl"))
    if len(wheels) != 1:
        raise WheelUnavailable(f"building the agent wheel left {len(wheels)} wheels in {out}")
    return wheels[0]


class AgentWheel:
    """The wheel a joining machine installs: a given file, or one built from the source tree at
    the first request and kept in memory (a few hundred kB) for the life of the process."""

    def __init__(self, prebuilt: Path | None, source: Path | None) -> None:
        self._prebuilt = prebuilt
        self._source = source
        self._lock = threading.Lock()
        self._content: bytes | None = None

    @property
    def filename(self) -> str:
        """The wheel's file name, which pip reads its name, version and tags from."""
        if self._prebuilt is not None:
            return self._prebuilt.name
        # The tree's own version, which is what a build makes (the installed metadata may be
        # older); without a tree the installed one, for the 503 that follows.
        project = _project(self._source) if self._source is not None else None
        if project:
            version = project["version"]
        else:
            try:
                version = importlib.metadata.version(DISTRIBUTION)
            except importlib.metadata.PackageNotFoundError:
                version = "0"
        return f"{DISTRIBUTION}-{version}-py3-none-any.whl"

    def content(self) -> bytes:
        """The wheel's bytes, built on the first call; WheelUnavailable says why there are none."""
        with self._lock:
            if self._content is None:
                self._content = self._load()
            return self._content

    def _load(self) -> bytes:
        if self._prebuilt is not None:
            try:
                return self._prebuilt.read_bytes()
            except OSError as exc:
                raise WheelUnavailable(f"HYBRIDTRAIN_AGENT_WHEEL={self._prebuilt} cannot be read: {exc}") from exc
        if self._source is None:
            raise WheelUnavailable(
                "this control plane was not installed from a source tree; build a wheel with "
                "`pip wheel --no-deps .` and set HYBRIDTRAIN_AGENT_WHEEL to it"
            )
        with tempfile.TemporaryDirectory(prefix="hybridtrain-dist-") as out:
            logger.info("building the agent wheel from %s", self._source)
            wheel = build_wheel(self._source, Path(out))
            if wheel.name != self.filename:
                raise WheelUnavailable(f"the build made {wheel.name}, not {self.filename}")
            return wheel.read_bytes()
