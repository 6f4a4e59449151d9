"""Node health checks: the verdict is a pure function of (measurements, thresholds), tested by building
records; disks and a fake NVML are measured for real (through the agent's one NVML sampler); the network
probe is a real 2-process gloo all-reduce on 127.0.0.1; the promotion rule is a pure function of
(verdict, now, max_age_s)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ftd.agent.health_measure import GpuSampler, XidEvent, measure, measure_disks
from ftd.agent.health_probe import main, probe_command, probe_peer
from ftd.agent.health_rules import (
    Check,
    DiskMeasurement,
    GpuDevice,
    GpuMeasurement,
    HealthReport,
    HealthThresholds,
    Measurements,
    ProbeResult,
    evaluate,
    format_bytes,
    parse_size,
)
from ftd.ftctl.etcd_server import free_port
from ftd.promotion_fitness import eligible_for_promotion, split_candidates
from ftd.settings import SettingsError, load

GiB = 1 << 30
T0 = 1_800_000_000.0


def disks(**free: int) -> dict[str, DiskMeasurement]:
    return {tier: DiskMeasurement(f"/data/{tier}", n, 100 * GiB) for tier, n in free.items()}


def gpus(*devices: GpuDevice, xids: tuple[int, ...] = (), errors: tuple[str, ...] = ()) -> GpuMeasurement:
    return GpuMeasurement(True, len(devices), devices, xids, errors)


def healthy_gpu(i: int) -> GpuDevice:
    return GpuDevice(i, 45.0, 0)


GOOD_PROBE = ProbeResult(True, peer="10.0.0.2:29400", backend="gloo", rank=0, world_size=2, latency_s=0.0004,
                         bandwidth_bytes_s=1.2e9)
EIGHT = tuple(healthy_gpu(i) for i in range(8))
STRICT = HealthThresholds(min_free_bytes={"ssd": 10 * GiB, "hdd": 50 * GiB}, expected_gpus=8, max_gpu_temp_c=85,
                          max_ecc_uncorrectable=0, min_probe_bandwidth_bytes_s=1e9, max_probe_latency_s=0.001)
GOOD = Measurements(disks(ssd=20 * GiB, hdd=60 * GiB), gpus(*EIGHT), GOOD_PROBE, T0)


# ---- evaluate(): one row per check, passing and failing ---------------------------------------

CASES: list[tuple[str, Measurements, HealthThresholds, str, str]] = [
    ("ssd short", Measurements(disks(ssd=int(1.2 * GiB)), GpuMeasurement(), None, T0),
     HealthThresholds(min_free_bytes={"ssd": 10 * GiB}), "disk:ssd", "ssd free 1.2 GiB < 10 GiB"),
    ("hdd error", Measurements({"hdd": DiskMeasurement("/x", error="cannot measure /x: No such file or directory")}),
     HealthThresholds(min_free_bytes={"hdd": 1}), "disk:hdd", "hdd: cannot measure /x: No such file or directory"),
    ("tier unknown", Measurements(disks(ssd=GiB)), HealthThresholds(min_free_bytes={"nvme": GiB}), "disk:nvme",
     "nvme: not measured (no directory for this tier)"),
    ("no NVML, 8 expected", Measurements(gpus=GpuMeasurement(unavailable_reason="NVML not installed")),
     HealthThresholds(expected_gpus=8), "gpu_count", "expected 8 GPUs, found 0 (NVML not installed)"),
    ("a GPU fell off", Measurements(gpus=gpus(*EIGHT[:7])), HealthThresholds(expected_gpus=8), "gpu_count",
     "expected 8 GPUs, found 7"),
    ("hot", Measurements(gpus=gpus(healthy_gpu(0), GpuDevice(3, 91.0, 0))), HealthThresholds(max_gpu_temp_c=85),
     "gpu_temperature", "gpu3 temperature 91 °C > 85 °C"),
    ("ECC", Measurements(gpus=gpus(healthy_gpu(0), GpuDevice(2, 50.0, 4))), HealthThresholds(), "gpu_ecc",
     "gpu2 uncorrectable ECC errors 4 > 0"),
    ("XID 79", Measurements(gpus=gpus(healthy_gpu(0), xids=(13, 79, 79))), HealthThresholds(), "gpu_xid",
     "XID errors 79 (allowed: 13, 31, 43, 45)"),
    ("NVML error", Measurements(gpus=gpus(healthy_gpu(0), errors=("gpu1 temperature: GPU is lost",))),
     HealthThresholds(), "gpu_nvml", "NVML query failed: gpu1 temperature: GPU is lost"),
    ("probe failed", Measurements(probe=ProbeResult(False, peer="10.0.0.2:29400", error="timed out")),
     HealthThresholds(), "probe", "network probe with 10.0.0.2:29400 failed: timed out"),
    ("slow link", Measurements(probe=ProbeResult(True, peer="p", latency_s=0.0004, bandwidth_bytes_s=0.5e9)),
     HealthThresholds(min_probe_bandwidth_bytes_s=1e9), "probe_bandwidth", "probe bandwidth 476.8 MiB/s < 953.7 MiB/s"),
    ("laggy link", Measurements(probe=ProbeResult(True, peer="p", latency_s=0.005, bandwidth_bytes_s=2e9)),
     HealthThresholds(max_probe_latency_s=0.001), "probe_latency", "probe latency 5 ms > 1 ms"),
]


@pytest.mark.parametrize(("m", "t", "check", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_check_fails_with_a_reason_naming_value_and_threshold(
        m: Measurements, t: HealthThresholds, check: str, reason: str) -> None:
    report = evaluate(m, t)
    assert not report.healthy and report.reason == reason
    assert [c.name for c in report.failed] == [check]


def test_everything_passing_is_healthy() -> None:
    report = evaluate(GOOD, STRICT)
    assert report.healthy and report.reason == f"all {len(report.checks)} checks passed"
    assert [c.name for c in report.checks] == ["disk:ssd", "disk:hdd", "gpu_count", "gpu_temperature", "gpu_ecc",
                                               "gpu_xid", "probe_latency", "probe_bandwidth"]
    by_name = {c.name: c for c in report.checks}
    assert by_name["disk:ssd"] == Check("disk:ssd", True, 20 * GiB, 10 * GiB, "ssd free 20 GiB >= 10 GiB")
    assert by_name["gpu_count"].reason == "8 GPUs (expected 8)"
    assert report.checked_unix_s == T0


def test_the_first_failure_is_the_reason_and_the_others_are_counted() -> None:
    m = Measurements(disks(ssd=GiB, hdd=GiB), gpus(*EIGHT[:6]), GOOD_PROBE, T0)
    report = evaluate(m, STRICT)
    assert report.reason == "ssd free 1 GiB < 10 GiB (+2 more failing)"
    assert [c.name for c in report.failed] == ["disk:ssd", "disk:hdd", "gpu_count"]


def test_without_gpus_and_none_expected_gpu_checks_are_skipped() -> None:
    m = Measurements(disks(ssd=20 * GiB), GpuMeasurement(unavailable_reason="NVML not installed"), None, T0)
    report = evaluate(m, HealthThresholds(min_free_bytes={"ssd": 10 * GiB}, expected_gpus=0))
    assert report.healthy and [c.name for c in report.checks] == ["disk:ssd"]
    assert evaluate(Measurements(), HealthThresholds()).reason == "nothing to check"


def test_disabled_thresholds_and_unknown_values_are_not_checked() -> None:
    m = Measurements(gpus=gpus(GpuDevice(0, 99.0, 7), GpuDevice(1, None, None)),
                     probe=ProbeResult(True, latency_s=1.0, bandwidth_bytes_s=1.0))
    report = evaluate(m, HealthThresholds(max_gpu_temp_c=0, max_ecc_uncorrectable=-1))
    assert report.healthy and [c.name for c in report.checks] == ["gpu_xid"]


def test_report_round_trips_through_json() -> None:
    report = evaluate(GOOD, STRICT)
    assert HealthReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


# ---- thresholds -------------------------------------------------------------------------------


def test_sizes() -> None:
    assert parse_size("10GiB") == 10 * GiB and parse_size("500MB") == 500_000_000 and parse_size(42) == 42
    assert parse_size("1.5 TiB") == int(1.5 * (1 << 40)) and parse_size("7") == 7
    for bad in ("ten", "10 parsecs", "-1", True):
        with pytest.raises(ValueError):
            parse_size(bad)  # type: ignore[arg-type]
    assert (format_bytes(int(1.2 * GiB)), format_bytes(10 * GiB), format_bytes(512)) == ("1.2 GiB", "10 GiB", "512 B")


def test_thresholds_load_like_any_settings_and_validate() -> None:
    t = load(HealthThresholds, ["--min-free-bytes", "ssd=10GiB,hdd=50GB", "--allowed-xids", "13,31"],
             {"FTD_HEALTH_EXPECTED_GPUS": "8"}, prog="t", env_prefix="FTD_HEALTH_")
    assert t.min_free_bytes == {"ssd": 10 * GiB, "hdd": 50_000_000_000}
    assert t.expected_gpus == 8 and t.allowed_xids == ("13", "31") and t.allowed_xid_codes == {13, 31}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"min_free_bytes": {"ssd": "lots"}}, "min_free_bytes"), ({"expected_gpus": -1}, "expected_gpus"),
        ({"max_ecc_uncorrectable": -2}, "max_ecc_uncorrectable"), ({"allowed_xids": ("x",)}, "allowed_xids"),
        ({"max_probe_latency_s": -1.0}, "max_probe_latency_s"),
    ]
    for kwargs, field in bad:
        with pytest.raises(SettingsError) as err:
            HealthThresholds(**kwargs)
        assert err.value.field == field


# ---- measuring ------------------------------------------------------------------------------------


def test_measure_disks(tmp_path: Path) -> None:
    out = measure_disks({"ssd": tmp_path, "gone": tmp_path / "missing"})
    assert out["ssd"].total_bytes > 0 and 0 < out["ssd"].free_bytes <= out["ssd"].total_bytes
    assert out["ssd"].error == "" and out["ssd"].path == str(tmp_path)
    assert out["gone"].error.startswith(f"cannot measure {tmp_path / 'missing'}")
    report = evaluate(measure({"ssd": tmp_path}, now_unix=T0), HealthThresholds(min_free_bytes={"ssd": 1}))
    assert report.healthy and report.checks[0].name == "disk:ssd"


class NVMLError(Exception):
    def __init__(self, value: int, text: str) -> None:
        super().__init__(text)
        self.value = value


class FakeNvml:
    """The few NVML functions used, with per-device answers or errors."""

    def __init__(self, temps: list[Any], eccs: list[Any], init_error: bool = False) -> None:
        self.temps, self.eccs, self.init_error = temps, eccs, init_error
        self.inits = self.shutdowns = 0
        self.events: list[int] = []

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(9, "Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.temps)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    @staticmethod
    def _answer(value: Any) -> Any:
        if isinstance(value, Exception):
            raise value
        return value

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> Any:
        assert sensor == 0
        return self._answer(self.temps[handle])

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter: int) -> Any:
        assert (error_type, counter) == (1, 0)  # uncorrected, volatile
        return self._answer(self.eccs[handle])

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return type("Utilization", (), {"gpu": 50})()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return type("Memory", (), {"used": 1 << 30})()

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        assert types == 0x8

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0
        if not self.events:
            raise NVMLError(10, "Timeout")
        return type("EventData", (), {"eventData": self.events.pop(0)})()

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


def test_measure_gpus_guards_each_nvml_call() -> None:
    nv = FakeNvml(temps=[41, NVMLError(15, "GPU is lost"), 60], eccs=[0, 0, NVMLError(3, "Not Supported")])
    sampler = GpuSampler(nv)
    g = sampler.measure()
    assert g.available and g.count == 3 and nv.inits == 1
    assert [(d.index, d.temperature_c, d.ecc_uncorrectable) for d in g.devices] == [(0, 41.0, 0), (1, None, 0),
                                                                                    (2, 60.0, None)]
    assert g.errors == ("gpu1 temperature: GPU is lost",)  # unsupported ECC is unknown, not an error
    report = evaluate(Measurements(gpus=g), HealthThresholds(expected_gpus=3))
    assert not report.healthy and report.reason == "NVML query failed: gpu1 temperature: GPU is lost"
    sampler.measure()
    assert nv.inits == 1, "one NVML initialisation for every measurement"
    sampler.close()
    assert nv.shutdowns == 1


def test_measure_gpus_without_nvml() -> None:
    g = GpuSampler().measure()  # pynvml is a core dependency, but this machine has no NVIDIA driver
    if g.available:
        pytest.skip("NVML is present here")
    assert g.count == 0 and g.unavailable_reason
    failed = GpuSampler(FakeNvml([], [], init_error=True))
    assert not failed.available and "Driver Not Loaded" in failed.measure().unavailable_reason
    assert not failed.watches_xids


def test_xid_events_are_drained_without_waiting() -> None:
    nv = FakeNvml(temps=[40, 40], eccs=[0, 0])
    sampler = GpuSampler(nv)
    assert sampler.watches_xids
    assert sampler.drain_xids() == ()
    nv.events = [79, 13, 48]
    assert sampler.drain_xids(max_events=2) == (XidEvent(79), XidEvent(13))
    m = measure({}, sampler, now_unix=T0)  # the one-shot measurement (health_probe check) drains the rest
    assert m.gpus.xids == (48,)
    assert evaluate(m, HealthThresholds()).reason == "XID errors 48 (allowed: 13, 31, 43, 45)"
    sampler.close()
    assert sampler.drain_xids() == ()


# ---- the network probe ----------------------------------------------------------------------------


def test_the_agent_process_never_imports_torch() -> None:
    code = ("import sys, ftd.agent.health_monitor, ftd.agent.health_probe as h; h.probe_command(0, '127.0.0.1:1'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    cmd = probe_command(1, "10.0.0.2:29400", timeout_s=12)
    assert cmd[1:4] == ["-m", "ftd.agent.health_probe", "probe"] and "--timeout-s" in cmd


@pytest.mark.slow
def test_a_real_gloo_probe_between_two_processes_on_loopback() -> None:
    master = f"127.0.0.1:{free_port()}"
    results: dict[int, ProbeResult] = {}

    def side(rank: int) -> None:
        results[rank] = probe_peer(rank, master, backend="gloo", bandwidth_bytes=16 << 20, latency_iters=10,
                                   timeout_s=60)

    threads = [threading.Thread(target=side, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert set(results) == {0, 1}
    for rank, r in results.items():
        assert r.ok, r.error
        assert (r.rank, r.world_size, r.backend, r.peer, r.bytes) == (rank, 2, "gloo", master, 16 << 20)
        assert 0 < r.latency_s < 1.0 and r.bandwidth_bytes_s > 0 and r.algbw_bytes_s > 0
    report = evaluate(Measurements(probe=results[0]),
                      HealthThresholds(min_probe_bandwidth_bytes_s=1.0, max_probe_latency_s=1.0))
    assert report.healthy and [c.name for c in report.checks] == ["probe_latency", "probe_bandwidth"]


@pytest.mark.slow
def test_a_probe_without_its_peer_fails_within_its_timeout() -> None:
    started = time.monotonic()
    r = probe_peer(0, f"127.0.0.1:{free_port()}", backend="gloo", timeout_s=3, exit_grace_s=10)
    elapsed = time.monotonic() - started
    assert not r.ok and elapsed < 13
    assert "the peer did not join" in r.error or "Timeout" in r.error or "timed out" in r.error, r.error
    report = evaluate(Measurements(probe=r), HealthThresholds())
    assert not report.healthy and report.reason.startswith("network probe with 127.0.0.1:")


def test_probe_of_a_missing_interpreter_or_a_bad_address_says_so() -> None:
    r = probe_peer(0, "127.0.0.1:1", python="/nonexistent/python", timeout_s=1)
    assert not r.ok and "cannot run /nonexistent/python" in r.error
    bad = probe_peer(0, "no-port-here", timeout_s=1)
    assert not bad.ok and bad.error == "expected HOST:PORT, got 'no-port-here'"


def test_check_command_prints_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--tier", f"tmp={tmp_path}", "--min-free", "tmp=1"]) == 0
    report = HealthReport.from_dict(json.loads(capsys.readouterr().out))
    assert report.healthy and report.checks[0].name == "disk:tmp"
    assert main(["check", "--tier", f"tmp={tmp_path}", "--min-free", "tmp=1PiB"]) == 1
    assert "tmp free" in json.loads(capsys.readouterr().out)["reason"]
    assert main(["check", "--min-free", "tmp=much"]) == 2


# ---- promotion: the coordinator's side ---------------------------------------------------------


def verdict(healthy: bool, checked: float, reason: str = "") -> HealthReport:
    return HealthReport(healthy, (), reason or ("all 3 checks passed" if healthy else "?"), checked)


@pytest.mark.parametrize(("v", "ok", "why"), [
    (verdict(True, T0 - 5), True, "healthy as of 5s ago"),
    (verdict(False, T0 - 5, "ssd free 1.2 GiB < 10 GiB"), False, "unhealthy: ssd free 1.2 GiB < 10 GiB"),
    (verdict(True, T0 - 90), False, "health verdict is 90s old (max_age_s=60)"),
    (verdict(True, T0 + 120), False, "health verdict is dated 120s in the future (clock skew?)"),
    (verdict(True, T0 + 2), True, "healthy as of 0s ago"),
    (verdict(True, 0.0), False, "health verdict has no time of measurement"),
    (None, False, "no health verdict reported yet"),
])
def test_eligible_for_promotion(v: HealthReport | None, ok: bool, why: str) -> None:
    assert eligible_for_promotion(v, T0, max_age_s=60) == (ok, why)


def test_missing_verdicts_can_be_tolerated_during_an_upgrade_and_candidates_split() -> None:
    assert eligible_for_promotion(None, T0, 60, require_verdict=False) == (
        True, "no health verdict reported (not required)")
    verdicts = {"s1": verdict(True, T0 - 1), "s2": verdict(False, T0 - 1, "expected 8 GPUs, found 7")}
    ok, rejected = split_candidates(["s3", "s2", "s1"], verdicts, T0, 60)
    assert ok == ["s1"] and rejected == {"s2": "unhealthy: expected 8 GPUs, found 7",
                                         "s3": "no health verdict reported yet"}
