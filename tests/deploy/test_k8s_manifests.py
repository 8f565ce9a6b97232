"""The Kubernetes manifests under deploy/k8s/: valid against the Kubernetes OpenAPI schemas
(bundled by kubernetes-validate, checked offline), and consistent with the code they run:
pinned images, the settings the control plane and the agent read, the agent's own flags,
Services and policies that select pods that exist, references to Secrets that exist."""

from __future__ import annotations

import re
import shlex
import socket
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import validate as k8s_validate
from kubernetes_validate.utils import ValidationError
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from agents.cli import build_parser, settings_from_args
from agents.config import AgentSettings
from app.api.routes.health import router as health_router
from app.config import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NAMESPACE = "hybridtrain"
# The oldest Kubernetes the manifests promise to work on, and the newest whose schemas the
# pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
SHELLS = ({"/bin/sh", "-c"}, {"sh", "-c"})
# Where a downward-API field would be filled in by the kubelet.
FIELD_SAMPLES = {"spec.nodeName": "gpu-node-1", "status.hostIP": "10.0.0.7"}

Doc = dict[str, Any]


def _documents(folder: Path) -> list[tuple[str, Doc]]:
    docs = []
    for path in sorted(folder.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return docs


DOCUMENTS = _documents(K8S)
APPLIED = [doc for name, doc in DOCUMENTS if not name.startswith("examples/")]


def _one(kind: str, name: str) -> Doc:
    found = [doc for _, doc in DOCUMENTS if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name} under deploy/k8s, found {len(found)}"
    return found[0]


def _pod_spec(doc: Doc) -> Doc:
    return doc["spec"]["template"]["spec"]


def _containers(doc: Doc) -> Iterator[Doc]:
    spec = _pod_spec(doc)
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def _workloads() -> list[Doc]:
    return [doc for doc in APPLIED if doc["kind"] in POD_KINDS]


def _pod_labels() -> list[tuple[Doc, dict[str, str]]]:
    return [(doc, doc["spec"]["template"]["metadata"]["labels"]) for doc in _workloads()]


def _secret_data(name: str) -> dict[str, str]:
    return _one("Secret", name)["stringData"]


def _env(container: Doc) -> dict[str, str]:
    """The environment the kubelet gives `container`: ConfigMaps, literal values with their
    $(NAME) references expanded, Secrets (from the example), downward-API fields."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env |= _one("ConfigMap", source["configMapRef"]["name"])["data"]
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], var["value"])
        elif "secretKeyRef" in (ref := var["valueFrom"]):
            env[var["name"]] = _secret_data(ref["secretKeyRef"]["name"])[ref["secretKeyRef"]["key"]]
        else:
            env[var["name"]] = FIELD_SAMPLES[ref["fieldRef"]["fieldPath"]]
    return env


def _env_names(settings_class: type[BaseSettings]) -> set[str]:
    """Every environment variable a settings class reads."""
    prefix = settings_class.model_config.get("env_prefix", "")
    names = set()
    for field_name, field in settings_class.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {choice.upper() for choice in alias.choices if isinstance(choice, str)}
        else:
            names.add(f"{prefix}{field_name}".upper())
    return names


def _referenced(container: Doc) -> set[str]:
    """Variables the container's own values or shell script use ($(NAME) or $NAME)."""
    text = " ".join(str(v.get("value", "")) for v in container.get("env", []))
    text += " " + " ".join(container.get("command", []) + container.get("args", []))
    return set(re.findall(r"\$\((\w+)\)", text)) | set(re.findall(r"\$\{?(\w+)", text))


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a connection fails the test: validation must work offline."""

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("the manifest check tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# -- the Kubernetes schemas ----------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", [doc for _, doc in DOCUMENTS], ids=[name for name, _ in DOCUMENTS])
def test_every_manifest_is_valid_for_kubernetes_offline(doc, version, no_network):
    try:
        k8s_validate(doc, version, strict=True)
    except ValidationError as exc:
        path = ".".join(str(part) for part in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} at {path}: {exc.message}")


def test_the_manifests_hold_every_part_of_a_deployment():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for doc in APPLIED}

    assert kinds >= {
        ("Namespace", NAMESPACE),
        ("ConfigMap", "hybridtrain-config"),
        ("Deployment", "hybridtrain-control-plane"), ("Service", "hybridtrain-control-plane"),
        ("Job", "hybridtrain-migrate"),
        ("StatefulSet", "postgres"), ("Service", "postgres"),
        ("StatefulSet", "redis"), ("Service", "redis"),
        ("DaemonSet", "hybridtrain-agent"),
    }
    assert all(doc["metadata"].get("namespace") == NAMESPACE for doc in APPLIED if doc["kind"] != "Namespace")


# -- images ---------------------------------------------------------------------------------------


def test_every_image_is_the_projects_release_or_a_pinned_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

    for doc in _workloads():
        for container in _containers(doc):
            image = container["image"]
            where = f"{doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            if "@sha256:" in image:
                continue  # pinned by digest
            name, sep, tag = image.rpartition(":")
            if not sep or "/" in tag:  # `registry:5000/name` has no tag
                name, tag = image, ""
            assert tag and tag != "latest", f"{where}: image {image} has no pinned tag"
            if name.rsplit("/", 1)[-1] == "hybridtrain":
                assert tag == version, f"{where}: the project's image should be tagged {version}"
            else:
                assert re.match(r"^\d+\.\d+", tag), f"{where}: image {image} is not pinned to a version"


# -- the settings the code reads -------------------------------------------------------------------


def test_the_control_plane_gets_every_setting_it_needs_under_names_it_reads(clean_environ):
    container = _pod_spec(_one("Deployment", "hybridtrain-control-plane"))["containers"][0]
    env = _env(container)

    unknown = set(env) - _env_names(Settings) - _referenced(container)
    assert not unknown, f"variables the control plane never reads: {sorted(unknown)}"
    for name, value in env.items():
        clean_environ.setenv(name, value)
    settings = Settings()

    assert settings.environment == "production"
    assert settings.database_url.startswith("postgresql+psycopg://hybridtrain:")
    assert settings.database_url.endswith("@postgres:5432/hybridtrain")
    assert settings.celery_broker_url.startswith("redis://:") and settings.celery_broker_url.endswith("@redis:6379/0")
    assert settings.broker_url_for_agents == "redis://redis.hybridtrain.svc:6379/0" and settings.broker_node_users
    assert settings.public_url.startswith("https://")
    assert settings.secret_key == _secret_data("hybridtrain-secrets")["secret-key"]
    assert settings.admin_token and settings.metrics_token is not None


def test_the_migration_job_reaches_the_same_database_as_the_control_plane(clean_environ):
    job = _pod_spec(_one("Job", "hybridtrain-migrate"))["containers"][0]
    server = _pod_spec(_one("Deployment", "hybridtrain-control-plane"))["containers"][0]
    for name, value in _env(job).items():
        clean_environ.setenv(name, value)
    migrate = Settings()

    assert job["args"] == ["db", "upgrade"]
    assert migrate.environment == "production"
    assert migrate.database_url == _env(server)["HYBRIDTRAIN_DATABASE_URL"]


def _agent_command(container: Doc) -> list[str]:
    """The agent's words: its args, or the `exec hybridtrain agent ...` line of its shell script."""
    if set(container.get("command", [])) not in SHELLS:
        return container["args"]
    script = container["args"][0]
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("exec hybridtrain agent"))
    return shlex.split(line.strip().removeprefix("exec "))


def test_the_agent_reads_its_join_token_from_the_mounted_secret_of_its_node():
    container = _pod_spec(_one("DaemonSet", "hybridtrain-agent"))["containers"][0]
    script = container["args"][0]
    token_file = re.search(r'token_file="([^"]+)"', script).group(1)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}

    assert token_file == f"{mounts['join-tokens']}/${{NODE_NAME}}"
    assert "export HYBRIDTRAIN_AGENT_TOKEN" in script and "HYBRIDTRAIN_AGENT_TOKEN" in _env_names(AgentSettings)


def test_the_agent_command_line_uses_only_flags_of_hybridtrain_agent(clean_environ):
    container = _pod_spec(_one("DaemonSet", "hybridtrain-agent"))["containers"][0]
    env = _env(container)
    words = _agent_command(container)
    assert words[:2] == ["hybridtrain", "agent"]
    flags = [re.sub(r"^\$\{?(\w+)\}?$", lambda m: env[m.group(1)], word) for word in words[2:]]

    try:
        args = build_parser().parse_args(flags)
    except SystemExit:
        pytest.fail(f"`hybridtrain agent` refuses the DaemonSet's flags {flags}")
    unknown = set(env) - _env_names(AgentSettings) - _referenced(container)
    assert not unknown, f"variables the agent never reads: {sorted(unknown)}"
    for name, value in env.items():
        clean_environ.setenv(name, value)
    settings = settings_from_args(args)

    state_mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] == "state"}
    assert str(settings.state_dir) in state_mounts
    assert settings.server_url == "http://hybridtrain-control-plane.hybridtrain.svc:8000"
    assert settings.broker_url is None  # it takes its node's own from the control plane
    assert settings.advertise_address == FIELD_SAMPLES["status.hostIP"]
    # The join token travels in the environment, never on the command line.
    assert "--token" not in flags


def test_the_agent_pod_holds_no_broker_secret():
    container = _pod_spec(_one("DaemonSet", "hybridtrain-agent"))["containers"][0]
    keys = {item["valueFrom"]["secretKeyRef"]["key"] for item in container["env"]
            if "secretKeyRef" in item.get("valueFrom", {})}
    assert "redis-password" not in keys and not {"CELERY_BROKER_URL", "HYBRIDTRAIN_AGENT_BROKER_URL"} & set(_env(container))


def test_the_agent_runs_on_gpu_nodes_with_their_gpus_and_the_host_network():
    spec = _pod_spec(_one("DaemonSet", "hybridtrain-agent"))
    agent = spec["containers"][0]

    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["nodeSelector"]
    assert int(agent["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    state = next(v for v in spec["volumes"] if v["name"] == "state")
    assert state["hostPath"]["path"].startswith("/var/lib/")


def test_the_control_plane_probes_ask_its_health_endpoint():
    container = _pod_spec(_one("Deployment", "hybridtrain-control-plane"))["containers"][0]
    ports = {p["name"] for p in container["ports"]}
    health_paths = {route.path for route in health_router.routes}

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in health_paths and get["port"] in ports, probe


# -- references between the manifests ---------------------------------------------------------------


def test_every_service_selects_pods_that_exist_on_ports_they_open():
    for service in (doc for doc in APPLIED if doc["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [doc for doc, labels in _pod_labels() if selector.items() <= labels.items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod: {selector}"
        open_ports = {p["name"] for doc in pods for c in _containers(doc) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in open_ports, f"Service {service['metadata']['name']}: {port}"


def test_every_statefulset_names_its_service_and_every_policy_selects_pods():
    services = {doc["metadata"]["name"] for doc in APPLIED if doc["kind"] == "Service"}
    for doc in (d for d in APPLIED if d["kind"] == "StatefulSet"):
        assert doc["spec"]["serviceName"] in services
    for policy in (d for d in APPLIED if d["kind"] == "NetworkPolicy"):
        selectors = [policy["spec"]["podSelector"]] + [
            peer["podSelector"] for rule in policy["spec"].get("ingress", []) for peer in rule["from"]
        ]
        for selector in selectors:
            wanted = selector["matchLabels"].items()
            assert any(wanted <= labels.items() for _, labels in _pod_labels()), selector


def test_every_secret_and_configmap_a_pod_reads_has_the_keys_it_reads():
    for doc in _workloads():
        for container in _containers(doc):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in _secret_data(ref["name"]), (doc["metadata"]["name"], ref)
            for source in container.get("envFrom", []):
                _one("ConfigMap", source["configMapRef"]["name"])
        for volume in _pod_spec(doc).get("volumes", []):
            if "secret" in volume:
                _one("Secret", volume["secret"]["secretName"])
