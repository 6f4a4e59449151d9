"""Local health sampling: free space on the tier directories, and GPUs through NVML when present.

NVML's bindings (``nvidia-ml-py``, import name ``pynvml``) are a core dependency, so every install can
sample GPUs; on a node without an NVIDIA driver ``nvmlInit`` fails once, the probe logs "GPU health
off" and the GPU part is simply absent from the heartbeat (and no ``ftd_agent_gpu_*`` series exist)
rather than reported as zero GPUs. On a GPU node every device is sampled, one value per device, which
the daemon publishes as one ``ftd_agent_gpu_utilization_ratio{gpu="<index>"}`` series per GPU.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftd.v1 import cluster_pb2

from .health_checks import HealthReport

log = logging.getLogger("ftd.agent.health")


class GpuProbe:
    """Wraps NVML; ``available`` is False when the library or the driver is missing."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception as exc:  # ImportError, or NVMLError without a driver
            log.info("GPU health off: NVML not available (%s)", exc)

    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def nvml(self) -> Any:
        """The initialised NVML module, or ``None`` (for the health checks' GPU measurements)."""
        return self._nvml

    def sample(self) -> cluster_pb2.GpuHealth | None:
        if self._nvml is None:
            return None
        nv = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
            out = cluster_pb2.GpuHealth(count=count)
            for i in range(count):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                out.utilization_pct.append(float(nv.nvmlDeviceGetUtilizationRates(handle).gpu))
                out.memory_used_bytes.append(int(nv.nvmlDeviceGetMemoryInfo(handle).used))
            return out
        except Exception as exc:
            log.warning("NVML sampling failed: %s", exc)
            return None


def disk_health(tiers: Mapping[str, Path]) -> list[cluster_pb2.DiskHealth]:
    out = []
    for tier, path in tiers.items():
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            log.warning("cannot stat tier %s at %s: %s", tier, path, exc)
            continue
        out.append(cluster_pb2.DiskHealth(tier=tier, path=str(path), free_bytes=usage.free,
                                          total_bytes=usage.total))
    return out


def verdict_proto(report: HealthReport) -> cluster_pb2.HealthVerdict:
    """The health checks' report as it travels in heartbeats and ``CheckHealth`` answers."""
    verdict = cluster_pb2.HealthVerdict(healthy=report.healthy, reason="" if report.healthy else report.reason,
                                        checked_unix_s=report.checked_unix_s)
    for check in report.checks:
        entry = verdict.checks.add(name=check.name, ok=check.ok, reason=check.reason)
        if check.value is not None:
            entry.value = check.value
        if check.threshold is not None:
            entry.threshold = check.threshold
    return verdict


def sample(tiers: Mapping[str, Path], gpu: GpuProbe) -> cluster_pb2.Health:
    health = cluster_pb2.Health(disks=disk_health(tiers))
    gpus = gpu.sample()
    if gpus is not None:
        health.gpu.CopyFrom(gpus)
    return health
