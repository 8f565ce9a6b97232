"""The plain-loop example: the plain script trains, the hybridtrain version differs by a few
lines, and the user guide shows the diff as it is."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from examples_testing import EXAMPLES

PLAIN_LOOP = EXAMPLES / "plain_loop"
GUIDE = EXAMPLES.parent / "docs" / "user-guide.md"


def plain_loop_diff() -> str:
    if shutil.which("diff") is None:
        pytest.fail("GNU diff is required to compare the plain-loop example's files")
    out = subprocess.run(["diff", "-u", "--label", "train_plain.py", "--label", "train.py",
                          "train_plain.py", "train.py"], cwd=PLAIN_LOOP, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr  # 1: the files differ
    return out.stdout


def added_lines(diff: str) -> list[str]:
    return [line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]


def test_plain_loop_script_changes_fewer_than_12_lines():
    added = added_lines(plain_loop_diff())
    assert 0 < len(added) < 12, added


def test_user_guide_shows_the_current_plain_loop_diff():
    block = re.search(r"```diff\n(.*?)```", GUIDE.read_text(), re.S)
    assert block is not None, "docs/user-guide.md has no ```diff block"
    assert block.group(1) == plain_loop_diff()


def test_plain_loop_readme_counts_the_changed_lines():
    added = added_lines(plain_loop_diff())
    assert f"with {len(added)} lines changed" in (PLAIN_LOOP / "README.md").read_text()


def test_plain_training_script_reaches_the_readme_accuracy(tmp_path):
    out = subprocess.run([sys.executable, str(PLAIN_LOOP / "train_plain.py"), "--epochs", "5"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    accuracies = [float(a) for a in re.findall(r"accuracy ([0-9.]+)", out.stdout)]
    assert len(accuracies) == 5 and max(accuracies) >= 0.95, out.stdout
