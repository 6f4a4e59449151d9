"""The health verdict, pure: what a node must meet, the records it is judged on, and the judgement.

A spare that cannot hold a rank must not be handed one: a full checkpoint tier, a GPU that fell off
the bus, an uncorrectable ECC error or a slow link turn a recovery into a second failure. Measuring
(``agent.health_measure``, ``agent.health_probe``) and judging are kept apart: :func:`evaluate` is a
pure function of ``(measurements, thresholds)`` returning a :class:`HealthReport` whose ``reason``
names the first failing check ("ssd free 1.2 GiB < 10 GiB"), so every decision is testable by
building a record. :func:`sampling_check` judges the sampling itself as a pure function of ``now``:
a sample still running past its deadline ("gpu probe hung 5.0 s") or one gone stale is a failure,
so a hung NVML call shows in the verdict instead of silencing the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ftd.settings import require, setting

# XIDs an application causes without the GPU being at fault: 13 graphics engine exception, 31 GPU
# memory page fault, 43 GPU stopped processing (a user application fault), 45 preemptive cleanup.
DEFAULT_ALLOWED_XIDS = ("13", "31", "43", "45")

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


# ---- the records judged --------------------------------------------------------------------


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
    utilization_pct: float | None = None  # for the heartbeat's GpuHealth and ftd_agent_gpu_utilization_ratio
    memory_used_bytes: int | None = None


@dataclass(frozen=True)
class GpuMeasurement:
    available: bool = False  # NVML loaded and initialised
    count: int = 0
    devices: tuple[GpuDevice, ...] = ()
    xids: tuple[int, ...] = ()  # critical XIDs seen and not cleared (agent.health_monitor.GpuFaults)
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
        return [*checks, *_xid_checks(g, t)] if g.xids else checks  # latched before NVML went away
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
    return [*checks, *_xid_checks(g, t)]


def _xid_checks(g: GpuMeasurement, t: HealthThresholds) -> list[Check]:
    bad = [x for x in g.xids if x not in t.allowed_xid_codes]
    allowed = ", ".join(t.allowed_xids) or "none"
    return [Check("gpu_xid", not bad, len(bad), 0,
                  f"XID errors {', '.join(map(str, sorted(set(bad))))} (allowed: {allowed})" if bad
                  else f"no XID errors beyond the allowed ({allowed})")]


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
    return _report([*_disk_checks(m.disks, t), *_gpu_checks(m.gpus, t), *_probe_checks(m.probe, t)], m.taken_unix)


def _report(checks: list[Check], checked_unix_s: float) -> HealthReport:
    failed = [c for c in checks if not c.ok]
    if failed:
        more = f" (+{len(failed) - 1} more failing)" if len(failed) > 1 else ""
        reason = failed[0].reason + more
    else:
        reason = f"all {len(checks)} checks passed" if checks else "nothing to check"
    return HealthReport(not failed, tuple(checks), reason, checked_unix_s)


# ---- the sampling itself ----------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingState:
    """Where the agent's sampling thread stands, on the monotonic clock."""

    done_at: float | None = None  # when the newest complete sample finished; None: none yet
    busy_since: float | None = None  # when the running part began; None: idle between samples
    busy_part: str = ""  # what runs now: "gpu", "disk:ssd"


def sampling_check(state: SamplingState, now: float, interval_s: float, deadline_s: float) -> Check | None:
    """Whether the latest sample can be trusted at ``now``, pure. A part running longer than
    ``deadline_s`` has hung ("gpu probe hung 5.0 s"); a newest sample older than ``interval_s +
    deadline_s`` is stale (the sampling thread stopped). ``None`` before the first sample, unless that
    one has hung."""
    if state.busy_since is not None and now - state.busy_since > deadline_s:
        busy = now - state.busy_since
        return Check("sampling", False, busy, deadline_s, f"{state.busy_part or 'health'} probe hung {busy:.1f} s "
                                                          f"(deadline {deadline_s:g} s)")
    if state.done_at is None:
        return None
    age, limit = now - state.done_at, interval_s + deadline_s
    if age > limit:
        return Check("sampling", False, age, limit, f"health sample {age:.1f} s old (one every {interval_s:g} s)")
    return Check("sampling", True, age, limit, f"sampled {age:.1f} s ago")


def judge(m: Measurements | None, t: HealthThresholds, sampling: Check | None, now_unix: float) -> HealthReport | None:
    """The verdict the agent sends at ``now_unix``: the latest measurements judged, the sampling
    check first. A failing sampling check is the reason and dates the report ``now_unix`` (the
    measurements are old, the hang is news); ``None`` while there is nothing to judge yet."""
    if m is None:
        return None if sampling is None or sampling.ok else _report([sampling], now_unix)
    report = evaluate(m, t)
    if sampling is None:
        return report
    return _report([sampling, *report.checks], m.taken_unix if sampling.ok else now_unix)
