"""Node health checks at admission and before promotion: disks, GPUs, and the network to a peer.

A spare that cannot hold a rank must not be handed one: a full checkpoint tier, a GPU that fell off
the bus, an uncorrectable ECC error or a slow link turn a recovery into a second failure. Measuring
and judging are kept apart. :func:`measure_disks`, :func:`measure_gpus` and :func:`probe_peer` fill
a :class:`Measurements` record; :func:`evaluate` is a pure function of ``(measurements,
thresholds)`` returning a :class:`HealthReport` whose ``reason`` names the first failing check
("ssd free 1.2 GiB < 10 GiB"), so every decision is testable by building a record.

GPUs are read through NVML (``pip install ftd[gpu]``) when present; each NVML call is guarded on its
own, so one failing query marks that query, not the whole node, and a node without NVML simply has
no GPU checks unless GPUs are expected. XIDs are events, not state: an :class:`XidMonitor` registers
for critical XID events once and each measurement drains what arrived since.

The network probe is a short all-reduce between this node and a peer (gloo on CPU; NCCL where GPUs
exist): the median latency of a one-float all-reduce and the bus bandwidth of a 16 MiB one. It runs
as ``python -m ftd.agent.health_checks probe --rank R --master HOST:PORT ...`` in a subprocess,
bounded by a timeout, printing one JSON line: the agent never imports torch in its own process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ftd.settings import require, setting

MiB = 1 << 20
DEFAULT_PROBE_BYTES = 16 * MiB
DEFAULT_LATENCY_ITERS = 20
# XIDs an application causes without the GPU being at fault: 13 graphics engine exception, 31 GPU
# memory page fault, 43 GPU stopped processing (a user application fault), 45 preemptive cleanup.
DEFAULT_ALLOWED_XIDS = ("13", "31", "43", "45")

# NVML constants (nvml.h), so that a fake NVML needs only the functions.
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0
_NVML_EVENT_XID_CRITICAL = 0x8
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_TIMEOUT = 10

# ---- sizes ------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
          "p": 1000**5, "pb": 1000**5, "pib": 1 << 50}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | float | str) -> int:
    """``10GiB``, ``500MB``, ``1.5T`` (decimal unless ``iB``) or a plain number of bytes → bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value!r}")
        return int(value)
    match = _SIZE.fullmatch(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size like 10GiB or 500MB, got {value!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Binary units, one decimal at most: ``1.2 GiB``, ``10 GiB``, ``512 B``."""
    value, units = float(n), ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    step = 0
    while abs(value) >= 1024 and step < len(units) - 1:
        value /= 1024
        step += 1
    unit = units[step]
    return f"{f'{value:.1f}'.rstrip('0').rstrip('.')} {unit}"


# ---- measurements -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskMeasurement:
    path: str
    free_bytes: int = 0
    total_bytes: int = 0
    error: str = ""  # set when the path could not be measured


@dataclass(frozen=True)
class GpuDevice:
    index: int
    temperature_c: float | None = None
    ecc_uncorrectable: int | None = None  # volatile count (since driver load); None: ECC off or unsupported


@dataclass(frozen=True)
class GpuMeasurement:
    available: bool = False  # NVML loaded and initialised
    count: int = 0
    devices: tuple[GpuDevice, ...] = ()
    xids: tuple[int, ...] = ()  # critical XID events since the previous measurement
    errors: tuple[str, ...] = ()  # NVML queries that failed, e.g. "gpu1 temperature: GPU is lost"
    unavailable_reason: str = ""


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    peer: str = ""  # the rendezvous address HOST:PORT
    backend: str = ""
    rank: int = -1
    world_size: int = 0
    latency_s: float = 0.0  # median of the small all-reduces
    bandwidth_bytes_s: float = 0.0  # bus bandwidth of the large all-reduce: algbw x 2(n-1)/n
    algbw_bytes_s: float = 0.0
    bytes: int = 0
    elapsed_s: float = 0.0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ProbeResult:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


@dataclass(frozen=True)
class Measurements:
    disks: Mapping[str, DiskMeasurement] = field(default_factory=dict)  # by tier
    gpus: GpuMeasurement = GpuMeasurement()
    probe: ProbeResult | None = None  # None: no probe was run
    taken_unix: float = 0.0


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


def _load_nvml() -> tuple[Any, str]:
    try:
        import pynvml
    except ImportError:
        return None, "NVML not installed (pip install ftd[gpu])"
    return pynvml, ""


def _not_supported(exc: BaseException) -> bool:
    return getattr(exc, "value", None) == _NVML_ERROR_NOT_SUPPORTED or "NotSupported" in type(exc).__name__


def _nvml_call(errors: list[str], what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """One guarded NVML query: unsupported is "unknown" (None), any other failure is recorded."""
    try:
        return fn(*args)
    except Exception as exc:
        if not _not_supported(exc):
            errors.append(f"{what}: {exc}")
        return None


class XidMonitor:
    """Critical XID events through NVML's event API, registered once and drained per measurement
    (NVML cannot tell an XID that happened before the registration; the kernel log keeps those,
    ``NVRM: Xid``). ``available`` is False without NVML or event support."""

    def __init__(self, nvml: Any = None) -> None:
        self.reason = ""
        self._nvml, self.reason = (nvml, "") if nvml is not None else _load_nvml()
        self._set: Any = None
        if self._nvml is None:
            return
        nv = self._nvml
        try:
            nv.nvmlInit()
        except Exception as exc:
            self.reason, self._nvml = f"NVML init failed: {exc}", None
            return
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
            self._set = event_set
            if not registered:
                self.reason = "no GPU supports XID events"
        except Exception as exc:
            self.reason = f"XID events unavailable: {exc}"
            self._set = None

    @property
    def available(self) -> bool:
        return self._set is not None

    def drain(self, max_events: int = 256) -> tuple[int, ...]:
        """The XIDs that arrived since the last drain (at most ``max_events``; never waits)."""
        if self._set is None:
            return ()
        xids: list[int] = []
        for _ in range(max_events):
            try:
                data = self._nvml.nvmlEventSetWait(self._set, 0)
            except Exception as exc:
                if getattr(exc, "value", None) != _NVML_ERROR_TIMEOUT and "Timeout" not in type(exc).__name__:
                    self.reason = f"XID event wait failed: {exc}"
                break
            xids.append(int(data.eventData))
        return tuple(xids)

    def close(self) -> None:
        if self._nvml is None:
            return
        with contextlib.suppress(Exception):
            if self._set is not None:
                self._nvml.nvmlEventSetFree(self._set)
            self._nvml.nvmlShutdown()
        self._set = None
        self._nvml = None


def measure_gpus(nvml: Any = None, xids: XidMonitor | None = None) -> GpuMeasurement:
    """GPU count, temperature and uncorrectable ECC errors per device through NVML (the module, or
    any object with its functions), plus the XIDs ``xids`` collected. Without NVML: an
    ``available=False`` record saying why."""
    nv, reason = (nvml, "") if nvml is not None else _load_nvml()
    if nv is None:
        return GpuMeasurement(unavailable_reason=reason)
    try:
        nv.nvmlInit()
    except Exception as exc:
        return GpuMeasurement(unavailable_reason=f"NVML init failed (no driver?): {exc}")
    errors: list[str] = []
    devices: list[GpuDevice] = []
    try:
        count = _nvml_call(errors, "device count", nv.nvmlDeviceGetCount)
        for i in range(int(count or 0)):
            handle = _nvml_call(errors, f"gpu{i} handle", nv.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                devices.append(GpuDevice(i))
                continue
            temp = _nvml_call(errors, f"gpu{i} temperature", nv.nvmlDeviceGetTemperature, handle,
                              _NVML_TEMPERATURE_GPU)
            ecc = _nvml_call(errors, f"gpu{i} ECC", nv.nvmlDeviceGetTotalEccErrors, handle,
                             _NVML_MEMORY_ERROR_TYPE_UNCORRECTED, _NVML_VOLATILE_ECC)
            devices.append(GpuDevice(i, None if temp is None else float(temp), None if ecc is None else int(ecc)))
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()
    return GpuMeasurement(True, int(count or 0), tuple(devices), xids.drain() if xids is not None else (),
                          tuple(errors))


def measure(tiers: Mapping[str, Path | str], nvml: Any = None, xids: XidMonitor | None = None,
            probe: ProbeResult | None = None, now_unix: float | None = None) -> Measurements:
    """Everything local in one record (the probe, which needs a peer, is passed in when run)."""
    return Measurements(measure_disks(tiers), measure_gpus(nvml, xids), probe,
                        time.time() if now_unix is None else now_unix)


# ---- thresholds and the verdict ---------------------------------------------------------------


@dataclass(frozen=True)
class HealthThresholds:
    """What a node must meet to be admitted or promoted; field names are meant to be embedded in the
    agent's settings with a ``health_`` prefix."""

    min_free_bytes: dict[str, int] = setting(
        {}, "minimum free space per tier TIER=SIZE[,...], e.g. ssd=10GiB (a tier not listed is not checked)",
        "bytes")
    expected_gpus: int = setting(0, "GPUs the node must have (0: the count is not checked)", "GPUs")
    max_gpu_temp_c: float = setting(85.0, "hottest GPU allowed (0: not checked)", "°C")
    max_ecc_uncorrectable: int = setting(0, "uncorrectable ECC errors allowed per GPU since driver load "
                                            "(-1: not checked)", "errors")
    allowed_xids: tuple[str, ...] = setting(DEFAULT_ALLOWED_XIDS, "XID codes that do not make a node unhealthy "
                                                                  "(application faults)")
    min_probe_bandwidth_bytes_s: float = setting(0.0, "slowest network probe bandwidth allowed (0: not checked)",
                                                 "bytes/s")
    max_probe_latency_s: float = setting(0.0, "slowest network probe latency allowed (0: not checked)", "s")

    @property
    def allowed_xid_codes(self) -> frozenset[int]:
        return frozenset(int(x) for x in self.allowed_xids)

    def __post_init__(self) -> None:
        sizes: dict[str, int] = {}
        for tier, raw in dict(self.min_free_bytes).items():
            try:
                sizes[str(tier)] = parse_size(raw)
            except ValueError as exc:
                require(False, "min_free_bytes", f"{tier}: {exc}")
        object.__setattr__(self, "min_free_bytes", sizes)
        try:
            xids = tuple(str(x) for x in sorted({int(x) for x in self.allowed_xids}))
        except (TypeError, ValueError):
            xids = ()
            require(False, "allowed_xids", f"expected XID numbers, got {self.allowed_xids!r}")
        object.__setattr__(self, "allowed_xids", xids)  # as strings, like every list setting
        require(self.expected_gpus >= 0, "expected_gpus", f"must be >= 0 (got {self.expected_gpus})")
        require(self.max_gpu_temp_c >= 0, "max_gpu_temp_c", f"must be >= 0 (got {self.max_gpu_temp_c})")
        require(self.max_ecc_uncorrectable >= -1, "max_ecc_uncorrectable",
                f"must be >= -1 (got {self.max_ecc_uncorrectable})")
        require(self.min_probe_bandwidth_bytes_s >= 0, "min_probe_bandwidth_bytes_s",
                f"must be >= 0 (got {self.min_probe_bandwidth_bytes_s})")
        require(self.max_probe_latency_s >= 0, "max_probe_latency_s", f"must be >= 0 (got {self.max_probe_latency_s})")


@dataclass(frozen=True)
class Check:
    name: str  # "disk:ssd", "gpu_count", "gpu_nvml", "gpu_temperature", "gpu_ecc", "gpu_xid", "probe", ...
    ok: bool
    value: float | None
    threshold: float | None
    reason: str


@dataclass(frozen=True)
class HealthReport:
    healthy: bool
    checks: tuple[Check, ...]
    reason: str  # the first failing check's reason, or a summary when healthy
    checked_unix_s: float = 0.0  # when the measurements were taken (the agent's wall clock)

    @property
    def failed(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.ok)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> HealthReport:
        return cls(bool(doc["healthy"]), tuple(Check(**c) for c in doc.get("checks", ())), str(doc["reason"]),
                   float(doc.get("checked_unix_s", 0.0)))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"


def _disk_checks(disks: Mapping[str, DiskMeasurement], t: HealthThresholds) -> list[Check]:
    checks = []
    for tier, need in t.min_free_bytes.items():
        disk, name = disks.get(tier), f"disk:{tier}"
        if disk is None:
            checks.append(Check(name, False, None, need, f"{tier}: not measured (no directory for this tier)"))
        elif disk.error:
            checks.append(Check(name, False, None, need, f"{tier}: {disk.error}"))
        else:
            ok = disk.free_bytes >= need
            checks.append(Check(name, ok, disk.free_bytes, need,
                                f"{tier} free {format_bytes(disk.free_bytes)} {'>=' if ok else '<'} "
                                f"{format_bytes(need)}"))
    return checks


def _gpu_checks(g: GpuMeasurement, t: HealthThresholds) -> list[Check]:
    checks = []
    if t.expected_gpus > 0:
        found = g.count if g.available else 0
        why = "" if g.available else f" ({g.unavailable_reason or 'NVML not available'})"
        ok = found >= t.expected_gpus
        checks.append(Check("gpu_count", ok, found, t.expected_gpus,
                            f"{found} GPUs (expected {t.expected_gpus})" if ok
                            else f"expected {t.expected_gpus} GPUs, found {found}{why}"))
    if not g.available:
        return checks
    if g.errors:
        more = f" (and {len(g.errors) - 1} more)" if len(g.errors) > 1 else ""
        checks.append(Check("gpu_nvml", False, len(g.errors), 0, f"NVML query failed: {g.errors[0]}{more}"))
    temps = [(d.temperature_c, d.index) for d in g.devices if d.temperature_c is not None]
    if t.max_gpu_temp_c > 0 and temps:
        hottest, i = max(temps)
        ok = hottest <= t.max_gpu_temp_c
        checks.append(Check("gpu_temperature", ok, hottest, t.max_gpu_temp_c,
                            f"gpu{i} temperature {hottest:g} °C {'<=' if ok else '>'} {t.max_gpu_temp_c:g} °C"))
    eccs = [(d.ecc_uncorrectable, d.index) for d in g.devices if d.ecc_uncorrectable is not None]
    if t.max_ecc_uncorrectable >= 0 and eccs:
        worst, i = max(eccs)
        ok = worst <= t.max_ecc_uncorrectable
        checks.append(Check("gpu_ecc", ok, worst, t.max_ecc_uncorrectable,
                            f"gpu{i} uncorrectable ECC errors {worst} {'<=' if ok else '>'} "
                            f"{t.max_ecc_uncorrectable}"))
    bad = [x for x in g.xids if x not in t.allowed_xid_codes]
    allowed = ", ".join(t.allowed_xids) or "none"
    checks.append(Check("gpu_xid", not bad, len(bad), 0,
                        f"XID errors {', '.join(map(str, sorted(set(bad))))} (allowed: {allowed})" if bad
                        else f"no XID errors beyond the allowed ({allowed})"))
    return checks


def _probe_checks(p: ProbeResult | None, t: HealthThresholds) -> list[Check]:
    if p is None:
        return []
    if not p.ok:
        return [Check("probe", False, None, None, f"network probe with {p.peer or 'the peer'} failed: {p.error}")]
    checks = []
    if t.max_probe_latency_s > 0:
        ok = p.latency_s <= t.max_probe_latency_s
        checks.append(Check("probe_latency", ok, p.latency_s, t.max_probe_latency_s,
                            f"probe latency {_ms(p.latency_s)} {'<=' if ok else '>'} {_ms(t.max_probe_latency_s)}"))
    if t.min_probe_bandwidth_bytes_s > 0:
        ok = p.bandwidth_bytes_s >= t.min_probe_bandwidth_bytes_s
        checks.append(Check("probe_bandwidth", ok, p.bandwidth_bytes_s, t.min_probe_bandwidth_bytes_s,
                            f"probe bandwidth {format_bytes(p.bandwidth_bytes_s)}/s {'>=' if ok else '<'} "
                            f"{format_bytes(t.min_probe_bandwidth_bytes_s)}/s"))
    return checks


def evaluate(m: Measurements, t: HealthThresholds) -> HealthReport:
    """The verdict, pure. Checks run in a fixed order (disks in the thresholds' order, GPU count,
    NVML errors, temperature, ECC, XIDs, probe) and the first failure is the reason. A check without
    a measurement is skipped, except a tier that has a threshold and the expected GPU count: their
    absence is itself a failure."""
    checks = [*_disk_checks(m.disks, t), *_gpu_checks(m.gpus, t), *_probe_checks(m.probe, t)]
    failed = [c for c in checks if not c.ok]
    if failed:
        more = f" (+{len(failed) - 1} more failing)" if len(failed) > 1 else ""
        reason = failed[0].reason + more
    else:
        reason = f"all {len(checks)} checks passed" if checks else "nothing to check"
    return HealthReport(not failed, tuple(checks), reason, m.taken_unix)


# ---- the network probe ------------------------------------------------------------------------


def split_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def probe_command(rank: int, master: str, *, world_size: int = 2, backend: str = "auto",
                  latency_iters: int = DEFAULT_LATENCY_ITERS, bandwidth_bytes: int = DEFAULT_PROBE_BYTES,
                  bandwidth_iters: int = 3, timeout_s: float = 30.0, cuda_device: int = 0,
                  python: str | None = None) -> list[str]:
    """The command line of one side of the probe (every rank runs one, rank 0 at ``master``)."""
    return [python or sys.executable, "-m", "ftd.agent.health_checks", "probe", "--rank", str(rank),
            "--world-size", str(world_size), "--master", master, "--backend", backend,
            "--latency-iters", str(latency_iters), "--bandwidth-bytes", str(bandwidth_bytes),
            "--bandwidth-iters", str(bandwidth_iters), "--timeout-s", f"{timeout_s:g}",
            "--cuda-device", str(cuda_device)]


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            return doc
    return None


def probe_peer(rank: int, master: str, *, world_size: int = 2, backend: str = "auto",
               latency_iters: int = DEFAULT_LATENCY_ITERS, bandwidth_bytes: int = DEFAULT_PROBE_BYTES,
               bandwidth_iters: int = 3, timeout_s: float = 30.0, cuda_device: int = 0,
               python: str | None = None, env: Mapping[str, str] | None = None,
               exit_grace_s: float = 5.0) -> ProbeResult:
    """Runs this node's side of the probe in a subprocess and returns its result. The subprocess
    ends itself after ``timeout_s`` (interpreter and torch start-up and the rendezvous included);
    it is killed ``exit_grace_s`` later if it did not. Never raises: the result says what failed."""
    cmd = probe_command(rank, master, world_size=world_size, backend=backend, latency_iters=latency_iters,
                        bandwidth_bytes=bandwidth_bytes, bandwidth_iters=bandwidth_iters, timeout_s=timeout_s,
                        cuda_device=cuda_device, python=python)
    failed = ProbeResult(False, peer=master, backend=backend, rank=rank, world_size=world_size)
    try:
        split_hostport(master)
    except ValueError as exc:
        return ProbeResult(**{**failed.to_dict(), "error": str(exc)})
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + exit_grace_s,
                             env=None if env is None else dict(env))
    except subprocess.TimeoutExpired:
        return ProbeResult(**{**failed.to_dict(), "elapsed_s": time.monotonic() - started,
                              "error": f"probe did not finish within {timeout_s + exit_grace_s:g}s"})
    except OSError as exc:
        return ProbeResult(**{**failed.to_dict(), "error": f"cannot run {cmd[0]}: {exc}"})
    doc = _last_json(out.stdout)
    if doc is None and "Timeout (" in out.stderr:  # the subprocess's own watchdog (faulthandler)
        return ProbeResult(**{**failed.to_dict(), "elapsed_s": time.monotonic() - started,
                              "error": f"no result within {timeout_s:g}s: the peer did not join, or the "
                                       "network is too slow"})
    if doc is None:
        tail = " | ".join(out.stderr.strip().splitlines()[-3:]) or "no output"
        return ProbeResult(**{**failed.to_dict(), "elapsed_s": time.monotonic() - started,
                              "error": f"probe exited with {out.returncode} without a result: {tail}"})
    return ProbeResult.from_dict({**doc, "peer": master})


def _run_probe(args: argparse.Namespace) -> dict[str, Any]:
    """The probe itself (in the subprocess): warm-up, latency, bandwidth, each result verified."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    host, port = split_hostport(args.master)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    device = torch.device("cuda", args.cuda_device) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    n = args.world_size
    url_host = f"[{host}]" if ":" in host else host
    dist.init_process_group(backend, init_method=f"tcp://{url_host}:{port}", rank=args.rank, world_size=n,
                            timeout=timedelta(seconds=args.timeout_s))
    try:
        small = torch.ones(1, device=device)
        for _ in range(3):  # connections, communicators
            dist.all_reduce(small)
        sync()
        samples = []
        for _ in range(args.latency_iters):
            small.fill_(1.0)
            t0 = time.perf_counter()
            dist.all_reduce(small)
            sync()
            samples.append(time.perf_counter() - t0)
        if small.item() != n:
            raise RuntimeError(f"all-reduce returned {small.item()}, expected {n}")
        numel = max(1, args.bandwidth_bytes // 4)
        big = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(big)
        sync()
        times = []
        for _ in range(args.bandwidth_iters):
            big.fill_(1.0)
            t0 = time.perf_counter()
            dist.all_reduce(big)
            sync()
            times.append(time.perf_counter() - t0)
        if big[-1].item() != n:
            raise RuntimeError(f"large all-reduce returned {big[-1].item()}, expected {n}")
        nbytes = numel * 4
        algbw = nbytes / statistics.median(times)
        return {"ok": True, "backend": backend, "rank": args.rank, "world_size": n,
                "latency_s": statistics.median(samples), "algbw_bytes_s": algbw,
                "bandwidth_bytes_s": algbw * 2 * (n - 1) / n, "bytes": nbytes}
    finally:
        dist.destroy_process_group()


def _probe_main(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.dump_traceback_later(args.timeout_s, exit=True)  # bounded even if a peer never comes
    started = time.monotonic()
    try:
        doc = _run_probe(args)
    except Exception as exc:
        doc = {"ok": False, "backend": args.backend, "rank": args.rank, "world_size": args.world_size,
               "error": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    doc["elapsed_s"] = time.monotonic() - started
    print(json.dumps(doc), flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0 if doc["ok"] else 1


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what}: expected NAME=VALUE, got {item!r}")
        out[key] = value
    return out


def _check_main(args: argparse.Namespace) -> int:
    try:
        thresholds = HealthThresholds(
            min_free_bytes={k: parse_size(v) for k, v in _pairs(args.min_free, "--min-free").items()},
            expected_gpus=args.expected_gpus, max_gpu_temp_c=args.max_gpu_temp_c,
            max_ecc_uncorrectable=args.max_ecc_uncorrectable,
            allowed_xids=tuple(x for x in args.allowed_xids.split(",") if x.strip()))
    except ValueError as exc:
        print(f"health_checks check: {exc}", file=sys.stderr)
        return 2
    report = evaluate(measure(_pairs(args.tier, "--tier")), thresholds)
    print(json.dumps(report.to_dict()), flush=True)
    return 0 if report.healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftd.agent.health_checks", description="ftd node health checks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="one side of the network probe; prints one JSON line")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--master", required=True, help="HOST:PORT where rank 0 listens")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--latency-iters", type=int, default=DEFAULT_LATENCY_ITERS)
    p.add_argument("--bandwidth-bytes", type=int, default=DEFAULT_PROBE_BYTES)
    p.add_argument("--bandwidth-iters", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--cuda-device", type=int, default=0)
    c = sub.add_parser("check", help="measure this node and print its HealthReport as JSON (exit 1: unhealthy)")
    c.add_argument("--tier", action="append", default=[], metavar="NAME=PATH")
    c.add_argument("--min-free", action="append", default=[], metavar="NAME=SIZE")
    c.add_argument("--expected-gpus", type=int, default=0)
    c.add_argument("--max-gpu-temp-c", type=float, default=85.0)
    c.add_argument("--max-ecc-uncorrectable", type=int, default=0)
    c.add_argument("--allowed-xids", default=",".join(DEFAULT_ALLOWED_XIDS))
    args = parser.parse_args(argv)
    if args.command == "probe":
        if not (0 <= args.rank < args.world_size) or args.latency_iters < 1 or args.bandwidth_iters < 1 \
                or args.timeout_s <= 0:
            parser.error("need 0 <= rank < world-size, iterations >= 1 and timeout-s > 0")
        try:
            split_hostport(args.master)
        except ValueError as exc:
            parser.error(str(exc))
        return _probe_main(args)
    return _check_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
