"""The network probe between this node and a peer, and the health checks' command line.

The probe is a short all-reduce (gloo on CPU; NCCL where GPUs exist): the median latency of a
one-float all-reduce and the bus bandwidth of a 16 MiB one. It runs as ``python -m
ftd.agent.health_probe probe --rank R --master HOST:PORT ...`` in a subprocess, bounded by a timeout,
printing one JSON line: the agent never imports torch in its own process. ``python -m
ftd.agent.health_probe check`` measures this node once and prints its ``health_rules.HealthReport``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .health_measure import measure
from .health_rules import DEFAULT_ALLOWED_XIDS, HealthThresholds, ProbeResult, evaluate, parse_size

MiB = 1 << 20
DEFAULT_PROBE_BYTES = 16 * MiB
DEFAULT_LATENCY_ITERS = 20


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
    return [python or sys.executable, "-m", "ftd.agent.health_probe", "probe", "--rank", str(rank),
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
        print(f"health_probe check: {exc}", file=sys.stderr)
        return 2
    report = evaluate(measure(_pairs(args.tier, "--tier")), thresholds)
    print(json.dumps(report.to_dict()), flush=True)
    return 0 if report.healthy else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftd.agent.health_probe", description="ftd node health checks")
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
