"""What `hybridtrain local` (`make run`) says about letting a second machine join, from the same
sentences as the node page (app/join_reach.py)."""

from __future__ import annotations

import pytest

from app.cli.local import join_hint
from app.config import Settings
from app.join_reach import is_local_only, join_obstacles


def _settings(**fields: str) -> Settings:
    with pytest.warns(UserWarning, match="example HYBRIDTRAIN_SECRET_KEY"):
        return Settings(**fields)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000",
                                 "http://127.0.1.1:8000", "redis+socket:///run/redis.sock"])
def test_loopback_addresses_are_local_only(url):
    assert is_local_only(url)


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "https://cp.example.org", "redis://cp:6379/0"])
def test_other_addresses_are_not(url):
    assert not is_local_only(url)


def test_make_run_on_its_defaults_says_what_to_set_for_a_second_machine():
    hint = join_hint(_settings(public_url="http://127.0.0.1:8000"), bind_host="127.0.0.1", port=8000)
    lines = hint.splitlines()
    assert lines[0] == ("hybridtrain local: a second machine cannot join yet "
                        "(the Nodes page's lines would fail there):")
    assert "set HYBRIDTRAIN_PUBLIC_URL" in lines[1] and "make run HOST=0.0.0.0" in lines[1]
    assert "embedded SQLite broker" in lines[2] and "CELERY_BROKER_URL=redis://ADDRESS:6379/0" in lines[2]
    assert lines[3].startswith("  e.g. HYBRIDTRAIN_PUBLIC_URL=http://ADDRESS:8000 "
                               "CELERY_BROKER_URL=redis://ADDRESS:6379/0 make run HOST=0.0.0.0")


def test_a_public_url_served_on_loopback_only_is_caught():
    obstacles = join_obstacles(public_url="http://10.0.0.5:8000", agent_broker_url="redis://10.0.0.5:6379/0",
                               bind_host="127.0.0.1")
    assert obstacles == ["The control plane serves on 127.0.0.1 only, so http://10.0.0.5:8000 does not answer "
                         "other machines: serve on all addresses (`make run HOST=0.0.0.0`)."]


def test_agents_handed_a_broker_elsewhere_clear_a_loopback_celery_broker():
    assert join_obstacles(public_url="http://10.0.0.5:8000", agent_broker_url="redis://10.0.0.5:6379/0",
                          bind_host="0.0.0.0") == []


def test_a_reachable_setup_says_where_machines_join():
    settings = _settings(public_url="http://10.0.0.5:8000", CELERY_BROKER_URL="redis://127.0.0.1:6379/0",
                         broker_url_for_agents="redis://10.0.0.5:6379/0")
    assert join_hint(settings, bind_host="0.0.0.0", port=8000) == (
        "hybridtrain local: other machines join http://10.0.0.5:8000: declare a node on the Nodes page "
        "and run the two lines it shows on that machine")


def test_local_serves_with_the_public_url_that_was_set_and_else_its_own(monkeypatch):
    from app.cli.local import local_settings

    monkeypatch.setenv("HYBRIDTRAIN_PUBLIC_URL", "http://10.0.0.5:8000")
    assert local_settings(_settings(), "http://127.0.0.1:8000").public_url == "http://10.0.0.5:8000"
    monkeypatch.delenv("HYBRIDTRAIN_PUBLIC_URL")
    assert local_settings(_settings(), "http://127.0.0.1:9000").public_url == "http://127.0.0.1:9000"


def test_the_example_keeps_a_port_other_than_makes_default():
    hint = join_hint(_settings(public_url="http://127.0.0.1:8765"), bind_host="127.0.0.1", port=8765)
    assert "make run HOST=0.0.0.0 PORT=8765 " in hint.splitlines()[-1]
