"""GPU utilisation and memory through NVML in the agent's heartbeats, where there is a driver."""

from __future__ import annotations

import ctypes.util
from typing import Any

from agents.agent import Agent
from agents.config import AgentSettings
from agents.gpu_usage import GpuUsage
from app.schemas.agent import Heartbeat

HAS_DRIVER = ctypes.util.find_library("nvidia-ml") is not None


def test_gpu_usage_reads_what_this_machine_has():
    # One specification for either machine, so that it never skips: without a driver there is
    # nothing to read and the reason names NVML; with one, every GPU within its bounds.
    usage = GpuUsage()
    readings = usage.read()
    if not HAS_DRIVER or readings is None:
        assert readings is None and usage.read() is None
        assert "NVML" in usage.unavailable_reason
        return
    assert readings, "a driver but no GPU read"
    for gpu in readings:
        assert 0 <= gpu["utilization"] <= 1 and 0 <= gpu["memory_used_bytes"] <= gpu["memory_total_bytes"]
    Heartbeat(gpus=readings)  # what the control plane accepts


class _OneGpu(GpuUsage):
    """What NVML reads on a machine with one busy T4: the heartbeat plumbing, on any machine."""

    def read(self) -> list[dict[str, Any]] | None:
        return [{"index": 0, "name": "Tesla T4", "utilization": 0.5, "memory_used_bytes": 1, "memory_total_bytes": 2}]


def test_the_heartbeat_carries_the_readings_the_control_plane_accepts(tmp_path):
    agent = Agent(AgentSettings(server_url="http://127.0.0.1:9", state_dir=tmp_path), gpu_usage=_OneGpu())
    body = agent._heartbeat_body()
    assert Heartbeat.model_validate(body).gpus[0].utilization == 0.5


def test_without_readings_the_heartbeat_says_nothing_about_gpus(tmp_path):
    agent = Agent(AgentSettings(server_url="http://127.0.0.1:9", state_dir=tmp_path))
    if agent.gpu_usage.read() is None:
        assert "gpus" not in agent._heartbeat_body()
    else:
        assert agent._heartbeat_body()["gpus"]
