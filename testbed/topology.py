"""The testbed's YAML config, its validation, and the plan derived from it.

A config names sites (each one bridge and one /24), the WAN bandwidth between every pair of
sites, the emulated nodes with their GPU models, the parameter server's pod and the control
plane. `plan()` turns it into concrete names: namespaces, interfaces, addresses, CPU quotas.
Every name carries the prefix `ht-{testbed}-` so that `down` can find what `up` made.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from testbed.errors import ConfigError

PREFIX = "ht-"
# 10.213.0.0/16 is used only inside the namespaces the testbed creates: site i is 10.213.i.0/24,
# its gateway (the hub's bridge address) .1, the control plane .2, the server pod .3, the object
# store .4, the site's cache .5, nodes .10+.
ADDRESS_BASE = "10.213"
NODE_IFACE = "ht-eth0"  # inside each endpoint namespace; GLOO_SOCKET_IFNAME points here
# 10 ms, not the kernel's default 100: a quota is per period, so a process that idles for part
# of a period may then spend the whole period's quota at full speed. Trainers idle between
# steps (waiting on the wire), and with 100 ms periods a 0.157-core node computed 12 % faster
# with 0.27 s gaps than without (0.617 against 0.701 s a step, measured 2026-11-23), which
# made in-run compute faster than the standalone measurement of the ideal. With 10 ms the
# two agree within 1 %. The kernel's smallest quota, 1 ms, is then 0.1 core (MIN_CORES).
CPU_PERIOD_US = 10_000
MIN_QUOTA_US = 1000
MIN_CORES = MIN_QUOTA_US / CPU_PERIOD_US

# FP32 (non-tensor) TFLOPs from NVIDIA's data sheets, the same figures as the control plane's
# GPU catalog; a node may override with `fp32_tflops` for a model not listed here.
GPU_FP32_TFLOPS: dict[str, float] = {
    "RTX 3090 Ti": 40.0,
    "RTX 3090": 35.6,
    "V100 SXM2": 15.7,
    "V100 PCIe": 14.0,
    "T4": 8.1,
    "A10": 31.2,
    "L4": 30.3,
    "A100 40GB": 19.5,
    "A100 80GB": 19.5,
}

Name = Annotated[str, Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", max_length=24)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Site(_Strict):
    """A place with its own LAN: one bridge, one /24."""

    name: Name
    kind: Literal["onprem", "cloud"]
    provider: Literal["onprem", "gcp", "aws", "azure", "lambda", "other"]
    region: str
    zone: str | None = None
    continent: Literal["north_america", "south_america", "europe", "asia", "oceania", "africa"]
    # Each endpoint's link to its site's bridge, shaped in both directions.
    link_mbit: float = Field(default=1000.0, gt=0)


class WanLink(_Strict):
    """The bandwidth between two sites, the same in both directions (seed 003 measured them so)."""

    between: tuple[Name, Name]
    mbit: float = Field(gt=0)

    @field_validator("between")
    @classmethod
    def _two_different_sites(cls, value: tuple[str, str]) -> tuple[str, str]:
        if value[0] == value[1]:
            raise ValueError(f"a WAN link joins two different sites, got {value[0]!r} twice")
        return value


class Node(_Strict):
    """An emulated GPU machine: a namespace on its site's bridge, with a CPU quota."""

    name: Name
    site: Name
    gpu: str
    gpu_count: int = Field(default=1, ge=1)
    fp32_tflops: float | None = Field(default=None, gt=0)
    instance_type: str | None = None
    spot: bool = False

    @property
    def tflops(self) -> float:
        """FP32 TFLOPs of all this node's GPUs together."""
        per_gpu = self.fp32_tflops if self.fp32_tflops is not None else GPU_FP32_TFLOPS[self.gpu]
        return per_gpu * self.gpu_count


class ServerPod(_Strict):
    """The parameter server's pod: its own namespace and quota, on the site of `host`."""

    name: Name = "ps"
    host: Name
    # The paper limits the server to 3 cores of a real machine; scaled here (see CpuScale).
    cpu_cores: float = Field(gt=0)


class ControlPlane(_Strict):
    """Where the control plane (and its broker) runs: a namespace on `site`'s bridge."""

    site: Name
    cpu_cores: float = Field(default=0.5, gt=0)
    port: int = Field(default=8000, ge=1, le=65535)


class ObjectStore(_Strict):
    """An S3 endpoint (moto's server, the tests' store) in its own namespace on `site`: every
    other site reaches it over its WAN link, as a cloud's object store."""

    site: Name
    port: int = Field(default=9000, ge=1, le=65535)


class CpuScale(_Strict):
    """How FP32 TFLOPs become a CPU quota: cores = tflops * cores_per_tflop."""

    cores_per_tflop: float = Field(gt=0)
    # The quotas must bind (sum below the machine's cores) or they would mean nothing; this is
    # the share of the machine the testbed may hand out, the rest is for everything else.
    max_machine_share: float = Field(default=0.85, gt=0, le=1)
    # A node's threads but its main one (sockets, TLS, the relay, gloo's) run on the node's host
    # group, not its quota: on a GPU machine the host's CPUs move the bytes (thread_placer.py).
    threads_on_host: bool = True


class TestbedConfig(_Strict):
    """A whole testbed as written in bench/testbeds/*.yaml."""

    __test__ = False

    name: str = Field(pattern=r"^[a-z0-9]{1,10}$")
    description: str = ""
    cpu: CpuScale
    sites: list[Site] = Field(min_length=1, max_length=200)
    wan: list[WanLink] = []
    nodes: list[Node] = Field(min_length=1)
    server: ServerPod | None = None
    control_plane: ControlPlane | None = None
    object_store: ObjectStore | None = None
    # Sites with a site cache (`hybridtrain datasets serve-cache`) in a namespace of its own,
    # which that site's agents read data sets through.
    site_caches: list[Name] = []

    @model_validator(mode="after")
    def _consistent(self) -> TestbedConfig:
        site_names = [s.name for s in self.sites]
        _unique("sites", site_names)
        endpoint_names = [n.name for n in self.nodes] + ([self.server.name] if self.server else [])
        _unique("nodes", endpoint_names)
        if {"cp", "hub", "host", "store"} & set(endpoint_names) or any(n.endswith("-cache") for n in endpoint_names):
            raise ValueError("node names 'cp', 'hub', 'host', 'store' and '*-cache' are reserved for the testbed")
        for i, node in enumerate(self.nodes):
            if node.site not in site_names:
                raise ValueError(f"nodes[{i}].site: unknown site {node.site!r}")
            if node.fp32_tflops is None and node.gpu not in GPU_FP32_TFLOPS:
                raise ValueError(
                    f"nodes[{i}].gpu: {node.gpu!r} is not in the FLOPs table "
                    f"({', '.join(GPU_FP32_TFLOPS)}); give fp32_tflops"
                )
        if self.server and self.server.host not in {n.name for n in self.nodes}:
            raise ValueError(f"server.host: unknown node {self.server.host!r}")
        if self.control_plane and self.control_plane.site not in site_names:
            raise ValueError(f"control_plane.site: unknown site {self.control_plane.site!r}")
        if self.object_store and self.object_store.site not in site_names:
            raise ValueError(f"object_store.site: unknown site {self.object_store.site!r}")
        for i, site in enumerate(self.site_caches):
            if site not in site_names:
                raise ValueError(f"site_caches[{i}]: unknown site {site!r}")
        _unique("site_caches", list(self.site_caches))
        pairs: set[frozenset[str]] = set()
        for i, link in enumerate(self.wan):
            for end in link.between:
                if end not in site_names:
                    raise ValueError(f"wan[{i}].between: unknown site {end!r}")
            pair = frozenset(link.between)
            if pair in pairs:
                raise ValueError(f"wan[{i}]: a second link between {sorted(pair)}")
            pairs.add(pair)
        # Every pair of sites needs a bandwidth: an unshaped path would silently run at memory speed.
        for a, b in itertools.combinations(site_names, 2):
            if frozenset((a, b)) not in pairs:
                raise ValueError(f"wan: no link between sites {a!r} and {b!r}")
        return self

    def site(self, name: str) -> Site:
        """The site called `name`."""
        return next(s for s in self.sites if s.name == name)

    def wan_mbit(self, a: str, b: str) -> float:
        """The WAN bandwidth between sites `a` and `b`."""
        return next(w.mbit for w in self.wan if frozenset(w.between) == frozenset((a, b)))


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: the name {name!r} appears twice")
        seen.add(name)


def load_config(path: str | Path) -> TestbedConfig:
    """Read and validate a testbed YAML file; errors name the file and the field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    try:
        return TestbedConfig.model_validate(raw)
    except ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {details}") from exc


# ---------------------------------------------------------------------------------------------
# The plan: concrete names and numbers.


@dataclass(frozen=True)
class Endpoint:
    """One namespace on a site's bridge: a node, the server pod or the control plane."""

    name: str
    role: Literal["node", "server", "control-plane", "store", "cache"]
    site: str
    netns: str
    address: str
    hub_port: str  # the veth end on the hub side, a port of the site's bridge
    cpu_cores: float
    gpu: str | None = None
    tflops: float = 0.0


@dataclass(frozen=True)
class SitePlan:
    """A site's bridge in the hub namespace, its subnet and gateway."""

    name: str
    index: int
    bridge: str
    subnet: str
    gateway: str
    link_mbit: float


@dataclass(frozen=True)
class Plan:
    """Everything `up` creates, named."""

    config: TestbedConfig
    prefix: str
    hub_netns: str
    cgroup_name: str
    sites: tuple[SitePlan, ...]
    endpoints: tuple[Endpoint, ...]

    def endpoint(self, name: str) -> Endpoint:
        """The endpoint called `name`."""
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(name)

    def site_plan(self, name: str) -> SitePlan:
        """The planned site called `name`."""
        return next(s for s in self.sites if s.name == name)

    @property
    def total_cpu_cores(self) -> float:
        """The sum of every endpoint's quota, in cores."""
        return sum(ep.cpu_cores for ep in self.endpoints)


def cache_name(site: str) -> str:
    """The endpoint of site `site`'s cache."""
    return f"{site}-cache"


def name_prefix(name: str) -> str:
    """The prefix of every namespace and cgroup of testbed `name`."""
    return f"{PREFIX}{name}-"


def plan(config: TestbedConfig) -> Plan:
    """Name everything: namespaces, bridges, ports, addresses and quotas."""
    prefix = name_prefix(config.name)
    sites = tuple(
        SitePlan(
            name=s.name,
            index=i,
            bridge=f"{PREFIX}br{i}",
            subnet=f"{ADDRESS_BASE}.{i}.0/24",
            gateway=f"{ADDRESS_BASE}.{i}.1",
            link_mbit=s.link_mbit,
        )
        for i, s in enumerate(config.sites)
    )
    by_site = {s.name: s for s in sites}
    next_host = {s.name: 10 for s in sites}
    endpoints: list[Endpoint] = []

    def add(name: str, role: str, site: str, host: int, cores: float, **extra: object) -> None:
        endpoints.append(
            Endpoint(
                name=name,
                role=role,  # type: ignore[arg-type]
                site=site,
                netns=f"{prefix}{name}",
                address=f"{ADDRESS_BASE}.{by_site[site].index}.{host}",
                hub_port=f"{PREFIX}p{len(endpoints)}",
                cpu_cores=cores,
                **extra,  # type: ignore[arg-type]
            )
        )

    if config.control_plane:
        add("cp", "control-plane", config.control_plane.site, 2, config.control_plane.cpu_cores)
    if config.server:
        host_site = next(n.site for n in config.nodes if n.name == config.server.host)
        add(config.server.name, "server", host_site, 3, config.server.cpu_cores)
    # The store and the caches move bytes, which on a real machine its NIC and other cores do:
    # no CPU quota (0), so their share of the machine is no node's compute.
    if config.object_store:
        add("store", "store", config.object_store.site, 4, 0.0)
    for site_name in config.site_caches:
        add(cache_name(site_name), "cache", site_name, 5, 0.0)
    for node in config.nodes:
        host = next_host[node.site]
        if host > 254:
            raise ConfigError(f"site {node.site!r}: more than 245 nodes")
        next_host[node.site] = host + 1
        cores = node.tflops * config.cpu.cores_per_tflop
        add(node.name, "node", node.site, host, cores, gpu=node.gpu, tflops=node.tflops)
    return Plan(
        config=config,
        prefix=prefix,
        hub_netns=f"{prefix}hub",
        cgroup_name=f"{PREFIX}{config.name}",
        sites=sites,
        endpoints=tuple(endpoints),
    )


def check_cpu_budget(the_plan: Plan, machine_cores: int | None = None) -> None:
    """Refuse quotas that could not bind on this machine: one thread per node, sum below the cores."""
    cores = machine_cores or os.cpu_count() or 1
    for ep in the_plan.endpoints:
        if ep.cpu_cores and ep.cpu_cores < MIN_CORES:
            raise ConfigError(
                f"{ep.role} {ep.name!r}: {ep.cpu_cores:.3f} cores, below the smallest quota the "
                f"kernel takes ({MIN_QUOTA_US} us every {CPU_PERIOD_US} us, {MIN_CORES:.2f} core); "
                "raise cpu.cores_per_tflop (or its cpu_cores)"
            )
        if ep.role == "node" and ep.cpu_cores > 1.0:
            raise ConfigError(
                f"node {ep.name!r}: {ep.cpu_cores:.2f} cores, but its torch runs one thread, "
                "so a quota above 1 core would not bind; lower cpu.cores_per_tflop"
            )
    budget = cores * the_plan.config.cpu.max_machine_share
    if the_plan.total_cpu_cores > budget:
        raise ConfigError(
            f"quotas total {the_plan.total_cpu_cores:.2f} cores, more than "
            f"{the_plan.config.cpu.max_machine_share:.0%} of this machine's {cores}; "
            "lower cpu.cores_per_tflop or the server's cpu_cores"
        )
