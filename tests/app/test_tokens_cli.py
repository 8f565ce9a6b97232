"""`hybridtrain tokens create|list|delete` on the control plane's host: expiry and actions
set from the command line, shown in the list, and revocation."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.cli.token_commands import parse_duration
from app.config import Settings
from app.main import create_app

REPO = Path(__file__).resolve().parents[2]
HYBRIDTRAIN = str(Path(sys.executable).with_name("hybridtrain"))

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def hybridtrain(tmp_path: Path) -> Run:
    """The `hybridtrain` command in a fresh folder whose SQLite database is migrated."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "HYBRIDTRAIN_DATABASE_URL")}
    env |= {"PYTHONPATH": str(REPO)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([HYBRIDTRAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True)

    assert run("db", "upgrade").returncode == 0
    return run


def _client(tmp_path: Path, secret: str) -> TestClient:
    settings = Settings(DATABASE_URL=f"sqlite+pysqlite:///{tmp_path}/var/hybridtrain.db")
    return TestClient(create_app(settings), headers={"Authorization": f"Bearer {secret}"})


def test_tokens_create_sets_expiry_and_actions(hybridtrain: Run, tmp_path: Path) -> None:
    created = hybridtrain("tokens", "create", "--name", "ci", "--scope", "ci",
                          "--expires-in", "30d", "--action", "runs:create")
    assert created.returncode == 0, created.stderr
    assert "limited to runs:create" in created.stderr
    client = _client(tmp_path, created.stdout.strip())
    assert client.get("/api/v1/runs").status_code == 200
    denied = client.post("/api/v1/runs/1/cancel")
    assert denied.status_code == 403 and "runs:cancel" in denied.json()["detail"]
    listed = hybridtrain("tokens", "list").stdout
    expiry = (datetime.now(UTC) + timedelta(days=30)).strftime("%Y-%m-%d")
    assert "ci" in listed and expiry in listed and "runs:create" in listed


def test_tokens_create_refuses_a_malformed_duration_naming_the_option(hybridtrain: Run) -> None:
    created = hybridtrain("tokens", "create", "--name", "x", "--scope", "read", "--expires-in", "30 days")
    assert created.returncode == 2
    assert "invalid --expires-in: '30 days' is not a duration such as 30d, 12h or 2w" in created.stderr


def test_tokens_delete_revokes_the_token(hybridtrain: Run, tmp_path: Path) -> None:
    secret = hybridtrain("tokens", "create", "--name", "gone", "--scope", "read").stdout.strip()
    token_id = next(line.split()[0] for line in hybridtrain("tokens", "list").stdout.splitlines()
                    if " gone " in line)
    assert hybridtrain("tokens", "delete", token_id).returncode == 0
    assert _client(tmp_path, secret).get("/api/v1/sites").status_code == 401


@pytest.mark.parametrize(("text", "expected"), [
    ("30d", timedelta(days=30)), ("12h", timedelta(hours=12)), ("2w", timedelta(weeks=2)),
])
def test_parse_duration_reads_hours_days_and_weeks(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["0d", "30", "d", "1y", "-1d"])
def test_parse_duration_refuses_other_forms(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)
