"""GPU utilisation and memory read through NVML for the agent's heartbeats, where there is an
NVIDIA driver; without one (a CPU machine, a container without the device) there is nothing to
read and the heartbeat says nothing about GPUs. NVML is a C library behind ctypes: it costs the
agent a few MB, not torch's 700 (agents/hardware.py)."""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class GpuUsage:
    """Reads each GPU's utilisation and memory; NVML is initialised at the first read and, when
    it cannot be, never tried again (the reason is logged once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._available: bool | None = None
        self.unavailable_reason: str | None = None

    def read(self) -> list[dict[str, Any]] | None:
        """One reading per GPU ({index, name, utilization, memory_used_bytes,
        memory_total_bytes}, utilization in 0..1), or None where NVML has no GPU to read."""
        with self._lock:
            if self._available is None:
                self._available = self._start()
            if not self._available:
                return None
            import pynvml

            readings = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                try:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                    rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
                    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                    name = pynvml.nvmlDeviceGetName(handle)
                except pynvml.NVMLError as exc:
                    # One GPU gone (fallen off the bus, reset) must not hide the others.
                    log.warning("NVML cannot read GPU %d: %s", index, exc)
                    continue
                readings.append({
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "utilization": rates.gpu / 100.0,
                    "memory_used_bytes": int(memory.used),
                    "memory_total_bytes": int(memory.total),
                })
            return readings

    def _start(self) -> bool:
        try:
            import pynvml
        except ImportError:
            self.unavailable_reason = "nvidia-ml-py is not installed"
        else:
            try:
                pynvml.nvmlInit()
                if pynvml.nvmlDeviceGetCount() > 0:
                    return True
                self.unavailable_reason = "NVML sees no GPU"
            except pynvml.NVMLError as exc:
                self.unavailable_reason = f"NVML: {exc}"
        log.info("no GPU utilisation in heartbeats (%s)", self.unavailable_reason)
        return False
