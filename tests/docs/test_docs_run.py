"""The shell blocks of README.md and docs/user-guide.md run as written, in order, against a
fresh `hybridtrain local` (what `make run` starts: embedded SQLite database and broker, this
machine's agent, cluster `local` = 1): each command exits 0 and prints what the docs say.

The docs are run as a newcomer runs them: README.md from a checkout (`.venv`, `var/`), the
user guide from `~/my-work-dir` with the checkout at `~/hybridtrain`, one shell each whose
directory and exports carry from one command to the next. The task module and the script are
the docs' own `python` blocks, with the data they leave to the reader filled in (PRELUDES), and
examples/plain_loop/train.py. The server listens on a free port, so `127.0.0.1:8000` in a
command is read as that port. A block preceded by `<!-- docs-run: skip: REASON -->` is not run,
nor a command containing TEXT after `<!-- docs-run: skip "TEXT": REASON -->` (both only parsed,
by tests/docs/test_commands_in_docs.py); the reason says why.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.runs.conftest import Service, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e

SHELL_FENCES = {"sh", "bash", "shell", "console"}
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
_SKIP = re.compile(r'<!--\s*docs-run:\s*skip(?:\s+"([^"]+)")?:\s*(.+?)\s*-->\s*$')
COMMAND_TIMEOUT_S = 600

# What the docs' `python` blocks leave to the reader (their data, their network), so that the
# blocks themselves run: small sets, so that `--epochs` stays a few steps.
PRELUDES = {
    "README.md": '''\
import torch


class MyDataset(torch.utils.data.TensorDataset):
    """A linear regression with noise, 10 features: 512 training samples, 128 held out."""

    def __init__(self, split: str) -> None:
        g = torch.Generator().manual_seed(0 if split == "train" else 1)
        x = torch.randn(512 if split == "train" else 128, 10, generator=g)
        w = torch.linspace(-1, 1, 10, dtype=torch.float32)
        super().__init__(x, (x @ w + 0.1 * torch.randn(len(x), generator=g)).unsqueeze(1))

''',
    "docs/user-guide.md": '''\
import torch


def load_my_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 10, generator=g)
    y = (x @ torch.linspace(-1, 1, 10, dtype=torch.float32)).unsqueeze(1)
    data = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.Subset(data, range(512)), torch.utils.data.Subset(data, range(512, 640))


def MyNet(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(10, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))

''',
}


@dataclass(frozen=True)
class DocCommand:
    """One line of a doc's shell block (continuations joined), where it is, and whether it runs."""

    doc: str
    line: int
    text: str
    skip: str | None = None

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _lines(block: str, first: int) -> Iterator[tuple[int, str]]:
    lines = block.split("\n")
    index = 0
    while index < len(lines):
        start, line = index, lines[index]
        while line.endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line[:-1] + " " + lines[index].lstrip()
        index += 1
        if line.strip() and not line.lstrip().startswith("#"):
            yield first + start, line.strip()


def doc_commands(doc: str) -> list[DocCommand]:
    """Every command line of `doc`'s shell blocks, in order, with the skip its marker gives."""
    text = (ROOT / doc).read_text()
    found: list[DocCommand] = []
    for fence in _FENCE.finditer(text):
        if fence.group(1) not in SHELL_FENCES:
            continue
        before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = _SKIP.search(before)
        first = text.count("\n", 0, fence.start(2)) + 1
        for line, command in _lines(fence.group(2), first):
            skip = None
            if marker and (marker.group(1) is None or marker.group(1) in command):
                skip = marker.group(2)
            found.append(DocCommand(doc, line, command, skip))
    return found


def python_blocks(doc: str) -> list[str]:
    """The doc's `python` blocks that are whole modules (a task module)."""
    text = (ROOT / doc).read_text()
    return [f.group(2) for f in _FENCE.finditer(text) if f.group(1) == "python" and "hybridtrain.Task(" in f.group(2)]


# -- what the docs say each command prints -----------------------------------------------------


def _json_out(out: str) -> dict:
    return json.loads(out[out.index("{"):])


def _run_succeeded(out: str, err: str) -> str | None:
    run = _json_out(out)
    return None if run["status"] == "succeeded" else f"the run is {run['status']}"


def _table_with_numbers(out: str, err: str) -> str | None:
    rows = [r for r in out.splitlines() if r.startswith("| ps-bz-gc |")]
    if not rows or "n/a |" in rows[0].split("|")[2]:
        return "no predicted samples/s for ps-bz-gc"
    return None if "inputs:" in out and "profile of" in out else "no `inputs:` with each node's profile"


EXPECTED: list[tuple[re.Pattern[str], str, Callable[[str, str], str | None]]] = [
    (re.compile(r"clusters list"), "cluster local",
     lambda out, err: None if re.search(r"\blocal\b", out) else "no cluster local"),
    (re.compile(r"nodes list"), "this machine's node, online",
     lambda out, err: None if "online" in out else "no online node"),
    (re.compile(r"runs create .*--wait"), "the run, succeeded", _run_succeeded),
    (re.compile(r"runs create .*--plan-only --all-strategies"), "a table of every strategy with numbers",
     _table_with_numbers),
    (re.compile(r"plans optimize"), "the chosen plan with numbers",
     lambda out, err: None if "samples/s" in out and "nodes:" in out else "no plan"),
    (re.compile(r"profiles request .*--wait"), "the profiles, done",
     lambda out, err: None if " done " in out else "no finished profile"),
    (re.compile(r"profiles list"), "the profiles, done",
     lambda out, err: None if " done " in out and "samples/s" in out else "no finished profile"),
    (re.compile(r"runs cancel"), "the run, cancelled",
     lambda out, err: None if _json_out(out)["status"] == "cancelled" else "not cancelled"),
    (re.compile(r"tokens create"), "the token's secret",
     lambda out, err: None if "htk_" in out + err else "no secret"),
    (re.compile(r"hybridtrain train .*--target"), "its summary: the time to the target, or that it was not reached",
     lambda out, err: None if re.search(r"time to \S+ [0-9.]+s|target \S+ not reached", err) else "no summary"),
]


def _reached_as_said(command: str, out: str, err: str) -> str | None:
    """A command whose comment says its target is `reached` prints its time to it."""
    if "# reached" not in command:
        return None
    return None if re.search(r"time to \S+ [0-9.]+s", out + err) else "the target was not reached"


# -- the shell a newcomer types in ---------------------------------------------------------------


@dataclass
class Shell:
    """A bash whose directory and exports carry from one command to the next."""

    cwd: Path
    env: dict[str, str]
    state: Path
    outputs: list[str] = field(default_factory=list)

    def run(self, command: str, port: int) -> subprocess.CompletedProcess[str]:
        command = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        script = (f"set -e -o pipefail\n{command}\n"
                  f"pwd > {shlex.quote(str(self.state / 'cwd'))}\n"
                  f"export -p > {shlex.quote(str(self.state / 'env'))}\n")
        result = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True,
                                text=True, timeout=COMMAND_TIMEOUT_S)
        if result.returncode == 0:
            self.cwd = Path((self.state / "cwd").read_text().strip())
            dumped = subprocess.run(["bash", "-c", f"source {shlex.quote(str(self.state / 'env'))} && env -0"],
                                    capture_output=True, env={}, check=True).stdout.decode()
            self.env = dict(item.split("=", 1) for item in dumped.split("\0") if "=" in item)
        return result


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDTRAIN_", "CELERY_", "DATABASE_URL"))}
    env.update(HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """A home with the checkout at ~/hybridtrain and a work dir ~/my-work-dir, `hybridtrain
    local` serving from the checkout on a free port."""
    home = tmp_path_factory.mktemp("newcomer-home")
    checkout = home / "hybridtrain"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(ROOT / ".venv")
    shutil.copy(ROOT / ".gitignore", checkout / ".gitignore")
    workdir = home / "my-work-dir"
    workdir.mkdir()
    for doc, where in (("README.md", checkout), ("docs/user-guide.md", workdir)):
        (where / "mytask.py").write_text(PRELUDES[doc] + python_blocks(doc)[0])
        shutil.copy(ROOT / "examples" / "plain_loop" / "train.py", where / "train.py")
    port = free_port()
    env = _clean_env(home)
    local = Service([str(checkout / ".venv" / "bin" / "hybridtrain"), "local", "--port", str(port),
                     "--log-level", "warning"], home / "local.log", env=env, cwd=checkout)
    try:
        def ready() -> bool:
            if local.proc.poll() is not None:
                pytest.fail(f"hybridtrain local exited:\n{local.output()[-3000:]}")
            token = checkout / "var" / "local-admin-token"
            if not token.exists() or "agent ready" not in local.output():
                return False
            try:
                nodes = httpx.get(f"http://127.0.0.1:{port}/api/v1/nodes", timeout=2,
                                  headers={"Authorization": f"Bearer {token.read_text().strip()}"})
            except httpx.HTTPError:
                return False
            return nodes.status_code == 200 and any(n["status"] == "online" for n in nodes.json()["data"])

        wait_until(ready, 180, "hybridtrain local to serve with its agent online")
        yield {"home": home, "checkout": checkout, "workdir": workdir, "port": port, "env": env, "local": local}
    finally:
        local.stop()


def _run_doc(doc: str, start: Path, newcomer: dict[str, object]) -> None:
    state = Path(str(newcomer["home"])) / f".state-{Path(doc).stem}"
    state.mkdir()
    shell = Shell(start, dict(newcomer["env"]), state)  # type: ignore[arg-type]
    for command in doc_commands(doc):
        if command.skip is not None:
            continue
        result = shell.run(command.text, int(newcomer["port"]))  # type: ignore[arg-type]
        said = f"{command}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
        assert result.returncode == 0, f"exit {result.returncode}: {said}"
        problem = _reached_as_said(command.text, result.stdout, result.stderr)
        assert problem is None, f"{problem}: {said}"
        for pattern, what, check in EXPECTED:
            if pattern.search(command.text):
                problem = check(result.stdout, result.stderr)
                assert problem is None, f"expected {what}: {problem}: {said}"


def test_the_skipped_commands_are_few_and_say_why():
    skipped = [c for doc in ("README.md", "docs/user-guide.md") for c in doc_commands(doc) if c.skip]
    assert len(skipped) <= 6, [str(c) for c in skipped]
    assert all(len(c.skip or "") > 15 for c in skipped), [c.skip for c in skipped]


def test_the_readme_runs_as_written_after_make_run(newcomer: dict[str, object]):
    _run_doc("README.md", Path(str(newcomer["checkout"])), newcomer)


def test_the_user_guide_runs_as_written_from_a_work_dir(newcomer: dict[str, object]):
    _run_doc("docs/user-guide.md", Path(str(newcomer["home"])), newcomer)
