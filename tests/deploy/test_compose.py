"""docker-compose.yml read as Compose reads it, with .env.example's values: the settings each
service ends up with (Docker is not needed, nor reached)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.cli import build_parser, settings_from_args
from app.config import Settings

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def _dotenv(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$, over strings in lists and maps."""
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        found = env.get(name, "")
        if match.group(2) in (":-", "-") and not found:
            return _interpolate(match.group(3), env)
        if match.group(2) in (":?", "?") and not found:
            pytest.fail(f"compose refuses to start without {name}: {match.group(3)}")
        return found

    return VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return _interpolate(raw, _dotenv(ROOT / ".env.example"))["services"]


def test_the_control_plane_hands_agents_redis_by_the_services_name(services, clean_environ):
    for name, value in services["control-plane"]["environment"].items():
        clean_environ.setenv(name, str(value))
    settings = Settings()

    assert settings.celery_broker_url == "redis://:change-me-long-random@redis:6379/0"
    assert settings.broker_url_for_agents == "redis://redis:6379/0" and settings.broker_node_users


def test_redis_wants_the_control_planes_password(services):
    redis = services["redis"]
    script = shlex.split(redis["command"][-1])
    assert script[script.index("--requirepass") + 1] == "$REDIS_PASSWORD"  # expanded by its shell
    assert redis["environment"]["REDIS_PASSWORD"] == redis["environment"]["REDISCLI_AUTH"] == "change-me-long-random"


def test_the_agent_holds_no_broker_credentials_and_takes_its_nodes_own(services, clean_environ):
    agent = services["agent"]
    environment = agent.get("environment", {})
    assert not {"CELERY_BROKER_URL", "HYBRIDTRAIN_AGENT_BROKER_URL", "REDIS_PASSWORD"} & set(environment)
    for name, value in environment.items():
        clean_environ.setenv(name, str(value))
    words = agent["command"] if isinstance(agent["command"], list) else shlex.split(agent["command"])
    assert words[0] == "agent"
    settings = settings_from_args(build_parser().parse_args(words[1:]))

    assert settings.broker_url is None
    assert settings.server_url == "http://control-plane:8000"
