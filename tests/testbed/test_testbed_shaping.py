"""The links run at their configured rates: real TCP between namespaces, measured."""

from __future__ import annotations

import pytest

from testbed import probe
from testbed.state import TestbedState

TOLERANCE = 0.20


def _rate(state: TestbedState, src: str, dst: str) -> float:
    a, b = state.endpoints[src], state.endpoints[dst]
    return probe.measure(a["netns"], b["netns"], b["address"], seconds=1.5)


def test_link_inside_a_site_runs_near_1_gbit(two_sites: TestbedState) -> None:
    assert _rate(two_sites, "lab-a", "lab-b") == pytest.approx(1000, rel=TOLERANCE)


def test_wan_runs_near_100_mbit_in_both_directions(two_sites: TestbedState) -> None:
    assert _rate(two_sites, "lab-a", "cloud-a") == pytest.approx(100, rel=TOLERANCE)
    assert _rate(two_sites, "cloud-a", "lab-b") == pytest.approx(100, rel=TOLERANCE)


def test_namespaces_of_a_testbed_cannot_reach_the_host(two_sites: TestbedState) -> None:
    # The only route out of an endpoint is its site's gateway, which routes only between sites.
    import subprocess
    import sys

    from testbed import netns

    code = (
        "import socket\n"
        "s = socket.socket(); s.settimeout(1)\n"
        "try:\n    s.connect(('192.0.2.1', 80)); print('reached')\n"
        "except OSError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run(
        netns.exec_argv(two_sites.endpoints["lab-a"]["netns"], [sys.executable, "-c", code]),
        capture_output=True, text=True, timeout=30, check=False,
    ).stdout  # fmt: skip
    assert out.startswith("refused")


def test_the_object_stores_bytes_across_the_wan_are_counted_and_shaped(
    needs_root: None, write_config, state_dir
) -> None:
    from testbed import lifecycle, shaping
    from testbed.topology import load_config, plan

    path = write_config(object_store={"site": "cloud"})
    config = load_config(path)
    try:
        state = lifecycle.up(path, state_dir=state_dir, services=False, log=lambda _m: None)
        rate = _rate(state, "store", "lab-a")
        sent = shaping.store_bytes_by_site(plan(config))
    finally:
        lifecycle.down(config.name, state_dir=state_dir, log=lambda _m: None)
    assert rate == pytest.approx(100, rel=TOLERANCE)
    # 1.5 s at 100 Mbit/s crossed into the lab, counted apart from the cloud's other traffic.
    assert set(sent) == {"lab"} and sent["lab"] == pytest.approx(1.5 * 100e6 / 8, rel=0.3)
