"""Measuring the node: free space on the tier directories, and GPUs through the agent's one NVML client.

NVML's bindings (``nvidia-ml-py``, import name ``pynvml``) are a core dependency, so every install can
sample GPUs; on a node without an NVIDIA driver ``nvmlInit`` fails once, the sampler logs "GPU health
off" and the GPU part is absent from the heartbeat (no ``ftd_agent_gpu_*`` series) rather than
reported as zero GPUs. :class:`GpuSampler` initialises NVML once and reads, per device, utilisation,
memory, temperature and uncorrectable ECC errors; each query is guarded on its own, so one failing
query marks that query, not the whole node. XIDs are events, not state: the sampler registers for
critical XID events once and :meth:`GpuSampler.drain_xids` hands over what arrived since (the health
monitor latches them until an operator clears them).

``$FTD_NVML_MODULE`` names a module to use instead of ``pynvml``: a test hook only (a fake NVML for
agents started by the tests), like ``$FTD_FAILPOINTS``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .health_rules import DiskMeasurement, GpuDevice, GpuMeasurement, Measurements, ProbeResult

log = logging.getLogger("ftd.agent.health")
NVML_MODULE_ENV = "FTD_NVML_MODULE"

# NVML constants (nvml.h), so that a fake NVML needs only the functions.
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_EVENT_XID_CRITICAL = 0x8
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_TIMEOUT = 10


def measure_disks(paths: Mapping[str, Path | str]) -> dict[str, DiskMeasurement]:
    """Free and total bytes of each tier's filesystem; a path that cannot be measured says why."""
    out: dict[str, DiskMeasurement] = {}
    for tier, path in paths.items():
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            out[tier] = DiskMeasurement(str(path), error=f"cannot measure {path}: {exc.strerror or exc}")
            continue
        out[tier] = DiskMeasurement(str(path), usage.free, usage.total)
    return out


def load_nvml() -> tuple[Any, str]:
    """The NVML module (``pynvml``, or ``$FTD_NVML_MODULE``) and "", or ``None`` and why not."""
    name = os.environ.get(NVML_MODULE_ENV) or "pynvml"
    try:
        return importlib.import_module(name), ""
    except ImportError:
        return None, f"NVML not installed ({name} cannot be imported)"


def _not_supported(exc: BaseException) -> bool:
    return getattr(exc, "value", None) == _NVML_ERROR_NOT_SUPPORTED or "NotSupported" in type(exc).__name__


def _timed_out(exc: BaseException) -> bool:
    return getattr(exc, "value", None) == _NVML_ERROR_TIMEOUT or "Timeout" in type(exc).__name__


def _nvml_call(errors: list[str], what: str, nv: Any, function: str, *args: Any) -> Any:
    """One guarded NVML query: unsupported (by the device, or by these bindings) is "unknown" (None),
    any other failure is recorded in ``errors``."""
    try:
        fn = getattr(nv, function)
    except AttributeError:
        return None
    try:
        return fn(*args)
    except Exception as exc:
        if not _not_supported(exc):
            errors.append(f"{what}: {exc}")
        return None


@dataclass(frozen=True)
class XidEvent:
    xid: int
    gpu: int = -1  # the device's NVML index; -1: unknown


class GpuSampler:
    """The agent's one NVML client: initialised once, queried by one thread (the health monitor's: a
    hung query holds only that thread). ``available`` is False when the library or the driver is
    missing (``reason`` says which); ``xid_reason`` says why XID events are not watched ("" when they are)."""

    def __init__(self, nvml: Any = None) -> None:
        self._nvml, self.reason = (nvml, "") if nvml is not None else load_nvml()
        self.xid_reason = ""
        self._events: Any = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlInit()
            except Exception as exc:  # NVMLError without a driver
                self.reason, self._nvml = f"NVML init failed (no driver?): {exc}", None
        if self._nvml is None:
            log.info("GPU health off: %s", self.reason)
            self.xid_reason = self.reason
            return
        self._register_xids()

    def _register_xids(self) -> None:
        """NVML cannot tell an XID that happened before the registration (the kernel log keeps
        those, ``NVRM: Xid``)."""
        nv = self._nvml
        try:
            event_set = nv.nvmlEventSetCreate()
            registered = 0
            for i in range(nv.nvmlDeviceGetCount()):
                try:
                    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(i), _NVML_EVENT_XID_CRITICAL, event_set)
                    registered += 1
                except Exception as exc:
                    if not _not_supported(exc):
                        raise
            self._events = event_set
            if not registered:
                self.xid_reason = "no GPU supports XID events"
        except Exception as exc:
            self.xid_reason = f"XID events unavailable: {exc}"
            self._events = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    @property
    def watches_xids(self) -> bool:
        return self._events is not None

    def drain_xids(self, max_events: int = 256) -> tuple[XidEvent, ...]:
        """The critical XIDs that arrived since the last drain (at most ``max_events``; never waits)."""
        if self._events is None:
            return ()
        nv, out = self._nvml, []
        for _ in range(max_events):
            try:
                data = nv.nvmlEventSetWait(self._events, 0)
            except Exception as exc:
                if not _timed_out(exc):
                    self.xid_reason = f"XID event wait failed: {exc}"
                break
            device = getattr(data, "device", None)
            gpu = _nvml_call([], "index", nv, "nvmlDeviceGetIndex", device) if device is not None else None
            out.append(XidEvent(int(data.eventData), -1 if gpu is None else int(gpu)))
        return tuple(out)

    def measure(self) -> GpuMeasurement:
        """GPU count and, per device, temperature, uncorrectable ECC errors, utilisation and memory in
        use. Without NVML: an ``available=False`` record saying why. The XIDs are the caller's
        (:meth:`drain_xids`, latched by the health monitor)."""
        if self._nvml is None:
            return GpuMeasurement(unavailable_reason=self.reason)
        nv, errors, devices = self._nvml, list[str](), list[GpuDevice]()
        count = _nvml_call(errors, "device count", nv, "nvmlDeviceGetCount")
        for i in range(int(count or 0)):
            handle = _nvml_call(errors, f"gpu{i} handle", nv, "nvmlDeviceGetHandleByIndex", i)
            if handle is None:
                devices.append(GpuDevice(i))
                continue
            temp = _nvml_call(errors, f"gpu{i} temperature", nv, "nvmlDeviceGetTemperature", handle,
                              _NVML_TEMPERATURE_GPU)
            ecc = _nvml_call(errors, f"gpu{i} ECC", nv, "nvmlDeviceGetTotalEccErrors", handle,
                             _NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_VOLATILE_ECC)
            util = _nvml_call(errors, f"gpu{i} utilization", nv, "nvmlDeviceGetUtilizationRates", handle)
            mem = _nvml_call(errors, f"gpu{i} memory", nv, "nvmlDeviceGetMemoryInfo", handle)
            devices.append(GpuDevice(i, None if temp is None else float(temp), None if ecc is None else int(ecc),
                                     None if util is None else float(util.gpu), None if mem is None else int(mem.used)))
        return GpuMeasurement(True, int(count or 0), tuple(devices), (), tuple(errors))

    def close(self) -> None:
        """Frees the event set and shuts NVML down; only once no query runs (the monitor's thread ended)."""
        if self._nvml is None:
            return
        with contextlib.suppress(Exception):
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        self._events = None
        self._nvml = None


def measure(tiers: Mapping[str, Path | str], gpus: GpuSampler | None = None, probe: ProbeResult | None = None,
            now_unix: float | None = None) -> Measurements:
    """Everything local in one record, once (``ftd.agent.health_probe check``; the agent's monitor
    measures part by part). The probe, which needs a peer, is passed in when run."""
    sampler = gpus or GpuSampler()
    try:
        gpu = sampler.measure()
        xids = tuple(e.xid for e in sampler.drain_xids())
    finally:
        if gpus is None:
            sampler.close()
    taken = time.time() if now_unix is None else now_unix
    return Measurements(measure_disks(tiers), replace(gpu, xids=xids), probe, taken)
