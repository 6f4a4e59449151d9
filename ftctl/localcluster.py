"""``ftctl up`` / ``ftctl down``: a whole ftd cluster on this machine, as separate background processes.

An etcd started for us on free loopback ports (data under the workdir: the embedded default), one or
more coordinator replicas, and N active + S spare agents, each with its own node directory. What was
started is recorded in ``DIR/cluster.json``; ``down`` stops exactly those processes, after checking
that each pid still runs a command line naming the workdir (a pid can be reused).

Secure by default, as a real cluster: ``DIR/pki`` holds the cluster's PKI (:func:`ftd.ca.bootstrap`:
a CA, the operator, and per node, coordinator and etcd member its certificate); every gRPC hop is
mutual TLS with the authorization table enforced, the embedded etcd requires client certificates and
has its auth on (:mod:`.etcd_server`), and drills are authorised by the operator certificate (no
token anywhere). The process that ran :func:`up` dials the cluster with the operator certificate by
default (:func:`ftd.client.remember_identity`); ``ftctl --workdir DIR`` does too.

``train`` (``ftctl up --train-cmd SCRIPT --nproc-per-node N --job J [--min-nodes M]``,
:class:`TrainOptions`): every agent runs the job, N local ranks of it while its node holds a rank (on
the warm launcher its standby workers run the script's ``prepare()`` ahead; docs/training.md, "Your
own script"); the command is normalised first (:func:`train_command`).

``isolate`` (``ftctl up --isolate``, :mod:`.isolated`): every etcd member, coordinator replica and node
in its own network namespace with its own address on a lab bridge (``DIR/net``), ports fixed, the
certificates issued for those addresses; ``ClusterFile.isolation`` records the lab, and ftctl reaches
the cluster from the lab's ``ctl`` namespace.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from ftd.ca import bootstrap, issue
from ftd.client import CoordinatorClient, remember_identity
from ftd.identity import DEFAULT_OPERATOR, IdentityFiles

from . import isolated, s3_server
from .etcd_server import EtcdCluster, free_port, renew_without_etcd_name

CLUSTER = "local"  # the cluster name of every local cluster (its PKI and its coordinators' --cluster)


class ClusterError(RuntimeError):
    pass


_PYTHON = re.compile(r"python[0-9.]*")
P = ParamSpec("P")
R = TypeVar("R")


def train_command(cmd: str, cwd: Path | None = None) -> str:
    """A training command as every agent runs it: torchrun's form (``SCRIPT ARGS...`` or ``-m MODULE
    ARGS...``), a leading ``python`` (as a user would type it) dropped, and a script given relative to
    ``cwd`` made absolute, so that agents and standby workers find it wherever they run."""
    try:
        argv = shlex.split(cmd)
    except ValueError as exc:
        raise ClusterError(f"--train-cmd {cmd!r} is not a command line: {exc}") from exc
    if argv and (argv[0] == sys.executable or _PYTHON.fullmatch(Path(argv[0]).name)):
        argv = argv[1:]
    if not argv:
        raise ClusterError(f"--train-cmd {cmd!r} names no script or module")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ClusterError(f"--train-cmd {cmd!r}: '-m' without a module")
        return shlex.join(argv)
    if argv[0].startswith("-"):
        raise ClusterError(f"--train-cmd {cmd!r} starts with the option {argv[0]!r}: give a script or '-m MODULE'")
    script = Path(argv[0]) if Path(argv[0]).is_absolute() else (cwd or Path.cwd()) / argv[0]
    if not script.is_file():
        raise ClusterError(f"--train-cmd {cmd!r}: no script {script}")
    return shlex.join([str(script.resolve()), *argv[1:]])


@dataclass(frozen=True)
class TrainOptions:
    """A training job for every agent to run with the ftd rendezvous (``ftctl up --train-cmd``): on the
    warm path (standby workers started by the agent) or under ``torchrun --rdzv-backend=ftd``. ``cmd``
    is torchrun's form (:func:`train_command` makes it so); every agent runs ``nproc_per_node`` local
    ranks of it."""

    cmd: str
    job: str = "train"
    nproc_per_node: int = 1
    min_nodes: int = 0  # 0: all the active nodes
    max_restarts: int = 10
    hang_timeout_s: float = 120.0
    launcher: str = "warm"
    on_no_spare: str = "shrink"  # or "wait": what the job does when a node is lost and no spare is left

    def coordinator_args(self, nodes: int) -> list[str]:
        """The job's parameters are the coordinator's (the operator's), not whoever joins first."""
        return ["--job-min-nodes", str(self.min_nodes or nodes), "--job-max-restarts", str(self.max_restarts),
                "--job-on-no-spare", self.on_no_spare]

    def agent_args(self, nodes: int) -> list[str]:
        return ["--train-cmd", self.cmd, "--train-job", self.job, "--nproc-per-node", str(self.nproc_per_node),
                "--min-nodes", str(self.min_nodes or nodes), "--max-nodes", str(max(nodes, self.min_nodes)),
                "--max-restarts", str(self.max_restarts), "--hang-timeout-s", str(self.hang_timeout_s),
                "--launcher", self.launcher, "--on-no-spare", self.on_no_spare]


@dataclass
class Proc:
    name: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterFile:
    workdir: str
    coordinator_endpoints: str
    etcd_endpoints: str
    etcd_external: bool
    etcd: list[Proc] = field(default_factory=list)
    coordinators: list[Proc] = field(default_factory=list)
    agents: list[Proc] = field(default_factory=list)
    s3: list[Proc] = field(default_factory=list)  # moto's S3 server when started by ``up(s3=True)``
    created_unix_s: float = 0.0
    s3_endpoint: str = ""
    s3_bucket: str = ""
    pki_dir: str = ""  # the cluster's PKI ("" : a plaintext cluster of an older ftctl)
    cluster: str = CLUSTER
    shared_hdd: bool = True  # False: each node's HDD tier is its own (no shared filesystem)
    isolation: dict[str, Any] = field(default_factory=dict)  # the lab (:func:`.isolated.load`); {}: loopback
    etcd_v3_rendezvous: bool = False  # the nodes' rendezvous certificates reach etcd (torchrun's etcd-v3)

    @staticmethod
    def path(workdir: Path) -> Path:
        return workdir / "cluster.json"

    @property
    def drill_token(self) -> str:
        """Always "": drills are authorised by the operator certificate (:meth:`operator`); kept for
        callers of :func:`ftd.ftctl.drill.run`, whose ``token`` is an optional second factor."""
        return ""

    def identity(self, kind: str, name: str) -> IdentityFiles | None:
        """The certificate files of ``kind``/``name`` in this cluster's PKI (``None``: plaintext)."""
        return IdentityFiles(Path(self.pki_dir), kind, name) if self.pki_dir else None

    @property
    def operator(self) -> IdentityFiles | None:
        """The default operator's certificate: what ftctl and tests dial the cluster with."""
        return self.identity("operator", DEFAULT_OPERATOR)

    def client(self, timeout_s: float = 5.0) -> CoordinatorClient:
        """A client of this cluster's coordinators as its operator."""
        return CoordinatorClient(self.coordinator_endpoints, timeout_s=timeout_s, tls=self.operator)

    def save(self) -> None:
        path = self.path(Path(self.workdir))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, workdir: Path) -> ClusterFile:
        path = cls.path(workdir)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ClusterError(f"{path} does not exist: no cluster was started with --workdir {workdir}") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ClusterError(f"{path} is unreadable: {exc}") from exc
        try:
            data.pop("drill_token", None)  # written by older versions; drills need no token now
            for key in ("etcd", "coordinators", "agents", "s3"):
                data[key] = [Proc(**p) for p in data.get(key, [])]
            return cls(**data)
        except TypeError as exc:
            raise ClusterError(f"{path} is not an ftctl cluster file: {exc}") from exc

    def all_procs(self) -> list[Proc]:
        return [*self.agents, *self.coordinators, *self.etcd, *self.s3]


def _wait_file(path: Path, proc: subprocess.Popen[bytes], deadline: float, log: Path) -> dict[str, Any]:
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            raise ClusterError(f"{path.stem} exited with code {proc.returncode} before serving: {_tail(log)}")
        time.sleep(0.05)
    raise ClusterError(f"{path.stem} did not become ready in time: {_tail(log)}")


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"


def refuse_running(workdir: Path) -> None:
    """Raises when a cluster started from ``workdir`` still runs (a crashed isolated one is not counted:
    its lab owns its processes and the next ``up --isolate`` removes them)."""
    if ClusterFile.path(workdir).exists():
        existing = ClusterFile.load(workdir)
        if not existing.isolation and any(_owned(p, workdir) for p in existing.all_procs()):
            raise ClusterError(f"a cluster already runs from {workdir}; run 'ftctl down --workdir {workdir}' first")


def _spawn(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, **env} if env else None)


def _private_files(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs ``fn`` with umask 0077 (restored after): the PKI, cluster.json, logs and every tier's
    checkpoints it and the processes it starts create are the caller's alone, whatever its umask."""
    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        previous = os.umask(0o077)
        try:
            return fn(*args, **kwargs)
        finally:
            os.umask(previous)
    return wrapped


@_private_files
def up(
    workdir: Path,
    nodes: int,
    spares: int,
    coordinators: int = 1,
    etcd_endpoints: str | None = None,
    racks: int = 0,
    timeout_s: float = 60.0,
    extra_coordinator_args: list[str] | None = None,
    extra_agent_args: list[str] | None = None,
    s3_endpoint: str = "",
    s3_bucket: str = "ftd-checkpoints",
    train: TrainOptions | None = None,
    shared_hdd: bool = True,
    isolate: bool = False,
    etcd_members: int = 1,
    s3: bool = False,
    unmanaged_jobs: bool = False,
    etcd_quota_bytes: int = 0,
    etcd_v3_rendezvous: bool = False,
) -> ClusterFile:
    """Starts the cluster and returns once every agent is alive and the world has ``nodes`` ranks.
    ``isolate``: in the lab that :func:`.isolated.prepare` made for ``workdir`` (run from its ctl host).
    ``etcd_members``: the embedded etcd's size (3 or 5 survive the loss of a member). ``s3``: moto's S3
    server as the cold tier (in the lab host ``s3`` when isolated). ``unmanaged_jobs``: the coordinator
    records checkpoints of jobs that do not rendezvous through ftd (a Checkpointer per rank without
    torchrun: tests and benchmarks; docs/security.md). ``etcd_v3_rendezvous``: the nodes' rendezvous
    certificates carry etcd's client name, for ``torchrun --rdzv-backend=etcd-v3``; by default no
    certificate a node holds reaches etcd (docs/security.md#etcd-least-privilege-and-space)."""
    if nodes < 1 or spares < 0 or coordinators < 1 or etcd_members < 1:
        raise ClusterError("need --nodes >= 1, --spares >= 0, --coordinators >= 1 and --etcd-members >= 1")
    if s3 and s3_endpoint:
        raise ClusterError("--s3 starts its own S3 server; it cannot be combined with --s3-endpoint")
    if s3 and not s3_server.available():
        raise ClusterError("--s3 needs moto's S3 server: ./install.sh --dev (pip install 'moto[s3,server]')")
    workdir = workdir.resolve()
    iso = isolated.load(workdir) if isolate else {}
    if isolate and not iso:
        raise ClusterError(f"no network lab in {workdir / isolated.LAB_DIR}: start an isolated cluster with "
                           "'ftctl up --isolate' (it creates the lab in the root namespace)")
    if iso and (etcd_endpoints is not None or s3_endpoint):
        raise ClusterError("--isolate starts its own etcd and has no route to an external etcd or S3 endpoint")
    if ClusterFile.path(workdir).exists():
        existing = ClusterFile.load(workdir)
        if any(_owned(p, workdir) for p in existing.all_procs()):
            raise ClusterError(f"a cluster already runs from {workdir}; run 'ftctl down --workdir {workdir}' first")
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    (workdir / "run").mkdir(exist_ok=True)
    for stale in (workdir / "run").glob("*.json"):
        stale.unlink()
    deadline = time.monotonic() + timeout_s
    pki_dir = workdir / "pki"
    if iso:  # every certificate for its host's address (issued afresh: a new lab has new addresses)
        bootstrap(pki_dir, CLUSTER)
        identities = [*(("etcd", f"etcd{i}", f"etcd-{i}") for i in range(etcd_members)),
                      *(("coordinator", f"coordinator-{i}", f"coordinator-{i}") for i in range(coordinators)),
                      *((kind, f"node-{i}", f"node-{i}") for i in range(nodes + spares)
                        for kind in ("node", "rendezvous"))]
        for kind, name, host in identities:
            issue(pki_dir, kind, name, hosts=[isolated.address(iso, host)], force=True,
                  etcd_client=etcd_v3_rendezvous if kind == "rendezvous" else None)
    else:
        bootstrap(pki_dir, CLUSTER, nodes=[f"node-{i}" for i in range(nodes + spares)],
                  coordinators=[f"coordinator-{i}" for i in range(coordinators)],
                  etcd_rendezvous=etcd_v3_rendezvous)
        renew_without_etcd_name(pki_dir)  # issued before etcd admitted clients by name
    cluster = ClusterFile(str(workdir), "", etcd_endpoints or "", etcd_endpoints is not None,
                          created_unix_s=time.time(), s3_endpoint=s3_endpoint,
                          s3_bucket=s3_bucket if s3_endpoint else "", pki_dir=str(pki_dir), shared_hdd=shared_hdd,
                          isolation=iso, etcd_v3_rendezvous=etcd_v3_rendezvous)
    try:
        if etcd_endpoints is None:
            if iso:
                etcd: EtcdCluster = isolated.LabEtcd(
                    workdir / "etcd", size=etcd_members, detach=True, pki_dir=pki_dir, auth=True,
                    hosts=[isolated.address(iso, f"etcd-{i}") for i in range(etcd_members)])
                etcd.isolation = iso  # type: ignore[attr-defined]
            else:
                etcd = EtcdCluster(workdir / "etcd", size=etcd_members, detach=True, pki_dir=pki_dir, auth=True,
                                   quota_bytes=etcd_quota_bytes)
            etcd.start(timeout_s=min(20.0, timeout_s))
            cluster.etcd_endpoints = etcd.endpoints
            cluster.etcd = [Proc(m.name, m.pid or 0, {"client_url": m.client_url, "data_dir": str(m.data_dir)})
                            for m in etcd.members]
            cluster.save()
        if s3:
            start_s3(cluster, s3_bucket, deadline)
        py = sys.executable
        for i in range(coordinators):
            ready = workdir / "run" / f"coordinator-{i}.json"
            log = workdir / "logs" / f"coordinator-{i}.log"
            own = cluster.identity("coordinator", f"coordinator-{i}")
            assert own is not None
            # The embedded etcd: TLS with the replica's own certificate (CN ftd-coordinator, etcd's user).
            etcd_tls = [] if cluster.etcd_external else [
                "--etcd-ca-file", str(own.ca_path), "--etcd-cert-file", str(own.cert_path),
                "--etcd-key-file", str(own.key_path)]
            if iso:
                addr = isolated.address(iso, f"coordinator-{i}")
                listen = [f"{addr}:{isolated.COORDINATOR_PORT}", f"{addr}:{isolated.COORDINATOR_METRICS_PORT}"]
            else:
                listen = ["127.0.0.1:0", "127.0.0.1:0"]
            argv = [py, "-m", "ftd.coordinator.main", "--etcd-endpoints", cluster.etcd_endpoints,
                    "--listen", listen[0], "--metrics-listen", listen[1],
                    "--replica-id", f"coordinator-{i}", "--cluster", CLUSTER, "--pki-dir", str(pki_dir),
                    *etcd_tls, "--ready-file", str(ready), *(train.coordinator_args(nodes) if train else []),
                    *(["--unmanaged-jobs"] if unmanaged_jobs else []),
                    # the initial active nodes, admitted by the operator who creates the cluster; any other
                    # node registers as a spare until 'ftctl admit' (docs/security.md#admission)
                    "--admitted-nodes", ",".join(f"node-{n}" for n in range(nodes)),
                    *(["--etcd-quota-bytes", str(etcd_quota_bytes)] if etcd_quota_bytes else []),
                    *(extra_coordinator_args or [])]
            proc = _spawn(isolated.wrap(iso, f"coordinator-{i}", argv) if iso else argv, log)
            cluster.coordinators.append(Proc(f"coordinator-{i}", proc.pid))
            cluster.save()
            cluster.coordinators[-1].info = _wait_file(ready, proc, deadline, log)
        cluster.coordinator_endpoints = ",".join(c.info["address"] for c in cluster.coordinators)
        cluster.save()
        operator = cluster.operator
        assert operator is not None
        remember_identity(cluster.coordinator_endpoints, operator)
        started = []
        for i in range(nodes + spares):
            labels = {"rack": f"r{i % racks}"} if racks else {}
            started.append(spawn_agent(cluster, f"node-{i}", "active" if i < nodes else "spare", labels,
                                       [*(extra_agent_args or []), *(train.agent_args(nodes) if train else [])]))
        for agent, (proc, ready, log) in zip(cluster.agents, started, strict=True):
            agent.info.update(_wait_file(ready, proc, deadline, log))
        cluster.save()
        wait_formed(cluster.coordinator_endpoints, nodes, spares, deadline, tls=operator)
        return cluster
    except BaseException:
        stop(cluster)
        raise


def start_s3(cluster: ClusterFile, bucket: str, deadline: float) -> None:
    """moto's S3 server for ``cluster`` (lab host ``s3`` when isolated, else a free loopback port), its
    bucket created; the agents get its endpoint and test credentials."""
    workdir = Path(cluster.workdir)
    iso = cluster.isolation
    host, port = (isolated.address(iso, "s3"), s3_server.PORT) if iso else ("127.0.0.1", free_port())
    argv = s3_server.command(workdir, host, port)
    log = workdir / "logs" / "s3.log"
    proc = _spawn(isolated.wrap(iso, "s3", argv) if iso else argv, log)
    cluster.s3 = [Proc("s3", proc.pid, {"endpoint": f"http://{host}:{port}", "host": host, "port": port})]
    cluster.s3_endpoint, cluster.s3_bucket = f"http://{host}:{port}", bucket
    cluster.save()
    s3_server.wait_serving(proc, host, port, max(1.0, deadline - time.monotonic()), log)
    s3_server.create_bucket(cluster.s3_endpoint, bucket)


@_private_files
def spawn_agent(cluster: ClusterFile, node_id: str, role: str, labels: dict[str, str] | None = None,
                extra_args: list[str] | None = None) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """Starts (or restarts) one agent of ``cluster`` and records it; returns (process, ready file, log).
    The caller waits on the ready file (:func:`wait_agent`)."""
    workdir = Path(cluster.workdir)
    if cluster.pki_dir:  # its agent and rendezvous certificates, unless issued before
        bootstrap(Path(cluster.pki_dir), cluster.cluster, nodes=[node_id],
                  etcd_rendezvous=cluster.etcd_v3_rendezvous)
    node_dir = workdir / "nodes" / node_id
    ready = workdir / "run" / f"{node_id}.json"
    log = workdir / "logs" / f"{node_id}.log"
    ready.unlink(missing_ok=True)
    label_text = ",".join(f"{k}={v}" for k, v in (labels or {}).items())
    # Node-local SSD tier; one HDD directory shared by every node (a shared filesystem), so a spare
    # can restore a dead node's rank without the cold tier (shared_hdd=False: a node-local HDD). The
    # memory tier lives in the node directory, not in the machine's /dev/shm (tests run many clusters).
    hdd = ["--hdd-dir", str(workdir / "shared" / "hdd"), "--hdd-shared"] if cluster.shared_hdd else []
    # Isolated: the node's own address (its lab host) on fixed ports; else loopback, any free port.
    addr = isolated.address(cluster.isolation, node_id) if cluster.isolation else "127.0.0.1"
    ports = (isolated.AGENT_PORT, isolated.AGENT_METRICS_PORT) if cluster.isolation else (0, 0)
    argv = [sys.executable, "-m", "ftd.agent.main", "--node-id", node_id, "--host", addr, "--role", role,
            "--coordinators", cluster.coordinator_endpoints, "--listen", f"{addr}:{ports[0]}",
            "--metrics-listen", f"{addr}:{ports[1]}", "--workdir", str(node_dir),
            *hdd, "--mem-dir", str(node_dir / "mem"),
            "--ready-file", str(ready), *(["--pki-dir", cluster.pki_dir] if cluster.pki_dir else []),
            # A preemption notice is this node directory's trigger file (ftctl drill --preempt writes it);
            # no cloud metadata server is polled on a local cluster.
            "--preempt-sources", "file", "--preempt-poll-interval-s", "0.2",
            *(["--s3-endpoint", cluster.s3_endpoint, "--s3-bucket", cluster.s3_bucket] if cluster.s3_endpoint else []),
            *(["--labels", label_text] if label_text else []), *(extra_args or [])]
    env = dict(s3_server.CREDENTIALS) if cluster.s3 else {}  # our moto: any key signs
    if cluster.isolation:
        iso = cluster.isolation
        proc = _spawn(isolated.wrap(iso, node_id, argv), log, {**isolated.node_env(iso, node_id), **env})
    else:
        proc = _spawn(argv, log, env or None)
    cluster.agents = [a for a in cluster.agents if a.name != node_id]
    cluster.agents.append(Proc(node_id, proc.pid, {"role": role, "workdir": str(node_dir), "labels": labels or {}}))
    cluster.save()
    return proc, ready, log


def notice_file(cluster: ClusterFile, node_id: str) -> Path:
    """Where a preemption notice for ``node_id`` is delivered (its agent's trigger file)."""
    return Path(cluster.workdir) / "nodes" / node_id / "preemption-notice"


def wait_agent(cluster: ClusterFile, node_id: str, proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> Proc:
    """Waits for a spawned agent's ready file and records what it reports (address, socket, pid)."""
    workdir = Path(cluster.workdir)
    info = _wait_file(workdir / "run" / f"{node_id}.json", proc, time.monotonic() + timeout_s,
                      workdir / "logs" / f"{node_id}.log")
    agent = next(a for a in cluster.agents if a.name == node_id)
    agent.info.update(info)
    cluster.save()
    return agent


def wait_formed(endpoints: str, nodes: int, spares: int, deadline: float,
                tls: IdentityFiles | None = None) -> None:
    client = CoordinatorClient(endpoints, timeout_s=2.0, tls=tls)
    last = "no answer"
    try:
        while time.monotonic() < deadline:
            try:
                status = client.status(deadline_s=max(0.5, deadline - time.monotonic()))
                listed = client.nodes()
                alive = sum(1 for n in listed.nodes if n.state == 1)
                if len(status.world) == nodes and len(status.spares) == spares and alive == nodes + spares:
                    return
                last = f"world {list(status.world)}, spares {list(status.spares)}, {alive} alive"
            except ConnectionError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise ClusterError(f"cluster did not form in time: {last}")
    finally:
        client.close()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _owned(proc: Proc, workdir: Path) -> bool:
    """True when ``proc.pid`` is alive and its command line names our workdir (not a reused pid)."""
    return proc.pid > 0 and str(workdir) in _cmdline(proc.pid)


def stop(cluster: ClusterFile, timeout_s: float = 10.0) -> list[str]:
    """Stops agents, then coordinators, then etcd (SIGTERM, SIGKILL after ``timeout_s``)."""
    workdir = Path(cluster.workdir)
    stopped = []
    for group in (cluster.agents, cluster.coordinators, cluster.etcd, cluster.s3):
        mine = [p for p in group if _owned(p, workdir)]
        for p in mine:
            _signal(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(_owned(p, workdir) for p in mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in mine:
            if _owned(p, workdir):
                _signal(p.pid, signal.SIGKILL)
            stopped.append(p.name)
    return stopped


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # each daemon leads its own session: its children go too
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
