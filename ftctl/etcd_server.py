"""Starts real etcd server processes on free loopback ports: the embedded default of ``ftctl up``
and the fixture of every test that claims to exercise etcd.

etcd 3.4 from Debian (``apt-get install -y etcd-server``); the binary is found on ``PATH`` or
through ``FTD_ETCD_BINARY``.

With ``pki_dir`` (what ``ftctl up`` does) the members run with TLS on their client and peer ports,
certificates of the cluster PKI (``etcd/<member>.crt``, issued where missing), client certificates
required (``--client-cert-auth``), only ``ftd-etcd`` certificates admitted as peers, and, once the
cluster is healthy, etcd's auth on (:func:`enable_auth`, :data:`ROLES`, the same users and roles as
``deploy/systemd/etcd-enable-auth.sh``): etcd then takes a client certificate's CN as its user, so the
coordinators (``ftd-coordinator``, root: the leader also keeps etcd's space, and etcd 3.4 lets only root
defragment) read and write everything, the ``etcd-v3`` rendezvous handlers (``ftd-rendezvous``) their own
prefixes under ``/torch/elastic/``, and the members' own certificates (``ftd-etcd``) administer etcd. Only
certificates carrying :data:`ftd.ca.ETCD_CLIENT_HOST` complete the handshake
(``--client-cert-allowed-hostname``): by default no certificate a node holds reaches etcd (a rendezvous
certificate only with ``ftctl up --etcd-v3-rendezvous``), nor an operator's, since etcd 3.4's auth
checks nothing on leases, alarms or compaction. A plaintext client cannot even connect.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ftd.ca import ETCD_CLIENT_HOST, ETCD_CLIENT_KINDS, has_etcd_client_name, issue, rotate
from ftd.identity import IdentityFiles, load_certs, paths

log = logging.getLogger("ftd.etcd_server")

# etcd's auth for a cluster PKI: user (a certificate's CN) -> (role, the key prefixes it may read and
# write; none for etcd's built-in root role). Every user is made without a password: it can only log in
# with a certificate of that CN. The root user must exist for auth to be enabled; no certificate has CN
# root, so nobody logs in as it.
ROLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "root": ("root", ()),
    "ftd-etcd": ("root", ()),
    "ftd-coordinator": ("root", ()),  # etcd 3.4 lets only root defragment (its NOSPACE recovery)
    "ftd-rendezvous": ("ftd-rendezvous", ("/torch/elastic/rendezvous/", "/torch/elastic/store/")),
}
# Compact the key history hourly: the embedded default runs for days in a lab.
CLIENT_PORT, PEER_PORT = 2379, 2380  # etcd's own ports: those of a member with an address of its own
COMPACTION = ["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1h"]


class EtcdNotFound(RuntimeError):
    pass


def etcd_binary() -> str:
    path = os.environ.get("FTD_ETCD_BINARY") or shutil.which("etcd") or "/usr/bin/etcd"
    if not Path(path).exists():
        raise EtcdNotFound(
            "etcd server binary not found (looked at $FTD_ETCD_BINARY, PATH, /usr/bin/etcd): "
            "install it with 'apt-get install -y etcd-server'"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def prefix_end(prefix: str) -> bytes:
    """etcd's range end of every key starting with ``prefix`` (its last byte plus one)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    pki_dir: Path | None = None
    host: str = "127.0.0.1"  # the address its client and peer ports bind (ftctl up --isolate: a lab address)

    @property
    def scheme(self) -> str:
        return "https" if self.pki_dir is not None else "http"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def identity(self) -> IdentityFiles | None:
        return IdentityFiles(self.pki_dir, "etcd", self.name) if self.pki_dir is not None else None

    def tls_flags(self) -> list[str]:
        files = self.identity
        if files is None:
            return []
        crt, key, ca = str(files.cert_path), str(files.key_path), str(files.ca_path)
        return ["--cert-file", crt, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth",
                "--peer-cert-file", crt, "--peer-key-file", key, "--peer-trusted-ca-file", ca,
                "--peer-client-cert-auth", "--peer-cert-allowed-cn", "ftd-etcd",
                "--client-cert-allowed-hostname", ETCD_CLIENT_HOST]

    def _ssl_context(self) -> ssl.SSLContext | None:
        files = self.identity
        if files is None:
            return None
        ctx = ssl.create_default_context(cafile=str(files.ca_path))
        ctx.load_cert_chain(str(files.cert_path), str(files.key_path))
        return ctx

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.client_url + "/health", timeout=0.5,
                                        context=self._ssl_context()) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError, ssl.SSLError):
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on loopback with their own data dirs under ``workdir``.

    ``fast=True`` uses short raft timings (50 ms heartbeat, 250 ms election) so chaos tests see
    re-election in well under a second. ``pki_dir``: TLS with client certificates of that PKI on the
    client and peer ports (member certificates issued where missing); ``auth`` (with ``pki_dir``):
    etcd's auth on with :data:`ROLES` once the cluster is healthy.
    """

    workdir: Path
    size: int = 1
    fast: bool = False
    detach: bool = False  # start in a new session so the members outlive the caller (ftctl up)
    pki_dir: Path | None = None
    auth: bool = False
    quota_bytes: int = 0  # --quota-backend-bytes (0: etcd's default, 2 GiB)
    members: list[EtcdMember] = field(default_factory=list)
    # Member i binds hosts[i] on the fixed ports CLIENT_PORT and PEER_PORT (each in its own network
    # namespace); empty: every member on loopback on free ports.
    hosts: list[str] = field(default_factory=list)

    @property
    def endpoints(self) -> str:
        return ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def _command(self, m: EtcdMember, initial_cluster: str, state: str) -> list[str]:
        cmd = [
            etcd_binary(),
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"ftd-{os.getpid()}-{id(self)}",
            *COMPACTION,
            *m.tls_flags(),
        ]
        if self.fast:
            cmd += ["--heartbeat-interval", "50", "--election-timeout", "250"]
        if self.quota_bytes:
            cmd += ["--quota-backend-bytes", str(self.quota_bytes)]
        return cmd

    def _issue_member_certificates(self) -> None:
        assert self.pki_dir is not None
        for m in self.members:
            if not paths(self.pki_dir, "etcd", m.name)[0].exists():
                issue(self.pki_dir, "etcd", m.name)

    def start(self, timeout_s: float = 20.0) -> EtcdCluster:
        for attempt in range(3):  # a free port can be taken between probing and binding
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.members = [
                EtcdMember(f"etcd{i}", *((CLIENT_PORT, PEER_PORT) if self.hosts else (free_port(), free_port())),
                           self.workdir / f"etcd{i}.data", self.workdir / f"etcd{i}.log", pki_dir=self.pki_dir,
                           host=self.hosts[i] if self.hosts else "127.0.0.1")
                for i in range(self.size)
            ]
            if self.pki_dir is not None:
                self._issue_member_certificates()
            for m in self.members:
                self._spawn(m, "new")
            if self.wait_healthy(timeout_s):
                if self.auth and self.pki_dir is not None:
                    try:
                        enable_auth(self, timeout_s)
                    except BaseException:
                        self.stop()
                        raise
                return self
            self.stop()
            if attempt == 2:
                tails = "; ".join(f"{m.name}: {_tail(m.log_path)}" for m in self.members)
                raise RuntimeError(f"etcd did not become healthy within {timeout_s}s: {tails}")
            for m in self.members:
                shutil.rmtree(m.data_dir, ignore_errors=True)
        return self

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _spawn(self, m: EtcdMember, state: str) -> None:
        with open(m.log_path, "ab") as log:
            m.proc = subprocess.Popen(
                self._command(m, self._initial_cluster(), state),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=self.detach,
            )

    def wait_healthy(self, timeout_s: float, members: list[EtcdMember] | None = None) -> bool:
        deadline = time.monotonic() + timeout_s
        targets = members if members is not None else self.members
        while time.monotonic() < deadline:
            if all(m.running() and m.healthy() for m in targets):
                return True
            if any(m.proc is not None and m.proc.poll() is not None for m in targets):
                return False
            time.sleep(0.05)
        return False

    def kill(self, index: int, sig: int = signal.SIGKILL) -> None:
        m = self.members[index]
        if m.running():
            assert m.proc is not None
            m.proc.send_signal(sig)
            m.proc.wait(timeout=10)

    def restart(self, index: int, timeout_s: float = 20.0) -> None:
        """Starts a stopped member again on its old ports and data dir (it rejoins its cluster)."""
        m = self.members[index]
        if m.running():
            return
        self._spawn(m, "existing" if (m.data_dir / "member").exists() else "new")
        if not self.wait_healthy(timeout_s, [m]):
            raise RuntimeError(f"etcd member {m.name} did not come back: {_tail(m.log_path)}")

    def stop(self) -> None:
        for m in self.members:
            if m.running():
                assert m.proc is not None
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(timeout=5)


def renew_without_etcd_name(pki_dir: Path) -> list[Path]:
    """Coordinator and member certificates issued before etcd admitted clients by name (a re-run of ``ftctl
    up`` on an older workdir) are rotated, keeping their hosts: etcd would refuse them in the handshake.
    Rendezvous certificates are :func:`ftd.ca.bootstrap`'s: they reach etcd only where the cluster opts in."""
    renewed = []
    for kind in ETCD_CLIENT_KINDS:
        for crt in sorted(paths(pki_dir, kind, "x")[0].parent.glob("*.crt")):
            if not has_etcd_client_name(load_certs(crt, f"{kind} certificate")[0]):
                renewed.append(rotate(pki_dir, kind, crt.stem))
    return renewed


def _add_user_without_password(channel: grpc.Channel, name: str, timeout_s: float) -> None:
    """``etcdctl user add NAME --no-password`` over gRPC: pyetcd's protos predate etcd 3.4's
    ``AuthUserAddRequest.options`` (field 3, ``UserAddOptions{no_password: true}``), so it is encoded here."""
    from pyetcd.etcdrpc import rpc_pb2

    no_password = b"\x1a\x02\x08\x01"  # field 3 (length 2): field 1 (varint) = true
    add = channel.unary_unary("/etcdserverpb.Auth/UserAdd", request_serializer=lambda raw: raw,
                              response_deserializer=rpc_pb2.AuthUserAddResponse.FromString)
    add(rpc_pb2.AuthUserAddRequest(name=name).SerializeToString() + no_password, timeout=timeout_s)


def _unless_exists(call: Callable[[], object]) -> None:
    """Runs one step of the setup; "already exists" (a re-run after a partial one) is fine."""
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION or "already exists" not in (exc.details() or ""):
            raise


def enable_auth(cluster: EtcdCluster, timeout_s: float = 10.0) -> None:
    """Creates the users and roles of :data:`ROLES` and turns etcd's auth on, through the first
    member with its own certificate (any certificate of the CA may do anything until auth is on; then
    ``ftd-etcd`` has the root role). Idempotent: a cluster already set up (a data dir of an earlier
    run) is left as it is."""
    from pyetcd.etcdrpc import auth_pb2, rpc_pb2, rpc_pb2_grpc

    from ftd.rpc import client_credentials

    member = cluster.members[0]
    files = member.identity
    assert files is not None
    with grpc.secure_channel(f"{member.host}:{member.client_port}", client_credentials(files)) as ch:
        auth, kv = rpc_pb2_grpc.AuthStub(ch), rpc_pb2_grpc.KVStub(ch)
        try:
            auth.UserGet(rpc_pb2.AuthUserGetRequest(name="ftd-etcd"), timeout=timeout_s)
            log.info("etcd auth is already set up in %s", cluster.workdir)
            return
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
                raise
        try:  # no user ftd-etcd: a fresh etcd (auth off), or auth on without ftd's users
            kv.Range(rpc_pb2.RangeRequest(key=b"/ftd/"), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise RuntimeError(f"etcd in {cluster.workdir} has auth on without the user ftd-etcd (a data dir of "
                               f"another setup?): {exc.details()}; remove {member.data_dir} to start afresh") from exc
        for user, (role, prefixes) in ROLES.items():
            if role != "root" and prefixes:
                _unless_exists(functools.partial(auth.RoleAdd, rpc_pb2.AuthRoleAddRequest(name=role),
                                                 timeout=timeout_s))
                for prefix in prefixes:
                    auth.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(
                        name=role, perm=auth_pb2.Permission(permType=auth_pb2.Permission.READWRITE,
                                                            key=prefix.encode(), range_end=prefix_end(prefix))),
                        timeout=timeout_s)
            _unless_exists(functools.partial(_add_user_without_password, ch, user, timeout_s))
            auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=user, role=role), timeout=timeout_s)
        auth.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout=timeout_s)
    log.info("etcd auth on in %s: users %s", cluster.workdir, ", ".join(ROLES))


def _tail(path: Path, chars: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return "(no log)"
