"""``ftd-coordinator``: one replica of the coordinator (leader or hot standby)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from grpc import aio

from ftd import etcd_client, logs, metrics_http, rpc, systemd
from ftd.authz_interceptors import AioAuthzInterceptor, Guard
from ftd.hardening import harden_process
from ftd.identity import PkiError, identity_of
from ftd.settings import load_or_exit

from . import validation
from .beacon_listener import BeaconBook, BeaconProtocol, listen
from .control import Controller
from .etcd_space import EtcdSpace, SpaceConfig, SpaceKeeper
from .etcd_store import EtcdStore
from .metrics import CoordinatorMetrics
from .service import add_to_server, authz_facts
from .settings import ENV_PREFIX, CoordinatorSettings

log = logging.getLogger("ftd.coordinator")


def write_ready_file(path: Path, data: dict[str, object]) -> None:
    """Atomically (temp + rename) so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def start_http(listen: str, controller: Controller, metrics: CoordinatorMetrics) -> str:
    """/metrics, /healthz (the control loop is ticking), /readyz (serving: leader or standby)."""
    if not listen:
        return ""
    host, port = rpc.parse_hostport(listen)

    def healthy() -> tuple[bool, str]:
        idle = controller.clock() - controller.last_tick_at
        return idle < 10.0, f"control loop ran {idle:.1f}s ago"

    def ready() -> tuple[bool, str]:
        role = "leader" if controller.is_leader else f"standby (leader: {controller.leader_address() or 'unknown'})"
        return True, f"replica {controller.replica_id} serving as {role}"

    server = metrics_http.serve(host, port, metrics.registry, healthy, ready)
    return f"{host}:{server.server_port}"


def check_identity(settings: CoordinatorSettings) -> str:
    """Loads this replica's certificate once (a bad one fails the start, naming the file) and checks
    that it is of ``settings.cluster``; returns what went wrong, or "" when all is well."""
    files = settings.identity
    if files is None:
        return ""
    try:
        own = identity_of(files.load().cert_pem)
    except PkiError as exc:
        return str(exc)
    if own is None or own.cluster != settings.cluster:
        return (f"certificate {files.cert_path} is of cluster {own.cluster if own else '?'!r}, but this coordinator "
                f"serves cluster {settings.cluster!r} (setting cluster): every call would be refused")
    return ""


async def serve(settings: CoordinatorSettings) -> int:
    metrics = CoordinatorMetrics()
    problem = check_identity(settings)
    if problem:
        log.error("cannot serve with mTLS: %s", problem)
        return 1
    guard: Guard | None = None
    if settings.identity is None:
        log.warning("no pki_dir: serving PLAINTEXT gRPC without authorization on %s; anyone who reaches it may "
                    "register nodes, close jobs and roll back checkpoints (docs/security.md)", settings.listen)
        server = aio.server(options=[*rpc.SERVER_OPTIONS, *validation.SERVER_SIZE_OPTIONS])
    else:
        guard = Guard(cluster=settings.cluster,
                      on_denied=lambda method, rule: metrics.rpc_denied.labels(method, rule).inc())
        server = aio.server(options=[*rpc.SERVER_OPTIONS, *validation.SERVER_SIZE_OPTIONS],
                            interceptors=[AioAuthzInterceptor(guard)])
    host, port = rpc.parse_hostport(settings.listen)
    bound = rpc.add_port(server, rpc.dial_target(host, port), settings.identity)
    if bound == 0:
        log.error("cannot listen on %s", settings.listen)
        return 1
    address = settings.advertise or f"{host}:{bound}"
    if settings.etcd_tls is None:
        log.warning("no etcd_ca_file: talking to etcd %s in plaintext", settings.etcd_endpoints)
    try:
        with etcd_client.using_tls(settings.etcd_tls):
            store = EtcdStore(settings.etcd_endpoints, settings.cluster, settings.etcd_timeout_s)
            space = EtcdSpace(settings.etcd_endpoints)
    except PkiError as exc:
        log.error("cannot reach etcd with TLS: %s", exc)
        return 1
    controller = Controller(store, settings, address, metrics)
    keeper = SpaceKeeper(space, SpaceConfig(settings.etcd_quota_bytes, settings.rendezvous_budget_bytes,
                                            settings.etcd_compact_every_s or math.inf),
                         lambda: controller.is_leader,
                         lambda why: controller.committer.commit("etcd_space", events=[("etcd_space", "", why)]))
    if guard is not None:
        guard.facts = authz_facts(controller)  # what the leader knows: hosts, job members, rank 0
        guard.deny = controller.access.deny_list  # revoked identities and serials (ftctl certs revoke)
    add_to_server(server, controller)
    beacon_transport = None
    if settings.beacon_listen != "off":
        bhost, bport = rpc.parse_hostport(settings.beacon_listen) if settings.beacon_listen else (host, 0)
        protocol = BeaconProtocol(controller.membership.on_beacon, metrics.beacons_accepted, metrics.beacons_dropped,
                                  controller.membership.echo, metrics.beacon_echoes)
        try:
            beacon_transport, bport = await listen(bhost, bport, protocol)
        except OSError as exc:
            log.error("cannot listen for beacons on UDP %s:%d (setting beacon_listen): %s", bhost, bport, exc)
            return 1
        # Agents are told the host this replica advertises: a load balancer in front (a Service) could hand a
        # datagram to a standby. A wildcard listen address advertises nothing: they use the host they dialed.
        ahost = rpc.parse_hostport(address)[0]
        controller.membership.beacons = BeaconBook(bport, settings.beacon_interval_s,
                                                   "" if ahost in ("0.0.0.0", "::", "") else ahost,
                                                   settings.quiet_answer_interval_s)
        controller.membership.drain_beacons = beacon_transport.drain
        controller.membership.beacons_lost = beacon_transport.lost
    await server.start()
    metrics_address = start_http(settings.metrics_listen, controller, metrics)
    logs.set_identity(replica=controller.replica_id)
    beacon_port = controller.membership.beacons.port if controller.membership.beacons is not None else 0
    log.info("serving on %s (%s; metrics %s; beacons %s), etcd %s (%s), cluster %r", address,
             f"mTLS as coordinator/{settings.replica_id}" if guard is not None else "PLAINTEXT",
             metrics_address or "off", f"UDP {beacon_port}" if beacon_port else "off", settings.etcd_endpoints,
             "TLS" if settings.etcd_tls else "plaintext", settings.cluster)
    if settings.ready_file:
        write_ready_file(settings.ready_file, {"pid": os.getpid(), "address": address,
                                               "metrics": metrics_address, "replica_id": controller.replica_id,
                                               "beacon_port": beacon_port})
    systemd.notify(f"READY=1\nSTATUS=serving on {address}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = asyncio.create_task(controller.run())
    space_runner = asyncio.create_task(keeper.run(stop))
    await stop.wait()
    log.info("stopping: handing leadership over")
    systemd.notify("STOPPING=1")
    await controller.stop()
    runner.cancel()
    space_runner.cancel()
    await server.stop(grace=1.0)
    if beacon_transport is not None:
        beacon_transport.close()
    store.close()
    space.close()
    return 0


GC_THRESHOLDS = (20_000, 20, 10)  # gen0 allocations, gen0 runs per gen1, gen1 runs per gen2 (CPython: 700, 10, 10)


def tune_gc() -> None:
    """Fewer garbage collections for a leader holding every node's memory report. At 2,000 nodes x 8
    ranks it keeps ~450,000 objects, many replaced at the memory cadence; with CPython's default
    thresholds a full collection (0.2-0.5 s, the event loop stopped) came every ~4 s, ~7 % of a core
    in all (bench/coordinator_scale.py, gc.callbacks), and its pauses delay beacons and ticks. What
    exists once the process has started (modules, settings) is frozen out of every collection, and
    young objects are collected less often: 0.7 s of collections in 40 s where there were 3 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_or_exit(
        CoordinatorSettings, sys.argv[1:] if argv is None else argv, os.environ,
        prog="ftd-coordinator", env_prefix=ENV_PREFIX,
        description="ftd coordinator replica: failure detection, spare promotion, epochs in etcd.",
    )
    logs.configure(settings.log_level, component="coordinator")
    harden_process()
    tune_gc()
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
