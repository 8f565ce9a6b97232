"""Every `hybridtrain ...` command in the fenced shell blocks of README.md and
docs/user-guide.md, and every inline span written as a command to run, parses with the real
command line's parsers (each subcommand and flag exists), without running it, and is written
the one way that works:
`.venv/bin/hybridtrain` (from the checkout, or `~/hybridtrain/.venv/bin/hybridtrain` from a
work dir elsewhere), under `sudo` for the commands that need root."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/user-guide.md")
SHELL_FENCES = {"sh", "bash", "shell", "console"}
COMMAND = ".venv/bin/hybridtrain"
NEEDS_ROOT = {"testbed", "bench"}  # namespaces, tc and cgroups
SEPARATORS = {";", "&&", "||", "|", "&"}
REDIRECTIONS = {"<", ">", ">>", ">&", "<<"}
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Invocation:
    """One `hybridtrain` command of a doc: where it is, its words as written, and its argv."""

    where: str
    words: tuple[str, ...]
    sudo: bool
    program: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def _commands(block: str) -> list[tuple[int, list[str]]]:
    """The simple commands of a shell block with the line each starts on: continuations joined,
    comments and redirections dropped, split at `;`, `&&`, `|`, ... ."""
    commands: list[tuple[int, list[str]]] = []
    lines = block.split("\n")
    index = 0
    while index < len(lines):
        start, line = index, lines[index]
        while line.endswith("\\") and index + 1 < len(lines):
            index += 1
            line = line[:-1] + " " + lines[index]
        index += 1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        tokens = iter(lexer)
        for token in tokens:
            if token in SEPARATORS:
                commands.append((start, current))
                current = []
            elif token in REDIRECTIONS:
                next(tokens, None)
            else:
                current.append(token)
        commands.append((start, current))
    return [(start, words) for start, words in commands if words]


def _invocation(where: str, words: list[str]) -> Invocation | None:
    rest = list(words)
    while rest and _ASSIGNMENT.match(rest[0]):
        rest.pop(0)
    sudo = bool(rest) and rest[0] == "sudo"
    if sudo:
        rest.pop(0)
    if not rest or Path(rest[0]).name != "hybridtrain":
        return None
    return Invocation(where, tuple(words), sudo, rest[0], tuple(rest[1:]))


def doc_invocations() -> list[Invocation]:
    """Every `hybridtrain` invocation in the docs' fenced shell blocks."""
    found: list[Invocation] = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for fence in _FENCE.finditer(text):
            if fence.group(1) not in SHELL_FENCES:
                continue
            first = text.count("\n", 0, fence.start(2)) + 1
            for offset, words in _commands(fence.group(2)):
                invocation = _invocation(f"{doc}:{first + offset}", words)
                if invocation is not None:
                    found.append(invocation)
    return found


def inline_invocations() -> list[Invocation]:
    """The inline code spans of the docs written as commands to run (`.venv/bin/hybridtrain ...`,
    with or without sudo or ~/hybridtrain/); a bare `hybridtrain x` in prose names a command."""
    found: list[Invocation] = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        prose = _FENCE.sub(lambda fence: "\n" * fence.group(0).count("\n"), text)
        for span in re.finditer(r"`((?:sudo )?(?:~/hybridtrain/)?\.venv/bin/hybridtrain [^`]+)`", prose):
            line = prose.count("\n", 0, span.start()) + 1
            for _, words in _commands(span.group(1).replace("\n", " ")):
                invocation = _invocation(f"{doc}:{line}", words)
                if invocation is not None:
                    found.append(invocation)
    return found


INVOCATIONS = doc_invocations() + inline_invocations()


def parse(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """argparse's complaint about `hybridtrain ARGV`, None when it parses; nothing runs. The
    forwarded subcommands go to their own parsers, as app.cli.main hands them on."""
    import agents.cli
    import app.cli
    import trainer.cli

    def trainer_parse(args: list[str]) -> int:
        trainer.cli.build_parser().parse_args(args)
        return 0

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            if argv[:1] == ["train"]:
                trainer_parse(argv[1:])
            elif argv[:1] == ["launch"]:
                # launch_main finds the script among the words, then hands `train`'s parser the rest.
                monkeypatch.setattr(trainer.cli, "main", trainer_parse)
                if trainer.cli.launch_main(argv[1:]) != 0:
                    return errors.getvalue().strip()
            elif argv[:1] == ["agent"]:
                agents.cli.build_parser().parse_args(argv[1:])
            else:
                app.cli.build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return errors.getvalue().strip().splitlines()[-1]
    return None


def test_the_docs_have_commands_to_check():
    per_doc = {doc: sum(i.where.startswith(doc + ":") for i in INVOCATIONS) for doc in DOCS}
    assert all(count >= 3 for count in per_doc.values()), per_doc


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda i: i.where)
def test_a_documented_command_parses(invocation: Invocation, monkeypatch: pytest.MonkeyPatch):
    assert parse(list(invocation.argv), monkeypatch) is None, str(invocation)


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda i: i.where)
def test_a_documented_command_runs_from_the_checkout_and_under_sudo_when_it_needs_root(invocation: Invocation):
    # sudo's secure_path lacks .venv/bin, and a bare `hybridtrain` is on PATH only in an
    # activated virtual environment.
    assert invocation.program in (COMMAND, f"~/hybridtrain/{COMMAND}"), f"write {COMMAND}: {invocation}"
    needs_root = invocation.argv[0] in NEEDS_ROOT
    assert invocation.sudo == needs_root, f"{'add' if needs_root else 'drop'} sudo: {invocation}"


def test_an_inline_command_that_needs_root_is_written_with_sudo_and_the_virtual_environment():
    # `sudo hybridtrain ...` is "command not found": sudo's PATH lacks .venv/bin.
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for span in re.findall(r"`(sudo [^`]+)`", text):
            assert span.split()[1].startswith(".venv/bin/"), f"{doc}: {span}"
        for span in re.findall(r"`((?:\S*/)?hybridtrain (?:bench|testbed) [^`]+)`", text):
            assert False, f"{doc}: write sudo .venv/bin/hybridtrain: {span}"


def test_a_stale_flag_is_caught(monkeypatch: pytest.MonkeyPatch):
    assert "--clusterz" in parse(["runs", "create", "--name", "x", "--nodes", "1", "--clusterz", "1"], monkeypatch)
    assert parse(["launch", "--workers", "2", "--nope", "train.py"], monkeypatch)
    assert parse(["train", "--workers", "2", "--nope"], monkeypatch)
    assert parse(["agent", "--nope"], monkeypatch)
    assert parse(["clusters", "list"], monkeypatch) is None
