"""Where a role's reports go: URLs rebased onto the agent's control plane, and the spool."""

from __future__ import annotations

from agents.outbox import REPORT
from agents.reports import rebase_url, spool_messages


def test_rebase_url_keeps_the_path_and_takes_scheme_host_and_port_from_the_server():
    assert rebase_url("http://localhost:8000/api/v1/runs/3/metrics?x=1", "https://cp.example:8443") == (
        "https://cp.example:8443/api/v1/runs/3/metrics?x=1")


def test_rebase_url_keeps_a_servers_path_prefix():
    assert rebase_url("http://localhost:8000/api/v1/runs/3/metrics", "https://gw.example/hybridtrain") == (
        "https://gw.example/hybridtrain/api/v1/runs/3/metrics")
    assert rebase_url("http://localhost:8000/hybridtrain/api/v1/runs/3/metrics", "https://gw.example/hybridtrain") == (
        "https://gw.example/hybridtrain/api/v1/runs/3/metrics")


def test_spool_messages_skip_a_torn_line_and_batch_by_500(tmp_path):
    spool = tmp_path / "report-spool.jsonl"
    spool.write_text("".join(f'{{"seq": {i}}}\n' for i in range(501)) + '{"seq": ')

    messages = spool_messages(spool, run_id=4)

    assert [len(m.body["records"]) for m in messages] == [500, 1]
    assert {(m.kind, m.run_id) for m in messages} == {(REPORT, 4)}


def test_spool_messages_of_a_missing_spool_are_none(tmp_path):
    assert spool_messages(tmp_path / "none.jsonl", run_id=4) == []


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
