"""Fixtures that build small real testbeds (root needed) and always tear them down."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from testbed import lifecycle
from testbed.state import TestbedState

TWO_SITES = {
    "cpu": {"cores_per_tflop": 0.01},
    "sites": [
        {"name": "lab", "kind": "onprem", "provider": "onprem", "region": "lab",
         "continent": "north_america", "link_mbit": 1000},
        {"name": "cloud", "kind": "cloud", "provider": "gcp", "region": "us-central1",
         "continent": "north_america", "link_mbit": 1000},
    ],
    "wan": [{"between": ["lab", "cloud"], "mbit": 100}],
    "nodes": [
        {"name": "lab-a", "site": "lab", "gpu": "RTX 3090 Ti"},
        {"name": "lab-b", "site": "lab", "gpu": "RTX 3090"},
        {"name": "cloud-a", "site": "cloud", "gpu": "V100 SXM2"},
    ],
}  # fmt: skip


@pytest.fixture
def needs_root() -> None:
    """Fail (never skip) without root: the testbed is tested for real or not at all."""
    if os.geteuid() != 0:
        pytest.fail("the testbed tests need root (network namespaces, tc, cgroups)")


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """Write a two-site config under a fresh testbed name and return its path."""

    def write(**overrides: object) -> Path:
        config = {"name": "t" + secrets.token_hex(4), **TWO_SITES, **overrides}
        path = tmp_path / f"{config['name']}.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A state directory of this test's own."""
    return tmp_path / "state"


@pytest.fixture
def two_sites(
    needs_root: None, write_config: Callable[..., Path], state_dir: Path
) -> Iterator[TestbedState]:
    """A two-site testbed (two nodes on-prem, one in the cloud) without services."""
    path = write_config()
    name = yaml.safe_load(path.read_text())["name"]
    try:
        yield lifecycle.up(path, state_dir=state_dir, services=False, log=lambda _m: None)
    finally:
        lifecycle.down(name, state_dir=state_dir, log=lambda _m: None)
