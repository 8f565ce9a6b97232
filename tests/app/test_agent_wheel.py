"""GET /dist/<wheel>: the control plane hands out its own wheel for the node page's install line."""

from __future__ import annotations

import email
import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.agent_wheel import AgentWheel, source_tree
from app.api.routes.dist import get_agent_wheel
from app.main import create_app
from app.web.routes.nodes import install_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> AgentWheel:
    """One wheel built from this tree for the module (a build takes a few seconds)."""
    wheel = AgentWheel(None, source_tree())
    wheel.content()
    return wheel


@pytest.fixture
def serving(client: TestClient) -> Callable[[AgentWheel], TestClient]:
    """The test app, handing out a given wheel."""

    def _serve(wheel: AgentWheel) -> TestClient:
        client.app.dependency_overrides[get_agent_wheel] = lambda: wheel
        return client

    yield _serve
    client.app.dependency_overrides.pop(get_agent_wheel, None)


def _metadata(content: bytes) -> tuple[list[str], email.message.Message]:
    archive = zipfile.ZipFile(io.BytesIO(content))
    names = archive.namelist()
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    return names, email.message_from_bytes(archive.read(metadata))


def test_the_source_tree_is_found_from_the_running_code():
    assert source_tree() == ROOT


def test_the_served_wheel_holds_the_agent_and_the_trainer_with_the_agent_extra(
    serving: Callable[[AgentWheel], TestClient], built: AgentWheel
):
    response = serving(built).get(f"/dist/{built.filename}", headers={"Authorization": ""})
    assert response.status_code == 200
    names, metadata = _metadata(response.content)
    assert metadata["Name"] == "hybridtrain"
    assert {"agents/cli.py", "trainer/ps.py", "app/cli/__init__.py", "app/cli/__main__.py",
            "app/perfmodel/predict.py", "bench/paper/paperbench.py"} <= set(names)
    assert not any(name.startswith("tests/") for name in names)
    assert "agent" in metadata.get_all("Provides-Extra")
    assert any(req.startswith("torch==") and 'extra == "agent"' in req for req in metadata.get_all("Requires-Dist"))


def test_building_leaves_the_source_tree_as_it_was(built: AgentWheel):
    assert not (ROOT / "build").exists()
    assert not (ROOT / "dist").exists()


def test_a_wrong_file_name_gets_404_naming_the_right_one(serving: Callable[[AgentWheel], TestClient], built: AgentWheel):
    response = serving(built).get("/dist/hybridtrain-9.9.9-py3-none-any.whl")
    assert response.status_code == 404
    assert f"/dist/{built.filename}" in response.json()["detail"]


def test_a_given_wheel_is_served_under_its_own_name(serving: Callable[[AgentWheel], TestClient], tmp_path: Path):
    given = tmp_path / "hybridtrain-1.2.3-py3-none-any.whl"
    given.write_bytes(b"PK\x05\x06" + bytes(18))
    response = serving(AgentWheel(given, None)).get(f"/dist/{given.name}")
    assert response.status_code == 200 and response.content == given.read_bytes()


def test_without_a_source_tree_or_a_given_wheel_the_answer_says_what_to_set(
    serving: Callable[[AgentWheel], TestClient]
):
    wheel = AgentWheel(None, None)
    response = serving(wheel).get(f"/dist/{wheel.filename}")
    assert response.status_code == 503
    assert "HYBRIDTRAIN_AGENT_WHEEL" in response.json()["detail"]


def test_the_app_builds_from_its_settings(settings):
    app = create_app(settings.model_copy(update={"agent_wheel": Path("/x/hybridtrain-0.0.1-py3-none-any.whl")}))
    try:
        assert app.state.agent_wheel.filename == "hybridtrain-0.0.1-py3-none-any.whl"
    finally:
        app.state.dispatcher.close()
        app.state.engine.dispose()


def test_the_install_line_names_the_agent_extra_at_the_wheels_address():
    line = install_command("http://cp.example:8000/", "hybridtrain-0.1.0-py3-none-any.whl")
    assert line == ("python3 -m venv ~/.hybridtrain && ~/.hybridtrain/bin/pip install "
                    "'hybridtrain[agent] @ http://cp.example:8000/dist/hybridtrain-0.1.0-py3-none-any.whl'")
