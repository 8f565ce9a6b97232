"""What this machine has (GPUs, CPU cores, memory) and how fast it trains a reference model.

Detection with torch and the speed measurement run in a child process
(`python -m agents.hardware --server URL --benchmark-seconds S`, one JSON object on stdout)
that exits when done: importing torch costs the importing process 700 MB or more for good,
and the agent must idle small (issue 17). `detect_in_child` is what the agent calls.

GPU names as drivers report them ("NVIDIA GeForce RTX 3090 Ti", "Tesla V100-SXM2-16GB") are
mapped to the GPU catalog's model names ("RTX 3090 Ti", "V100 SXM2"); a name that matches no
pattern is reported as the driver wrote it, so the control plane can still show it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

# Ordered: the first pattern that matches the lower-cased driver name wins, so the more
# specific names ("3090 ti", "a100 ... 80gb") come before their prefixes.
_CATALOG_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(p), model)
    for p, model in [
        (r"h200", "H200"),
        (r"h100.*pcie", "H100 PCIe"),
        (r"h100", "H100 SXM"),
        (r"a100.*80\s*gb", "A100 80GB"),
        (r"a100", "A100 40GB"),
        (r"\bl4\b", "L4"),
        (r"\ba10g?\b", "A10"),
        (r"\bt4\b", "T4"),
        (r"v100.*sxm", "V100 SXM2"),
        (r"v100", "V100 PCIe"),
        (r"rtx\s*8000", "RTX 8000"),
        (r"3090\s*ti", "RTX 3090 Ti"),
        (r"3090", "RTX 3090"),
    ]
]


def catalog_model(device_name: str, memory_gb: float | None = None) -> str:
    """The catalog model name of a GPU as its driver names it, or the name itself."""
    lowered = device_name.lower().replace("-", " ")
    for pattern, model in _CATALOG_PATTERNS:
        if pattern.search(lowered):
            # Some A100 80 GB boards report "NVIDIA A100-SXM4" without the size.
            if model == "A100 40GB" and memory_gb is not None and memory_gb > 60:
                return "A100 80GB"
            return model
    return device_name.strip()


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as detected."""

    index: int
    name: str
    model: str
    memory_gb: float


@dataclass
class Hardware:
    """The machine's inventory as the agent reports it at registration."""

    hostname: str
    cpu_cores: int
    cpu_physical_cores: int | None
    memory_gb: float
    gpus: list[GpuDevice] = field(default_factory=list)
    gpu_source: str = "none"  # torch.cuda, nvidia-smi or none
    platform: str = ""
    python: str = ""
    torch: str | None = None
    cuda: str | None = None
    benchmark: dict[str, Any] | None = None
    address: str | None = None

    def gpu_counts(self) -> list[dict[str, Any]]:
        """GPUs grouped as the node record declares them: [{model, count, memory_gb}]."""
        counts = Counter(g.model for g in self.gpus)
        memory = {g.model: g.memory_gb for g in self.gpus}
        return [
            {"model": model, "count": n, "memory_gb": memory[model]}
            for model, n in sorted(counts.items())
        ]

    def to_json(self) -> dict[str, Any]:
        """The JSON body the control plane stores as the node's detected hardware."""
        data = asdict(self)
        data["gpus"] = self.gpu_counts()
        data["devices"] = [asdict(g) for g in self.gpus]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        """The inverse of `to_json` (GPUs from its per-device list)."""
        fields = {k: data.get(k) for k in cls.__dataclass_fields__ if k in data and k != "gpus"}
        gpus = [GpuDevice(**{k: d[k] for k in GpuDevice.__dataclass_fields__}) for d in data.get("devices", [])]
        return cls(**fields, gpus=gpus)


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA kernel driver is loaded; without it CUDA sees no GPU anyway, and the
    agent skips importing torch (seconds) just to be told so."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(shutil.which("nvidia-smi"))


def _gpus_from_torch() -> tuple[list[GpuDevice], str | None] | None:
    if not nvidia_driver_present():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    devices = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        memory_gb = round(props.total_memory / 2**30, 1)
        devices.append(GpuDevice(i, props.name, catalog_model(props.name, memory_gb), memory_gb))
    return devices, torch.version.cuda


def parse_nvidia_smi(output: str) -> list[GpuDevice]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`."""
    devices = []
    for line in output.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        index, name, memory_mib = parts
        try:
            memory_gb = round(float(memory_mib) / 1024, 1)
        except ValueError:
            memory_gb = 0.0
        devices.append(GpuDevice(int(index), name, catalog_model(name, memory_gb), memory_gb))
    return devices


def _gpus_from_nvidia_smi() -> list[GpuDevice] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return None
    return parse_nvidia_smi(out)


def route_address(server_url: str | None) -> str | None:
    """The local address on the route to the control plane (no packet is sent)."""
    if not server_url:
        return None
    parts = urlsplit(server_url)
    host = parts.hostname
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            return str(sock.getsockname()[0])
    except OSError:
        return None


def detect(server_url: str | None = None, *, use_torch: bool = True) -> Hardware:
    """Detect this machine's GPUs (torch.cuda first, then nvidia-smi), CPU cores and memory."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    hw = Hardware(
        hostname=socket.gethostname(),
        cpu_cores=cores,
        cpu_physical_cores=psutil.cpu_count(logical=False),
        memory_gb=round(psutil.virtual_memory().total / 2**30, 1),
        platform=platform.platform(),
        python=platform.python_version(),
        address=route_address(server_url),
    )
    try:
        hw.torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    from_torch = _gpus_from_torch() if use_torch else None
    if from_torch is not None:
        hw.gpus, hw.cuda = from_torch
        hw.gpu_source = "torch.cuda"
    else:
        from_smi = _gpus_from_nvidia_smi()
        if from_smi:
            hw.gpus = from_smi
            hw.gpu_source = "nvidia-smi"
    return hw


REFERENCE_MODEL = "ref-cnn-32x32"
REFERENCE_BATCH = 32


def measure_samples_per_s(seconds: float, *, device: str | None = None) -> dict[str, Any]:
    """Train a small fixed CNN on random 32x32 images for about `seconds`; report samples/s.

    Not a substitute for the catalog's FLOPs, but comparable across nodes: same model, batch
    and optimiser everywhere, on the first GPU when there is one.
    """
    import torch
    from torch import nn

    dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(REFERENCE_BATCH, 3, 32, 32, generator=gen).to(dev)
    y = torch.randint(0, 10, (REFERENCE_BATCH,), generator=gen).to(dev)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(2):  # warm-up: allocator, kernels, thread pool
        step()
    sync()
    steps = 0
    start = time.perf_counter()
    while True:
        step()
        steps += 1
        if steps % 2 == 0:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return {
        "model": REFERENCE_MODEL,
        "batch": REFERENCE_BATCH,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "steps": steps,
        "seconds": round(elapsed, 3),
        "samples_per_s": round(steps * REFERENCE_BATCH / elapsed, 2),
    }


def detect_in_child(
    server_url: str | None, *, benchmark_seconds: float, timeout_s: float = 120.0,
) -> Hardware:
    """Detect (and measure) in a child process that exits, so this one never imports torch.

    When the child fails (no torch, a broken driver, past `timeout_s` plus the measurement),
    what this process sees without torch is returned (nvidia-smi, CPU, memory), with a warning.
    """
    argv = [sys.executable, "-m", "agents.hardware", "--benchmark-seconds", str(benchmark_seconds)]
    if server_url:
        argv += ["--server", server_url]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s + benchmark_seconds,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode == 0:
            return Hardware.from_json(json.loads(done.stdout.strip().splitlines()[-1]))
        why = f"exited with code {done.returncode}: {done.stderr.strip()[-500:]}"
    except subprocess.TimeoutExpired:
        why = f"took longer than {timeout_s + benchmark_seconds:.0f} s"
    except (OSError, ValueError, IndexError, TypeError) as exc:
        why = repr(exc)
    log.warning("hardware detection in a child process failed (%s); detecting without torch", why)
    return detect(server_url, use_torch=False)


def main(argv: list[str] | None = None) -> int:
    """`python -m agents.hardware`: print this machine's hardware (and speed) as JSON."""
    parser = argparse.ArgumentParser(prog="python -m agents.hardware")
    parser.add_argument("--server", default=None, help="control plane URL (finds the route address)")
    parser.add_argument("--benchmark-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    hw = detect(args.server)
    if args.benchmark_seconds > 0:
        try:
            hw.benchmark = measure_samples_per_s(args.benchmark_seconds)
        except ImportError as exc:
            print(f"no torch here, so no speed measurement: {exc}", file=sys.stderr)
    print(json.dumps(hw.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
