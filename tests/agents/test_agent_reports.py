"""Where a role's reports go: URLs rebased onto the agent's control plane, and what its trainer
did not deliver (the spool; the metrics file after a crash)."""

from __future__ import annotations

import json
from pathlib import Path

from agents.outbox import REPORT
from agents.reports import metrics_file, rebase_url, undelivered_messages


def test_rebase_url_keeps_the_path_and_takes_scheme_host_and_port_from_the_server():
    assert rebase_url("http://localhost:8000/api/v1/runs/3/metrics?x=1", "https://cp.example:8443") == (
        "https://cp.example:8443/api/v1/runs/3/metrics?x=1")


def test_rebase_url_keeps_a_servers_path_prefix():
    assert rebase_url("http://localhost:8000/api/v1/runs/3/metrics", "https://gw.example/hybridtrain") == (
        "https://gw.example/hybridtrain/api/v1/runs/3/metrics")
    assert rebase_url("http://localhost:8000/hybridtrain/api/v1/runs/3/metrics", "https://gw.example/hybridtrain") == (
        "https://gw.example/hybridtrain/api/v1/runs/3/metrics")


def test_a_spool_is_delivered_without_its_torn_line_in_batches_of_500(tmp_path):
    spool = tmp_path / "report-spool.jsonl"
    spool.write_text("".join(f'{{"seq": {i}}}\n' for i in range(501)) + '{"seq": ')

    messages = undelivered_messages(run_id=4, rank=1, spool=spool, metrics=None, metrics_from=0, clean=True)

    assert [len(m.body["records"]) for m in messages] == [500, 1]
    assert {(m.kind, m.run_id) for m in messages} == {(REPORT, 4)}


def test_a_missing_spool_delivers_nothing(tmp_path):
    assert undelivered_messages(run_id=4, rank=1, spool=tmp_path / "none.jsonl", metrics=None, metrics_from=0,
                                clean=True) == []


def _lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_crashed_roles_undelivered_records_are_its_spool_and_its_own_records_in_the_file_once(tmp_path):
    spool = tmp_path / "spool.jsonl"
    spool.write_text(_lines({"rank": 1, "stream": "s", "seq": 5}))
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_lines({"rank": 1, "stream": "s", "seq": 4}, {"rank": 1, "stream": "s", "seq": 5},
                              {"rank": 2, "stream": "t", "seq": 0}) + '{"rank": 1, "str')

    messages = undelivered_messages(run_id=4, rank=1, spool=spool, metrics=metrics, metrics_from=0, clean=False)

    assert [(r["stream"], r["seq"]) for m in messages for r in m.body["records"]] == [("s", 5), ("s", 4)]


def test_a_metrics_file_is_read_from_the_roles_launch_on(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    before = _lines({"rank": 1, "stream": "old", "seq": 0})
    metrics.write_text(before + _lines({"rank": 1, "stream": "new", "seq": 0}))

    messages = undelivered_messages(run_id=4, rank=1, spool=None, metrics=metrics, metrics_from=len(before),
                                    clean=False)

    assert [r["stream"] for m in messages for r in m.body["records"]] == ["new"]


def test_a_clean_exit_delivers_only_the_spool(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(_lines({"rank": 1, "stream": "s", "seq": 0}))

    assert undelivered_messages(run_id=4, rank=1, spool=None, metrics=metrics, metrics_from=0, clean=True) == []


def test_a_roles_metrics_file_is_in_its_rank_directory_unless_the_order_gives_an_absolute_path(tmp_path):
    assert metrics_file({"metrics-out": "metrics.jsonl"}, tmp_path) == tmp_path / "metrics.jsonl"
    assert metrics_file({"metrics_out": "sub/m.jsonl"}, tmp_path) == tmp_path / "m.jsonl"
    assert metrics_file({}, tmp_path) == tmp_path / "metrics.jsonl"
    assert metrics_file({"metrics-out": "/data/m.jsonl"}, tmp_path) == Path("/data/m.jsonl")


def test_the_client_delivers_spooled_records_with_the_agents_own_token(control_plane):
    from agents.client import ControlPlaneClient

    client = ControlPlaneClient(control_plane.url, agent_token="hta_agent", timeout_s=5)
    try:
        client.register(join_token=control_plane.JOIN_TOKEN, agent_token="hta_agent", hardware={"hostname": "n1"})
        answer = client.reports(5, {"records": [{"seq": 0}, {"seq": 1}]})
    finally:
        client.close()

    assert answer["stored"] == 2
    assert control_plane.reports == [(5, None, {"records": [{"seq": 0}, {"seq": 1}]})]
