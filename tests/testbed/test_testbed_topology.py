"""The YAML config: the shipped files load, bad files are refused with the field named."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from testbed.errors import ConfigError
from testbed.topology import check_cpu_budget, load_config, plan

BENCH = Path(__file__).resolve().parents[2] / "bench" / "testbeds"


def test_paper_config_is_seed_000_testbed() -> None:
    config = load_config(BENCH / "paper.yaml")
    the_plan = plan(config)
    nodes = {ep.name: ep for ep in the_plan.endpoints if ep.role == "node"}
    assert {ep.gpu for ep in nodes.values()} == {"RTX 3090 Ti", "RTX 3090", "V100 SXM2"}
    assert config.wan_mbit("onprem", "cloud") == 100
    assert all(s.link_mbit == 1000 for s in config.sites)
    # Quotas in proportion to FP32 FLOPs: 40 / 15.7 between the 3090 Ti and a V100.
    assert nodes["onprem-3090ti"].cpu_cores / nodes["cloud-v100-a"].cpu_cores == pytest.approx(
        40 / 15.7
    )
    assert the_plan.endpoint("onprem-ps").site == "onprem"
    check_cpu_budget(the_plan, machine_cores=2)


def test_intercontinental_config_has_table_3_bandwidths() -> None:
    config = load_config(BENCH / "intercontinental.yaml")
    assert config.wan_mbit("eu", "aus") == 70
    assert config.wan_mbit("asia", "us") == 130
    check_cpu_budget(plan(config), machine_cores=2)


def test_plan_gives_each_site_a_subnet_and_each_endpoint_a_prefixed_namespace() -> None:
    the_plan = plan(load_config(BENCH / "paper.yaml"))
    assert [s.subnet for s in the_plan.sites] == ["10.213.0.0/24", "10.213.1.0/24"]
    assert all(ep.netns.startswith("ht-paper-") for ep in the_plan.endpoints)
    assert len({ep.address for ep in the_plan.endpoints}) == len(the_plan.endpoints)
    assert the_plan.endpoint("cloud-v100-a").address.startswith("10.213.1.")


def test_the_object_store_and_site_caches_get_namespaces_of_their_own_without_a_quota(
    write_config: Callable[..., Path],
) -> None:
    the_plan = plan(load_config(write_config(object_store={"site": "cloud"}, site_caches=["lab", "cloud"])))
    store, lab_cache = the_plan.endpoint("store"), the_plan.endpoint("lab-cache")
    assert (store.role, store.site, store.address, store.cpu_cores) == ("store", "cloud", "10.213.1.4", 0.0)
    assert (lab_cache.role, lab_cache.address, the_plan.endpoint("cloud-cache").address) == \
        ("cache", "10.213.0.5", "10.213.1.5")
    check_cpu_budget(the_plan, machine_cores=2)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"wan": []}, "no link between sites 'lab' and 'cloud'"),
        ({"object_store": {"site": "moon"}}, "object_store.site: unknown site 'moon'"),
        ({"site_caches": ["lab", "moon"]}, r"site_caches\[1\]: unknown site 'moon'"),
        ({"nodes": [{"name": "store", "site": "lab", "gpu": "T4"}]}, "reserved"),
        ({"nodes": [{"name": "x", "site": "moon", "gpu": "T4"}]}, "unknown site 'moon'"),
        ({"nodes": [{"name": "x", "site": "lab", "gpu": "GTX 480"}]}, "give fp32_tflops"),
        ({"name": "Bad-Name"}, "name"),
        ({"server": {"host": "nobody", "cpu_cores": 0.3}}, "server.host"),
    ],
)
def test_invalid_config_names_the_field(
    write_config: Callable[..., Path], change: dict[str, object], message: str
) -> None:
    path = write_config()
    raw = yaml.safe_load(path.read_text()) | change
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_quotas_that_could_not_bind_are_refused(write_config: Callable[..., Path]) -> None:
    config = load_config(write_config(cpu={"cores_per_tflop": 0.05}))
    with pytest.raises(ConfigError, match="above 1 core"):
        check_cpu_budget(plan(config), machine_cores=2)
    config = load_config(write_config(cpu={"cores_per_tflop": 0.02}))
    with pytest.raises(ConfigError, match="quotas total"):
        check_cpu_budget(plan(config), machine_cores=2)


def test_a_quota_below_the_kernels_smallest_is_refused_not_rounded_up(
    write_config: Callable[..., Path],
) -> None:
    config = load_config(write_config(cpu={"cores_per_tflop": 0.001}))
    with pytest.raises(ConfigError, match="below the smallest quota"):
        check_cpu_budget(plan(config), machine_cores=2)
