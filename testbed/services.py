"""The testbed's services: broker and control plane in their namespace, one agent per node.

Order (each process is recorded in the state file before `up` goes on):
1. redis-server in the control plane's namespace, bound to its testbed address only;
2. `hybridtrain server` there, on SQLite under var/testbed/<name>/, with a fresh admin token;
3. a forwarder from 127.0.0.1 into that namespace, so the host (the CLI, a browser, the
   benchmark) reaches the API without any testbed address in the root namespace;
4. the sites and nodes registered through the REST API, each node with its provider, region,
   declared GPU and a label naming its namespace; the server pod is a node without GPUs;
5. `hybridtrain agent` inside each node's namespace, in the node's host cgroup, with its node's
   join token and a trainer command that moves each role onto the node's quota (incgroup.py);
   no broker: each agent takes it from the control plane, with a Redis user of its node's own;
   before them, unless the config's `cpu.threads_on_host` is false, the thread placer that keeps
   each node's threads but its main one off the node's quota (thread_placer.py);
6. wait until every node is online.
With an `object_store` in the config, moto's S3 server runs in the store's namespace (the
control plane reads data sets from it with a key pair of this testbed's own), and each site in
`site_caches` runs `hybridtrain datasets serve-cache` in its cache's namespace, which that
site's agents read through; both start before the control plane and get forwarders from
127.0.0.1, so the host can fill the store and read the caches' counters.
"""

from __future__ import annotations

import functools
import json
import secrets
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from testbed import forward, processes, thread_placer
from testbed.errors import ServiceError, TestbedError
from testbed.state import TestbedState, save
from testbed.topology import Plan, cache_name

Log = Callable[[str], None]
REDIS_PORT = 6379
SITE_CACHE_PORT = 8700
READY_TIMEOUT_S = 180.0


def _hybridtrain() -> list[str]:
    # The same interpreter and code as this process, whatever is on PATH inside `ip netns exec`.
    return [sys.executable, "-m", "app.cli"]


def start(the_plan: Plan, state: TestbedState, state_dir: Path, *, log: Log = print) -> None:
    """Start broker, control plane, forwarder and agents of the testbed, and register the nodes."""
    if the_plan.config.control_plane is None:
        raise ServiceError("the config has no control_plane section: nothing to start")
    cp = the_plan.endpoint("cp")
    port = the_plan.config.control_plane.port
    work = (state_dir / state.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    admin_token = _secret_file(work / "admin_token", 24)
    _secret_file(work / "secret_key", 32)
    broker_url = f"redis://{cp.address}:{REDIS_PORT}/0"
    internal_url = f"http://{cp.address}:{port}"
    cp_group = Path(state.endpoints["cp"]["cgroup"])

    t0 = time.monotonic()
    store_env, store_secrets = _start_data_services(the_plan, state, state_dir, work)
    _start_redis(state, state_dir, cp.netns, cp.address, cp_group, work)
    _spawn_service(
        state, state_dir, name="control-plane", argv=[*_hybridtrain(), "server", "--host",
        cp.address, "--port", str(port), "--log-level", "warning", "--no-access-log"],
        netns_name=cp.netns, cgroup=cp_group,
        env={
            "HYBRIDTRAIN_DATABASE_URL": f"sqlite+pysqlite:///{work / 'control-plane.db'}",
            "CELERY_BROKER_URL": broker_url,
            "HYBRIDTRAIN_PUBLIC_URL": internal_url,
            **store_env,
        },
        secret_env={"HYBRIDTRAIN_ADMIN_TOKEN": str(work / "admin_token"),
                    "HYBRIDTRAIN_SECRET_KEY": str(work / "secret_key"), **store_secrets},
    )  # fmt: skip
    fwd_port = forward.free_port()
    processes.spawn(
        state, state_dir, name="forwarder", argv=[sys.executable, "-m", "testbed.forward",
        "--listen-port", str(fwd_port), "--netns", cp.netns, "--to", f"{cp.address}:{port}"],
        netns_name=None, cgroup=Path(state.cgroup),
    )  # fmt: skip
    if the_plan.config.cpu.threads_on_host:
        _start_thread_placer(state, state_dir, work)
    url = f"http://127.0.0.1:{fwd_port}"
    state.services.update(
        {"internal_url": internal_url, "forwarded_url": url, "broker_url": broker_url,
         "admin_token_file": str(work / "admin_token")}
    )  # fmt: skip
    save(state, state_dir)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"},
                      timeout=30.0, trust_env=False) as api:  # fmt: skip
        _wait_healthy(api, state)
        log(f"testbed {state.name}: control plane up at {url} in {time.monotonic() - t0:.1f} s")
        site_cache_urls = {site: c["internal_url"] for site, c in state.services.get("site_caches", {}).items()}
        node_ids, tokens = _register(api, the_plan, log)
        state.services["node_ids"] = node_ids
        save(state, state_dir)
        for name, token in tokens.items():
            ep = the_plan.endpoint(name)
            # The agent on the node's host group; its roles on the node's quota (incgroup.py).
            trainer = [sys.executable, "-m", "testbed.incgroup",
                       state.endpoints[name]["cgroup"], "--", sys.executable, "-m", "trainer"]
            # Task profiles measure the node's compute, so they too run on the node's quota.
            profiler = [*trainer[:-1], "trainer.profile"]
            # No reference benchmark at start: the agent would measure its host group's 0.25
            # core, not the node's quota (the nodes declare their GPUs, so plans use FLOPs), and
            # four agents importing torch on those quotas took most of the testbed's start.
            _spawn_service(
                state, state_dir, name=f"agent-{name}", argv=[*_hybridtrain(), "agent",
                "--server", internal_url, "--token", token,
                "--state-dir", str(work / "agents" / name),
                "--advertise-address", ep.address, "--role-threads", "1", "--benchmark-seconds", "0",
                "--trainer-command", json.dumps(trainer), "--profile-command", json.dumps(profiler),
                # A lock of the node's own: its profiles run on its own quota, which keeps them
                # apart from the other nodes' (the per-host lock is for agents sharing a CPU).
                "--profile-lock-path", str(work / "agents" / name / "profile.lock"),
                "--log-level", "WARNING"],
                netns_name=ep.netns, cgroup=Path(state.endpoints[name]["host_cgroup"]),
                env={"HYBRIDTRAIN_AGENT_DATA_SITE_CACHE_URL": site_cache_urls[ep.site]}
                if ep.site in site_cache_urls else None,
            )  # fmt: skip
        _wait_online(api, node_ids, state)
        _wait_data_services(state)
    log(f"testbed {state.name}: {len(node_ids)} agents online, {time.monotonic() - t0:.1f} s")


def _start_data_services(
    the_plan: Plan, state: TestbedState, state_dir: Path, work: Path
) -> tuple[dict[str, str], dict[str, str]]:
    """Start the object store and the site caches with their forwarders; the control plane's
    settings for the store (plain, and secret as the files they are read from)."""
    for site in the_plan.config.site_caches:
        ep = the_plan.endpoint(cache_name(site))
        folder = work / "site-caches" / site
        _spawn_service(
            state, state_dir, name=f"site-cache-{site}", argv=[*_hybridtrain(), "datasets", "serve-cache",
            "--dir", str(folder), "--host", ep.address, "--port", str(SITE_CACHE_PORT)],
            netns_name=ep.netns, cgroup=Path(state.endpoints[ep.name]["cgroup"]),
        )  # fmt: skip
        state.services.setdefault("site_caches", {})[site] = {
            "internal_url": f"http://{ep.address}:{SITE_CACHE_PORT}",
            "forwarded_url": _forward(state, state_dir, f"site-cache-{site}", ep.netns, ep.address, SITE_CACHE_PORT),
        }
    store_config = the_plan.config.object_store
    if store_config is None:
        save(state, state_dir)
        return {}, {}
    moto = Path(sys.executable).with_name("moto_server")
    if not moto.exists():
        raise ServiceError(f"the testbed's object store needs moto's server ({moto}): pip install 'moto[server]'")
    ep = the_plan.endpoint("store")
    _spawn_service(
        state, state_dir, name="object-store", argv=[str(moto), "-H", ep.address, "-p", str(store_config.port)],
        netns_name=ep.netns, cgroup=Path(state.endpoints["store"]["cgroup"]), env={"MOTO_CALL_RESET_API": "false"},
    )  # fmt: skip
    # moto takes any key pair; the testbed still hands out one of its own, as a real store needs.
    _secret_file(work / "store_key_id", 12)
    _secret_file(work / "store_secret_key", 24)
    region = the_plan.config.site(store_config.site).region
    internal = f"http://{ep.address}:{store_config.port}"
    state.services["object_store"] = {
        "internal_url": internal, "region": region,
        "forwarded_url": _forward(state, state_dir, "object-store", ep.netns, ep.address, store_config.port),
        "key_id_file": str(work / "store_key_id"), "secret_key_file": str(work / "store_secret_key"),
    }  # fmt: skip
    save(state, state_dir)
    env = {"HYBRIDTRAIN_DATASET_S3_ENDPOINT_URL": internal, "HYBRIDTRAIN_DATASET_S3_REGION": region}
    secrets_ = {"HYBRIDTRAIN_DATASET_S3_ACCESS_KEY_ID": str(work / "store_key_id"),
                "HYBRIDTRAIN_DATASET_S3_SECRET_ACCESS_KEY": str(work / "store_secret_key")}
    return env, secrets_


def _forward(state: TestbedState, state_dir: Path, name: str, ns: str, address: str, port: int) -> str:
    """A forwarder from a free port of 127.0.0.1 to `address:port` in namespace `ns`; its URL."""
    listen = forward.free_port()
    processes.spawn(
        state, state_dir, name=f"forwarder-{name}", argv=[sys.executable, "-m", "testbed.forward",
        "--listen-port", str(listen), "--netns", ns, "--to", f"{address}:{port}"],
        netns_name=None, cgroup=Path(state.cgroup),
    )  # fmt: skip
    return f"http://127.0.0.1:{listen}"


def _wait_data_services(state: TestbedState) -> None:
    """Wait until the object store and the site caches answer through their forwarders."""
    probes = [f"{c['forwarded_url']}/health" for c in state.services.get("site_caches", {}).values()]
    if "object_store" in state.services:
        probes.append(f"{state.services['object_store']['forwarded_url']}/moto-api/")
    deadline = time.monotonic() + READY_TIMEOUT_S
    for url in probes:
        while True:
            _alive_or_raise(state)
            try:
                if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServiceError(f"{url} did not answer within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.3)


def store_client(state: TestbedState) -> Any:
    """A boto3 S3 client of the testbed's object store, through its forwarder, with its key pair."""
    import boto3

    store = state.services["object_store"]
    return boto3.client(
        "s3", endpoint_url=store["forwarded_url"], region_name=store["region"],
        aws_access_key_id=Path(store["key_id_file"]).read_text().strip(),
        aws_secret_access_key=Path(store["secret_key_file"]).read_text().strip(),
    )  # fmt: skip


def _start_redis(
    state: TestbedState, state_dir: Path, ns: str, address: str, group: Path, work: Path
) -> None:
    redis = shutil.which("redis-server")
    if redis is None:
        raise ServiceError("the testbed's broker needs redis-server on PATH")
    (work / "redis").mkdir(exist_ok=True)
    _spawn_service(
        state, state_dir, name="redis", argv=[redis, "--bind", address, "--port", str(REDIS_PORT),
        "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", str(work / "redis")],
        netns_name=ns, cgroup=group,
    )  # fmt: skip


def _start_thread_placer(state: TestbedState, state_dir: Path, work: Path) -> None:
    # Each node's threads but its main one on the node's host group (thread_placer.py); the
    # server's pod and the control plane keep all of theirs on their quotas.
    moves = [f"{ep['cgroup']}:{ep['host_cgroup']}" for ep in state.endpoints.values() if ep["role"] == "node"]
    pause = work / thread_placer.PAUSE_FILE
    pause.unlink(missing_ok=True)
    state.services["threads_on_quota_file"] = str(pause)
    _spawn_service(
        state, state_dir, name="thread-placer", argv=[sys.executable, "-m", "testbed.thread_placer",
        *(a for m in moves for a in ("--move", m)), "--pause-file", str(pause)],
        netns_name=None, cgroup=Path(state.cgroup),
    )  # fmt: skip


def _secret_file(path: Path, nbytes: int) -> str:
    """A fresh secret, kept in an owner-only file so that a restarted service reads the same."""
    value = secrets.token_urlsafe(nbytes)
    path.write_text(value + "\n")
    path.chmod(0o600)
    return value


def _spawn_service(
    state: TestbedState,
    state_dir: Path,
    *,
    name: str,
    argv: list[str],
    netns_name: str | None,
    cgroup: Path,
    env: dict[str, str] | None = None,
    secret_env: dict[str, str] | None = None,
) -> processes.ProcessRecord:
    """Start a service and record how, so that `restart` can start it again (the fault
    benchmark kills and restarts the control plane, the broker and agents); secrets are
    recorded as the files they are read from, never as values."""
    state.services.setdefault("specs", {})[name] = {
        "argv": argv, "netns": netns_name, "cgroup": str(cgroup), "env": env or {},
        "secret_env": secret_env or {},
    }
    return processes.spawn(state, state_dir, name=name, argv=argv, netns_name=netns_name,
                           cgroup=cgroup, env=_service_env(env, secret_env))  # fmt: skip


def _service_env(env: dict[str, str] | None, secret_env: dict[str, str] | None) -> dict[str, str]:
    out = dict(env or {})
    for key, path in (secret_env or {}).items():
        out[key] = Path(path).read_text().strip()
    return out


def service(state: TestbedState, name: str) -> processes.ProcessRecord:
    """The latest process record of service `name` (a restart appends a new one)."""
    records = [r for r in state.processes if r.name == name]
    if not records:
        raise ServiceError(f"testbed {state.name} has no service {name!r}")
    return records[-1]


def restart(state: TestbedState, state_dir: Path, name: str) -> processes.ProcessRecord:
    """Start service `name` again as `start` first did (after it was stopped or killed)."""
    spec = state.services.get("specs", {}).get(name)
    if spec is None:
        raise ServiceError(f"testbed {state.name}: no recorded way to start {name!r}")
    if processes.is_alive(service(state, name)):
        raise ServiceError(f"testbed {state.name}: {name} is still running")
    return processes.spawn(
        state, state_dir, name=name, argv=spec["argv"], netns_name=spec["netns"],
        cgroup=Path(spec["cgroup"]), env=_service_env(spec["env"], spec["secret_env"]),
    )  # fmt: skip


def wait_healthy(state: TestbedState) -> None:
    """Wait until the control plane answers /healthz (after a restart)."""
    with admin_client(state) as api:
        _wait_healthy(api, state)


def wait_online(state: TestbedState, names: list[str]) -> None:
    """Wait until the agents of nodes `names` are online again."""
    ids = {n: state.services["node_ids"][n] for n in names}
    with admin_client(state) as api:
        _wait_online(api, ids, state)


def _alive_or_raise(state: TestbedState) -> None:
    # The latest start of each service: a restarted one leaves its dead record behind, and
    # one-off processes (standalone measurements) are not services.
    latest = {r.name: r for r in state.processes if r.name in state.services.get("specs", {})}
    for record in latest.values():
        if not processes.is_alive(record):
            tail = Path(record.log).read_text(errors="replace").splitlines()[-15:]
            raise ServiceError(f"{record.name} exited; the end of {record.log}:\n" + "\n".join(tail))


def _wait_healthy(api: httpx.Client, state: TestbedState) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        _alive_or_raise(state)
        try:
            if api.get("/healthz").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServiceError(f"the control plane did not answer /healthz within {READY_TIMEOUT_S:.0f} s")


def check_response(resp: httpx.Response, what: str, error: type[TestbedError] = TestbedError) -> Any:
    """The JSON of a control-plane answer; `error` naming `what` on an HTTP error status."""
    if resp.status_code >= 400:
        raise error(f"{what}: HTTP {resp.status_code}: {resp.text[:800]}")
    return resp.json()


# A registration the control plane refuses is the testbed's services not coming up.
_check = functools.partial(check_response, error=ServiceError)


def _ensure_gpu_models(api: httpx.Client, the_plan: Plan, log: Log) -> None:
    catalog = {m["name"]: m for m in _check(api.get("/api/v1/gpu-models", params={"limit": 500}),
                                            "list GPU models")["data"]}  # fmt: skip
    for node in the_plan.config.nodes:
        tflops = node.tflops / node.gpu_count
        known = catalog.get(node.gpu)
        if known is None:
            raise ServiceError(f"GPU model {node.gpu!r} of node {node.name} is not in the catalog")
        if abs(float(known["fp32_tflops"]) - tflops) > 0.05 * tflops:
            log(f"warning: {node.gpu} is {known['fp32_tflops']} TFLOPs in the catalog but "
                f"{tflops} in the testbed (GPU_FP32_TFLOPS or fp32_tflops in the config)")  # fmt: skip


def _register(api: httpx.Client, the_plan: Plan, log: Log) -> tuple[dict[str, int], dict[str, str]]:
    _ensure_gpu_models(api, the_plan, log)
    cfg = the_plan.config
    site_ids: dict[str, int] = {}
    for site in cfg.sites:
        body = {"name": site.name, "kind": site.kind, "provider": site.provider,
                "region": site.region, "zone": site.zone, "continent": site.continent}  # fmt: skip
        site_ids[site.name] = _check(api.post("/api/v1/sites", json=body), f"site {site.name}")["id"]
    node_ids: dict[str, int] = {}
    tokens: dict[str, str] = {}
    for ep in the_plan.endpoints:
        if ep.role not in ("node", "server"):
            continue
        labels = {"testbed": cfg.name, "netns": ep.netns, "cpu_quota_cores": f"{ep.cpu_cores:.3f}"}
        body: dict[str, Any] = {"site_id": site_ids[ep.site], "name": ep.name,
                                "address": ep.address, "labels": labels}  # fmt: skip
        if ep.role == "node":
            node = next(n for n in cfg.nodes if n.name == ep.name)
            body |= {"gpus": [{"model": node.gpu, "count": node.gpu_count}],
                     "instance_type": node.instance_type, "spot": node.spot}  # fmt: skip
        else:
            assert cfg.server is not None
            body["labels"] |= {"role": "parameter-server", "pod_of": cfg.server.host}
        created = _check(api.post("/api/v1/nodes", json=body), f"node {ep.name}")
        node_ids[ep.name] = created["id"]
        tokens[ep.name] = created["join_token"]
    return node_ids, tokens


def _wait_online(api: httpx.Client, node_ids: dict[str, int], state: TestbedState) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    pending = set(node_ids)
    while pending and time.monotonic() < deadline:
        _alive_or_raise(state)
        for name in sorted(pending):
            node = _check(api.get(f"/api/v1/nodes/{node_ids[name]}"), f"node {name}")
            if node["status"] == "online":
                pending.discard(name)
        time.sleep(1.0)
    if pending:
        raise ServiceError(f"agents of {', '.join(sorted(pending))} did not come online "
                           f"within {READY_TIMEOUT_S:.0f} s; see var/testbed/{state.name}/logs/")  # fmt: skip


def admin_client(state: TestbedState) -> httpx.Client:
    """An API client for a running testbed, through its forwarder, with the admin token."""
    token = Path(state.services["admin_token_file"]).read_text().strip()
    return httpx.Client(
        base_url=state.services["forwarded_url"],
        headers={"Authorization": f"Bearer {token}"},
        timeout=60.0,
        trust_env=False,
    )

