"""The state file: what a testbed has created, written before each thing is created.

`up` records its intent first and then acts, so a run killed at any point leaves a file from
which `down` removes everything (and `down` also sweeps by name prefix, for the rest).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_STATE_DIR = Path("var/testbed")


@dataclass
class ProcessRecord:
    """A process the testbed started: its pid, and its start time to tell it from a reused pid."""

    name: str
    pid: int
    create_time: float
    netns: str
    log: str


@dataclass
class TestbedState:
    """Everything one testbed has made, and what a client needs to use it."""

    __test__ = False

    name: str
    prefix: str
    config_path: str
    cgroup: str
    namespaces: list[str] = field(default_factory=list)
    processes: list[ProcessRecord] = field(default_factory=list)
    # endpoint name -> {"netns", "address", "site", "role", "cpu_cores", ...}
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Filled once services run: control-plane URLs, tokens, node ids.
    services: dict[str, Any] = field(default_factory=dict)
    complete: bool = False

    def to_json(self) -> str:
        """The state as JSON text."""
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TestbedState:
        """Parse a state written by `to_json`."""
        raw = json.loads(text)
        raw["processes"] = [ProcessRecord(**p) for p in raw.get("processes", [])]
        return cls(**raw)


def state_path(state_dir: Path, name: str) -> Path:
    """Where the state of testbed `name` lives."""
    return state_dir / f"{name}.json"


def save(state: TestbedState, state_dir: Path) -> None:
    """Write the state atomically (a half-written file would lose what `down` must remove)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_path(state_dir, state.name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, path)


def load(state_dir: Path, name: str) -> TestbedState | None:
    """The state of testbed `name`, or None when there is none."""
    path = state_path(state_dir, name)
    try:
        return TestbedState.from_json(path.read_text())
    except FileNotFoundError:
        return None


def remove(state_dir: Path, name: str) -> None:
    """Delete the state file of testbed `name`."""
    state_path(state_dir, name).unlink(missing_ok=True)


def known_names(state_dir: Path) -> list[str]:
    """The names of every testbed with a state file."""
    if not state_dir.exists():
        return []
    return sorted(p.stem for p in state_dir.glob("*.json"))
