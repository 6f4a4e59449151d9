"""``ftctl``: the operator CLI, a thin ``main(argv)`` over :mod:`ftd.client`,
:mod:`.localcluster` and :mod:`.drill`. Every read command takes ``--json``.

Exit codes: 0 ok, 1 the operation ran and failed (a drill missed its target, a cluster did not form,
a certificate is missing or bad), 2 bad usage, 3 the coordinator could not be reached.

mTLS: ftctl talks to coordinators and agents as an operator, ``operators/<name>`` (``--operator``;
``operator.crt`` by default) of the PKI directory ``--pki-dir`` / ``$FTD_PKI_DIR``, else the one of the
local cluster in ``--workdir``. Without any, it tries plaintext (a cluster without ``pki_dir``).

Isolated clusters (``up --isolate``, :mod:`.isolated`): with ``--workdir`` of one, ftctl re-executes
itself inside the cluster's ``ctl`` network namespace (the root namespace cannot reach the lab);
``down`` stops the processes and removes the lab from the root namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from ftd import netlab
from ftd.client import CoordinatorClient, CoordinatorUnreachable
from ftd.identity import DEFAULT_OPERATOR, IdentityFiles, PkiError
from ftd.rpc import rpc_code, rpc_details
from ftd.v1 import coordinator_pb2

from . import certs, checkpoints, demo, drill, goodput, health, isolated, localcluster, nan_demo, render, report
from .json_shapes import node_dict, status_dict

ENV_COORDINATOR = "FTD_COORDINATOR"
ENV_DRILL_TOKEN = "FTD_DRILL_TOKEN"
ENV_PKI_DIR = certs.ENV_PKI_DIR
ENV_OPERATOR = "FTD_OPERATOR"
DEFAULT_COORDINATOR = "127.0.0.1:7400"


class DrainTimeout(RuntimeError):
    """A drain was accepted but not committed in time."""


class UsageError(Exception):
    pass


def _global_options(p: argparse.ArgumentParser, pki_dir: bool = True) -> None:
    p.add_argument("--coordinator", help=f"coordinator replicas HOST:PORT[,HOST:PORT...] (env {ENV_COORDINATOR}; "
                                         f"default: DIR/cluster.json with --workdir, else {DEFAULT_COORDINATOR})")
    p.add_argument("--workdir", type=Path, help="a local cluster started by 'ftctl up' (reads DIR/cluster.json)")
    p.add_argument("--timeout", type=float, help="per-call deadline [s] (default 5)")
    if pki_dir:  # ftctl certs has its own --pki-dir (the same meaning)
        p.add_argument("--pki-dir", type=Path, help=f"the cluster PKI: mTLS as an operator (env {ENV_PKI_DIR}; "
                                                    "default: the local cluster's with --workdir, else plaintext)")
    p.add_argument("--operator", help=f"the operator certificate to use, operators/NAME (env {ENV_OPERATOR}; "
                                      "default: operator.crt)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftctl", description="Operate an ftd cluster.")
    _global_options(p)
    # The global options are accepted after the command too (ftctl up --workdir DIR).
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _global_options(common)
    common_certs = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    _global_options(common_certs, pki_dir=False)
    sub = p.add_subparsers(dest="command", required=True)
    _add = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        return _add(name, parents=[common_certs if name == "certs" else common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    up = sub.add_parser("up", help="start a local cluster: etcd, coordinator(s), agents")
    up.add_argument("--nodes", type=int, default=2, help="active nodes (default 2)")
    up.add_argument("--spares", type=int, default=1, help="spare nodes (default 1)")
    up.add_argument("--coordinators", type=int, default=1, help="coordinator replicas (default 1)")
    up.add_argument("--etcd-endpoints", help="use this etcd instead of starting one")
    up.add_argument("--racks", type=int, default=0, help="spread nodes over this many rack labels")
    up.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for the cluster [s]")
    up.add_argument("--s3-endpoint", default="", help="S3-compatible endpoint URL for the cold tier (default: none)")
    up.add_argument("--s3-bucket", default="ftd-checkpoints", help="bucket of the cold tier")
    up.add_argument("--s3", action="store_true",
                    help="start moto's S3 server as the cold tier (in its own namespace with --isolate; dev extra)")
    up.add_argument("--etcd-members", type=int, default=1,
                    help="members of the embedded etcd (3 survives losing one; default 1)")
    up.add_argument("--etcd-v3-rendezvous", action="store_true",
                    help="the nodes' rendezvous certificates may reach etcd, for torchrun --rdzv-backend=etcd-v3 "
                         "(off by default: no certificate a node holds reaches etcd; docs/security.md)")
    train = up.add_argument_group("training", "a job every agent runs while its node holds a rank")
    train.add_argument("--train-cmd", default="",
                       help="the training script and its arguments ('train.py --lr 1e-3', 'python train.py', "
                            "'-m pkg.train'), torchrun's form; see docs/training.md")
    train.add_argument("--nproc-per-node", type=int, default=1, help="training processes per node (default 1)")
    train.add_argument("--job", default="train", help="the job id (default train)")
    train.add_argument("--min-nodes", type=int, default=0,
                       help="the job runs with at least this many nodes (default: all the active nodes)")
    train.add_argument("--max-restarts", type=int, default=10, help="the job's restart budget (default 10)")
    train.add_argument("--on-no-spare", choices=("shrink", "wait"), default="shrink",
                       help="a node lost and no spare left: shrink (go on with the smaller world, the newest "
                            "step resharded) or wait (for a spare or a returning node); default shrink")
    train.add_argument("--hang-timeout-s", type=float, default=120.0,
                       help="no training step for this long is a hang [s] (default 120; 0: off)")
    train.add_argument("--launcher", choices=("warm", "torchrun"), default="warm",
                       help="warm: the agent's standby workers (default); torchrun: torchrun --rdzv-backend=ftd")
    _isolate_options(up)
    sub.add_parser("down", help="stop everything 'ftctl up' started in --workdir")

    for name, help_text in (("status", "leader, epoch, world, spares, dead nodes"),
                            ("nodes", "every registered node with its state"),
                            ("events", "the coordinator's event log, newest first")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "events":
            cmd.add_argument("--limit", type=int, default=50)

    gp = sub.add_parser("goodput", help="the job's goodput: productive share of wall time, time lost by cause, "
                                        "every incident (kind, detection, recovery, steps redone)")
    gp.add_argument("--job", default="", help="the job (default: the cluster's current job)")
    gp.add_argument("--since", default="", metavar="DUR", help="only the last DUR (90s, 30m, 1h, 2d); default: since "
                    "the job's first step")
    gp.add_argument("--json", action="store_true", help="machine-readable output")

    ck = sub.add_parser("checkpoints", help="the checkpoint catalog: list, verify, rollback, migrations")
    cks = ck.add_subparsers(dest="ck_command", required=True)
    ck_list = cks.add_parser("list", parents=[common], help="every checkpoint with validity and its tiers")
    ck_verify = cks.add_parser("verify", parents=[common],
                               help="re-read every shard of STEP on every tier (exit 1 on a mismatch)")
    ck_verify.add_argument("step", type=int)
    ck_rb = cks.add_parser("rollback", parents=[common], help="make STEP the restore target of the next (re)start")
    ck_rb.add_argument("--to", type=int, required=True, dest="to_step")
    ck_forget = cks.add_parser("forget", parents=[common],
                               help="remove every catalog record of JOB (closed; the files stay on the tiers)")
    ck_forget.add_argument("forget_job", metavar="JOB")
    ck_forget.add_argument("--reason", default="", help="why, for the event log")
    ck_forget.add_argument("--json", action="store_true")
    ck_mig = cks.add_parser("migrations", parents=[common], help="migrations between tiers, with progress bars")
    ck_mig.add_argument("--watch", type=float, default=0.0, help="keep refreshing for this many seconds")
    for cmd in (ck_list, ck_verify, ck_rb, ck_mig):
        cmd.add_argument("--job", help="the job (default: the only one in the catalog)")
        cmd.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="start a local cluster, kill a node for real, show the recovery")
    demo.add_argument("--nodes", type=int, default=2)
    demo.add_argument("--spares", type=int, default=1)
    demo.add_argument("--keep", action="store_true", help="leave the cluster running (stop it with ftctl down)")
    demo.add_argument("--s3-endpoint", default="", help="add an S3-compatible cold tier at this URL")
    demo.add_argument("--s3", action="store_true",
                      help="start moto's S3 server as the cold tier (in its own namespace with --isolate; dev extra)")
    demo.add_argument("--report", type=Path, default=Path(tempfile.gettempdir()) / "ftd-demo-report.html",
                      help="where to write the drill's HTML report (default: %(default)s)")
    demo.add_argument("--preempt", action="store_true",
                      help="deliver a spot preemption notice instead of killing the node: a planned hand-over")
    demo.add_argument("--straggler", action="store_true",
                      help="make a node slow instead of killing it (its processes held to a fifth of a CPU): the "
                           "coordinator's straggler watch hands its rank over to the spare with no step lost")
    demo.add_argument("--nan", action="store_true",
                      help="make one rank's loss NaN at a step instead (once): the coordinator rolls the job back "
                           "to the newest checkpoint before it and the rerun is clean")
    demo.add_argument("--json", action="store_true")
    _isolate_options(demo)

    hc = sub.add_parser("health", help="run the health checks of every node (or NODE) now, with values and thresholds")
    hc.add_argument("node", metavar="NODE", nargs="?")
    hc.add_argument("--clear-gpu-faults", action="store_true",
                    help="forget the XIDs that keep NODE unhealthy (after resetting the GPU), then check it")
    hc.add_argument("--json", action="store_true")

    cj = sub.add_parser("close-job", help="close JOB: its nodes stop joining rounds (a finished or made-up job)")
    cj.add_argument("job", metavar="JOB")
    cj.add_argument("--reason", default="closed by ftctl", help="recorded in the event log and shown in status")

    dr = sub.add_parser("drain", help="hand NODE's rank over to a spare after a final checkpoint (maintenance)")
    dr.add_argument("node", metavar="NODE")
    dr.add_argument("--reason", default="ftctl drain", help="recorded in the event log and shown in status")
    dr.add_argument("--deadline-s", type=float, default=0.0,
                    help="the node goes away in this many seconds: hand over by then even without a final "
                         "checkpoint (default: wait for it, up to the coordinator's handover_max_wait_s)")
    dr.add_argument("--wait", action="store_true", help="wait until the hand-over is committed")
    dr.add_argument("--json", action="store_true")

    certs.register(sub)

    ad = sub.add_parser("admit", help="let NODE register as active (a new node is a spare until admitted), or come "
                                      "back after a drain")
    ad.add_argument("node", metavar="NODE")
    ad.add_argument("--spare", action="store_true", help="admit it as a spare only (e.g. back after a drain)")

    d = sub.add_parser("drill", help="fault drills against the live cluster, with the measured recovery")
    which = d.add_mutually_exclusive_group(required=True)
    which.add_argument("--kill-node", metavar="NODE", help="SIGKILL this node's training workers and agent")
    which.add_argument("--kill-worker", metavar="NODE", help="SIGKILL one training process of this node")
    which.add_argument("--hang-node", metavar="NODE", help="SIGSTOP this node's training workers (a hang)")
    d.add_argument("--target-recover-s", type=float, default=60.0, help="recovery SLO [s] (default 60)")
    d.add_argument("--report", type=Path, help="also write an HTML report with a timeline chart to this file")
    d.add_argument("--token-file", type=Path,
                   help=f"only for agents configured with a drill token (a second factor to the operator "
                        f"certificate): a file holding it (or env {ENV_DRILL_TOKEN})")
    d.add_argument("--target-detect-s", type=float, default=3.0, help="detection SLO [s] (default 3)")
    d.add_argument("--drill-timeout", type=float, default=180.0, help="give up measuring after [s]")
    d.add_argument("--json", action="store_true")
    return p


def _isolate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isolate", action="store_true",
                   help="every etcd member, coordinator and node in its own network namespace with its own "
                        "address on a bridge of its own, node directories not shared (needs root: CAP_NET_ADMIN, "
                        "CAP_SYS_ADMIN)")
    p.add_argument("--shared-hdd", action="store_true",
                   help="with --isolate: one HDD directory shared by every node (default: each node its own)")


def _run_isolated(args: argparse.Namespace, argv: Sequence[str], workdir: Path, nodes: int, spares: int,
                  coordinators: int, keep: bool, etcd: int = 1) -> int:
    """The root-namespace half of ``up``/``demo --isolate``: creates the lab of ``workdir`` (removing a
    crashed one there first), runs ``ftctl ARGV`` inside its ctl namespace, and removes the lab again
    when that fails or ``keep`` is false."""
    if args.s3_endpoint or getattr(args, "etcd_endpoints", None):
        raise UsageError("--isolate starts its own etcd and cannot reach an external etcd or S3 endpoint")
    isolated.check()
    localcluster.refuse_running(workdir)
    iso = isolated.prepare(workdir, isolated.host_names(nodes, spares, coordinators, etcd, s3=args.s3))
    print(f"isolated: lab {iso['prefix']} on {iso['subnet']}, {len(iso['hosts'])} network namespaces "
          f"(ftctl runs in {iso['ctl']})", file=sys.stderr)
    rc = 1
    try:
        rc = isolated.reexec(iso, argv)
    finally:
        if rc != 0 or not keep:
            isolated.teardown(workdir)
            print(f"isolated: lab {iso['prefix']} removed", file=sys.stderr)
    return rc


def _train_options(args: argparse.Namespace) -> localcluster.TrainOptions | None:
    """``up``'s training flags as the agents' job (``None`` without ``--train-cmd``)."""
    if not args.train_cmd:
        given = [flag for flag, value, default in (
            ("--nproc-per-node", args.nproc_per_node, 1), ("--job", args.job, "train"),
            ("--min-nodes", args.min_nodes, 0), ("--max-restarts", args.max_restarts, 10),
            ("--on-no-spare", args.on_no_spare, "shrink"), ("--hang-timeout-s", args.hang_timeout_s, 120.0),
            ("--launcher", args.launcher, "warm")) if value != default]
        if given:
            raise UsageError(f"{', '.join(given)} without --train-cmd: there is no training job to configure")
        return None
    if args.nproc_per_node < 1 or args.min_nodes < 0 or args.max_restarts < 0 or args.hang_timeout_s < 0:
        raise UsageError("need --nproc-per-node >= 1, --min-nodes >= 0, --max-restarts >= 0, --hang-timeout-s >= 0")
    if args.min_nodes > args.nodes:
        raise UsageError(f"--min-nodes {args.min_nodes} is more than the {args.nodes} active node(s)")
    try:
        cmd = localcluster.train_command(args.train_cmd)
    except localcluster.ClusterError as exc:
        raise UsageError(str(exc)) from exc
    return localcluster.TrainOptions(cmd=cmd, job=args.job, nproc_per_node=args.nproc_per_node,
                                     min_nodes=args.min_nodes, max_restarts=args.max_restarts,
                                     hang_timeout_s=args.hang_timeout_s, launcher=args.launcher,
                                     on_no_spare=args.on_no_spare)


def _flag_or_env(args: argparse.Namespace, env: dict[str, str], flag: str, env_name: str,
                 from_cluster: Callable[[localcluster.ClusterFile], str], secret: bool = False) -> str | None:
    """A flag, else its environment variable (both set and different: an error, as etcdctl does),
    else the value of the local cluster in ``--workdir``; ``None`` when there is nothing."""
    given, from_env = getattr(args, flag), env.get(env_name)
    if given and from_env and given != from_env:
        shown = f"--{flag}" if secret else f"--{flag}={given}"
        raise UsageError(f"{shown} conflicts with {env_name}{'' if secret else '=' + from_env}; unset one of them")
    if given or from_env:
        return str(given or from_env)
    if args.workdir is not None:
        return from_cluster(localcluster.ClusterFile.load(args.workdir.resolve()))
    return None


def _resolve_coordinator(args: argparse.Namespace, env: dict[str, str]) -> str:
    found = _flag_or_env(args, env, "coordinator", ENV_COORDINATOR, lambda c: c.coordinator_endpoints)
    return found or DEFAULT_COORDINATOR


def _certs_connect(args: argparse.Namespace, env: dict[str, str]) -> Callable[[], CoordinatorClient] | None:
    """How ``ftctl certs revoke|rotate`` reaches the coordinator: only when one is named (``--coordinator``,
    the environment, a local cluster's ``--workdir``); a PKI directory alone is an offline CA."""
    workdir = getattr(args, "workdir", None)
    named = (getattr(args, "coordinator", None) or env.get(ENV_COORDINATOR)
             or (workdir is not None and localcluster.ClusterFile.path(workdir.resolve()).exists()))
    if not named:
        return None
    return lambda: CoordinatorClient(_resolve_coordinator(args, env), timeout_s=getattr(args, "timeout", None) or 5.0,
                                     tls=resolve_identity(args, env))


def _resolve_token(args: argparse.Namespace, env: dict[str, str]) -> str:
    """The optional second factor of a drill ("" = none: the operator certificate authorises it)."""
    path: Path | None = args.token_file
    from_env = env.get(ENV_DRILL_TOKEN)
    if path is not None and from_env:
        raise UsageError(f"--token-file conflicts with {ENV_DRILL_TOKEN}; unset one of them")
    if path is None:
        return from_env or ""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"--token-file {path} is unreadable: {exc.strerror or exc}") from exc
    if not token:
        raise UsageError(f"--token-file {path} is empty")
    return token


def resolve_identity(args: argparse.Namespace, env: dict[str, str]) -> IdentityFiles | None:
    """The operator certificate ftctl dials with: ``--pki-dir``/``$FTD_PKI_DIR``, else the local
    cluster's of ``--workdir``; ``None`` (plaintext) when there is none. Loaded once here, so that a
    missing or bad file is reported by name (:class:`~ftd.identity.PkiError`)."""
    given, from_env = getattr(args, "pki_dir", None), env.get(ENV_PKI_DIR)
    if given and from_env and Path(from_env) != given:
        raise UsageError(f"--pki-dir={given} conflicts with {ENV_PKI_DIR}={from_env}; unset one of them")
    root = given or (Path(from_env) if from_env else None)
    if root is None and args.workdir is not None:
        cluster = localcluster.ClusterFile.load(args.workdir.resolve())
        root = Path(cluster.pki_dir) if cluster.pki_dir else None
    if root is None:
        return None
    name = args.operator or env.get(ENV_OPERATOR) or DEFAULT_OPERATOR
    try:
        files = IdentityFiles(root, "operator", name)
    except PkiError as exc:
        raise UsageError(str(exc)) from exc
    files.load()
    return files


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))


def run(argv: Sequence[str], env: dict[str, str]) -> int:
    args = _parser().parse_args(list(argv))
    inside = os.environ.get(isolated.ENV_INSIDE)  # the re-executed ftctl of an isolated cluster
    if args.command == "up":
        if args.workdir is None:
            raise UsageError("ftctl up needs --workdir DIR")
        if args.isolate and not inside:
            return _run_isolated(args, argv, args.workdir.resolve(), args.nodes, args.spares, args.coordinators,
                                 keep=True, etcd=args.etcd_members)
        train = _train_options(args)
        cluster = localcluster.up(args.workdir, args.nodes, args.spares, args.coordinators, args.etcd_endpoints,
                                  args.racks, args.start_timeout, s3_endpoint=args.s3_endpoint,
                                  s3_bucket=args.s3_bucket, train=train,
                                  shared_hdd=not args.isolate or args.shared_hdd,
                                  isolate=args.isolate, etcd_members=args.etcd_members, s3=args.s3,
                                  etcd_v3_rendezvous=args.etcd_v3_rendezvous)
        print(f"cluster up in {cluster.workdir}: {args.nodes} active + {args.spares} spare nodes, "
              f"etcd {cluster.etcd_endpoints}")
        if train is not None:
            print(f"training: job {train.job}, {train.nproc_per_node} rank(s) per node ({train.launcher} launcher), "
                  f"at least {train.min_nodes or args.nodes} node(s): {train.cmd}; worker logs in "
                  f"{cluster.workdir}/nodes/NODE/train.log")
        print(f"coordinator: {cluster.coordinator_endpoints} (mTLS; operator certificate in {cluster.pki_dir})")
        if cluster.isolation:
            print(f"isolated: lab {cluster.isolation['prefix']} on {cluster.isolation['subnet']}, reachable only from "
                  f"its namespaces: 'ftctl --workdir {cluster.workdir} ...' runs in {cluster.isolation['ctl']}")
        else:
            print(f"  export {ENV_COORDINATOR}={cluster.coordinator_endpoints} {ENV_PKI_DIR}={cluster.pki_dir}")
        return 0
    if args.command == "demo":
        say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
        if args.isolate and not inside:
            work = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="ftd-demo-"))
            try:
                return _run_isolated(args, [*argv, "--workdir", str(work)], work / "cluster", args.nodes,
                                     args.spares, 1, keep=args.keep)
            finally:
                if args.workdir is None and not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
        if args.nan:
            outcome = nan_demo.run(args.workdir, args.nodes, args.keep, say=say, isolate=args.isolate,
                                   shared_hdd=not args.isolate or args.shared_hdd)
            if args.json:
                _print_json(outcome)
            return 0 if outcome["passed"] else 1
        outcome = demo.run_demo(args.workdir, args.nodes, args.spares, args.keep, say=say,
                                s3_endpoint=args.s3_endpoint, preempt=args.preempt, isolate=args.isolate,
                                shared_hdd=not args.isolate or args.shared_hdd, s3=args.s3,
                                straggler=args.straggler)
        report.write(outcome["drill"], args.report)
        say(f"drill report: {args.report}")
        if args.json:
            _print_json({**outcome, "report": str(args.report)})
        return 0 if outcome["passed"] else 1
    if args.command == "certs":
        return certs.run(args, env, _certs_connect(args, env))
    if args.command == "down":
        if args.workdir is None:
            raise UsageError("ftctl down needs --workdir DIR")
        workdir = args.workdir.resolve()
        lab = isolated.load(workdir)
        if lab:
            isolated.check()
        if localcluster.ClusterFile.path(workdir).exists() or not lab:
            stopped = localcluster.stop(localcluster.ClusterFile.load(workdir))
            print(f"stopped {len(stopped)} processes: {', '.join(stopped) or 'none were running'}")
        if lab and (prefix := isolated.teardown(workdir)):
            print(f"removed network lab {prefix}: its namespaces, veths, bridge and rules")
        return 0

    if args.workdir is not None:
        cluster = localcluster.ClusterFile.load(args.workdir.resolve())
        if cluster.isolation and not isolated.inside(cluster.isolation):
            return isolated.reexec(cluster.isolation, argv)
    tls = resolve_identity(args, env)
    try:
        client = CoordinatorClient(_resolve_coordinator(args, env), timeout_s=args.timeout or 5.0, tls=tls)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        if args.command == "status":
            data = status_dict(client.status())
            if data["job"]:
                data["goodput"] = goodput.summary(client, data["job"]["id"])
            _print_json(data) if args.json else print(render.status(data))
        elif args.command == "goodput":
            try:
                since = goodput.parse_duration(args.since) if args.since else 0.0
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
            data = goodput.fetch(client, args.job, since)
            _print_json(data) if args.json else print(goodput.render(data))
        elif args.command == "nodes":
            nodes = [node_dict(n) for n in client.nodes().nodes]
            _print_json(nodes) if args.json else print(render.nodes(nodes))
        elif args.command == "events":
            events = [json_format.MessageToDict(e, preserving_proto_field_name=True)
                      for e in client.events(args.limit).events]
            _print_json(events) if args.json else print(render.events(events))
        elif args.command == "checkpoints":
            return _checkpoints(client, args)
        elif args.command == "close-job":
            info = client.call("CloseJob", coordinator_pb2.CloseJobRequest(job=args.job, reason=args.reason),
                               idempotent=True)
            print(f"job {info.job}: closed ({info.message})")
            return 0
        elif args.command == "drain":
            return _drain(client, args)
        elif args.command == "admit":
            print(client.call("Admit", coordinator_pb2.AdmitRequest(node_id=args.node, spare=args.spare),
                              idempotent=True).message)
        elif args.command == "health":
            if args.clear_gpu_faults and not args.node:
                raise health.HealthCommandError("--clear-gpu-faults needs a NODE")
            rows = ([health.clear_gpu_faults(client, args.node)] if args.clear_gpu_faults
                    else health.check(client, args.node))
            _print_json(rows) if args.json else print(health.render(rows))
            return 0 if all(r["healthy"] is not False for r in rows) else 1
        elif args.command == "drill":
            mode, node = (("node", args.kill_node) if args.kill_node else ("worker", args.kill_worker)
                          if args.kill_worker else ("hang", args.hang_node))
            result = drill.run(client, node, _resolve_token(args, env), mode, args.target_detect_s,
                               args.target_recover_s, args.drill_timeout)
            _print_json(result.as_dict()) if args.json else print(render.drill(result.as_dict()))
            if args.report:
                report.write(result.as_dict(), args.report)
                print(f"report: {args.report}", file=sys.stderr)
            return 0 if result.passed else 1
        return 0
    finally:
        client.close()


def _drain(client: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.deadline_s < 0:
        raise UsageError(f"--deadline-s must be >= 0, got {args.deadline_s}")
    deadline = time.time() + args.deadline_s if args.deadline_s else 0.0
    reply = client.call("Drain", coordinator_pb2.DrainRequest(node_id=args.node, reason=args.reason,
                                                              deadline_unix_s=deadline), idempotent=True)
    result: dict[str, Any] = {"node": args.node, "accepted": reply.accepted, "message": reply.message}
    if args.wait:
        started = time.monotonic()
        budget = (args.deadline_s or 120.0) + 30.0
        while args.node in client.status().draining:
            if time.monotonic() - started > budget:
                raise DrainTimeout(f"the hand-over of {args.node} was not committed within {budget:.0f}s")
            time.sleep(0.2)
        status = client.status()
        result.update(handover_s=round(time.monotonic() - started, 2), epoch=status.epoch, world=list(status.world))
    if args.json:
        _print_json(result)
    else:
        print(reply.message)
        if args.wait:
            print(f"handed over after {result['handover_s']}s: epoch {result['epoch']}, world {result['world']}")
    return 0


def _checkpoints(client: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.ck_command == "migrations":
        if args.json:
            _print_json(checkpoints.migrations(client))
        else:
            checkpoints.watch_migrations(client, args.watch)
        return 0
    if args.ck_command == "forget":
        result = checkpoints.forget(client, args.forget_job, args.reason)
        if args.json:
            _print_json(result)
        else:
            print(f"job {result['job']}: forgot steps {result['removed_steps'] or 'none'}")
        return 0
    job = checkpoints.resolve_job(client, args.job)
    if args.ck_command == "list":
        alive = checkpoints.alive_nodes(client)
        rows = [checkpoints.as_dict(c, alive) for c in checkpoints.checkpoints(client, job)]
        _print_json(rows) if args.json else print(render.checkpoints(rows))
        return 0
    if args.ck_command == "rollback":
        result = checkpoints.rollback(client, job, args.to_step)
        if args.json:
            _print_json(result)
        else:
            print(f"job {job}: step {result['restore_target']} is the restore target of the next (re)start; "
                  f"removed newer steps: {result['removed_steps'] or 'none'}")
        return 0
    progress = checkpoints.VerifyProgress() if (not args.json and sys.stderr.isatty()) else None
    rows = checkpoints.verify(client, job, args.step, progress)
    bad = [r for r in rows if not r["ok"]]
    if args.json:
        _print_json({"job": job, "step": args.step, "ok": not bad, "copies": rows})
    else:
        print(render.verify(rows))
        for r in bad:
            print(f"MISMATCH rank {r['rank']} on {r['tier']}@{r['location']}: {r['error']}", file=sys.stderr)
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv, dict(os.environ))
    except UsageError as exc:
        print(f"ftctl: {exc}", file=sys.stderr)
        return 2
    except netlab.MissingPrivileges as exc:
        print(f"ftctl: --isolate needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN and the tools ip, tc, nft: "
              f"missing {', '.join(exc.missing)}", file=sys.stderr)
        return 2
    except CoordinatorUnreachable as exc:
        print(f"ftctl: {exc}", file=sys.stderr)
        return 3
    except grpc.RpcError as exc:
        code = rpc_code(exc)
        print(f"ftctl: coordinator answered {code.name if code else '?'}: {rpc_details(exc)}", file=sys.stderr)
        return 1
    except (localcluster.ClusterError, drill.DrillError, checkpoints.CheckpointCommandError, DrainTimeout,
            health.HealthCommandError, PkiError, netlab.NetlabError) as exc:
        print(f"ftctl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
