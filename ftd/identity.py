"""Runtime identity: who this process is and who is on the other end of a call, from the cluster's
PKI files (one CA per cluster and one certificate per identity, for mTLS on every gRPC hop). Creating
the CA and issuing or rotating certificates is :mod:`ftd.ca` (what ``ftctl certs`` runs).

An identity lives in the certificate's URI SAN as ``spiffe://ftd/<cluster>/<kind>/<name>`` (kinds:
:data:`KINDS`); DNS/IP SANs name the hosts a server is reached at, so one certificate serves both ends
of a connection (serverAuth + clientAuth). The subject's CN is ``ftd-<kind>``, the user name etcd maps
a client certificate to (etcd's own RBAC and ``--peer-cert-allowed-cn`` key on it).

Layout of a PKI directory (``DIR/pki`` of ``ftctl up``; ``/etc/ftd/pki`` on a real node)::

    ca.crt  ca.key                       the cluster CA (ca.key stays on the operator's machine)
    operator.crt  operator.key           the default operator; operators/<name>.* for others
    nodes/<node_id>.crt|.key             agents
    rendezvous/<node_id>.crt|.key        the torchrun rendezvous handler of that node
    coordinators/<replica>.crt|.key      coordinator replicas
    etcd/<member>.crt|.key               etcd members (server and peer)

Every file is replaced atomically, so a reader sees the old file or the new one, never half of either.
A rotation writes the key first and the certificate second; :meth:`IdentityFiles.load` re-reads until
the two match. Loading checks the certificate against the CA, its validity and its identity, and
warns when it is close to its end.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

log = logging.getLogger("ftd.pki")  # one logger for the PKI: ftd.ca logs there too

KINDS = ("node", "coordinator", "etcd", "operator", "rendezvous")
LOCAL = "local"  # the kind of an unauthenticated peer on the agent's Unix socket (never in a certificate)
TRUST_DOMAIN = "ftd"
DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")
DEFAULT_OPERATOR = "operator"
EXPIRY_WARNING = dt.timedelta(days=14)  # loading a certificate closer to its end than this logs a warning
_FOLDERS = {"node": "nodes", "rendezvous": "rendezvous", "coordinator": "coordinators", "etcd": "etcd",
            "operator": "operators"}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
CLUSTER_RE = re.compile(r"[A-Za-z0-9._-]{1,63}")


class PkiError(Exception):
    """A PKI file is missing, unreadable, malformed, expired, or not issued by this cluster's CA;
    the message names the path."""


@dataclass(frozen=True)
class Identity:
    """Who is on the other end of a call: ``kind``/``name`` in ``cluster``. ``kind`` is one of
    :data:`KINDS`, or :data:`LOCAL` for a peer on the agent's Unix socket (``name`` and ``cluster``
    empty: the socket's file permissions are what authenticated it)."""

    kind: str
    name: str
    cluster: str

    def __str__(self) -> str:
        return "local (unix socket)" if self.kind == LOCAL else f"{self.kind}/{self.name}"

    @property
    def uri(self) -> str:
        return spiffe_uri(self.cluster, self.kind, self.name)


LOCAL_IDENTITY = Identity(LOCAL, "", "")


@dataclass(frozen=True)
class TlsMaterial:
    """PEM bytes for one end of an mTLS connection: the trusted CA bundle, the own certificate, its key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def __repr__(self) -> str:  # never print a key into a log
        return (f"TlsMaterial(ca_pem=<{len(self.ca_pem)} bytes>, cert_pem=<{len(self.cert_pem)} bytes>, "
                "key_pem=<hidden>)")


def check_name(kind: str, name: str) -> None:
    """Raises :class:`PkiError` unless ``kind`` is known and ``name`` is a safe file and URI component."""
    if kind not in KINDS:
        raise PkiError(f"unknown identity kind {kind!r}: expected one of {', '.join(KINDS)}")
    if not _NAME.fullmatch(name) or set(name) == {"."}:
        raise PkiError(f"bad {kind} name {name[:140]!r}: expected [A-Za-z0-9._-]{{1,128}}, not only dots")


def spiffe_uri(cluster: str, kind: str, name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/{cluster}/{kind}/{name}"


def parse_spiffe(uri: str) -> Identity | None:
    """``spiffe://ftd/<cluster>/<kind>/<name>`` → the identity; ``None`` for anything else (another
    trust domain, an unknown kind, a name that :func:`check_name` refuses)."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    parts = uri[len(prefix):].split("/")
    if len(parts) != 3 or not CLUSTER_RE.fullmatch(parts[0]):
        return None
    cluster, kind, name = parts
    try:
        check_name(kind, name)
    except PkiError:
        return None
    return Identity(kind, name, cluster)


# A server's name as its clients verify it (``grpc.ssl_target_name_override``): a DNS SAN that only the
# CA puts in a certificate of that kind, so a node's certificate cannot pass for a coordinator's (every
# certificate also names 127.0.0.1/localhost, which said nothing about whose it is).
SERVER_DOMAIN = "ftd.internal"
COORDINATOR_SERVER_NAME = f"coordinator.{SERVER_DOMAIN}"
_DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def server_name(kind: str, name: str) -> str | None:
    """The DNS SAN a server of ``kind``/``name`` carries for its clients to verify: every coordinator
    replica ``coordinator.ftd.internal`` (a client follows the leader among them), a node's agent
    ``<name>.agent.ftd.internal``; ``None`` for kinds that serve no ftd gRPC."""
    if kind == "coordinator":
        return COORDINATOR_SERVER_NAME
    if kind == "node":  # a name that is no DNS label by itself goes by its digest, in a label of its own
        plain = _DNS_LABEL.fullmatch(name)
        label = name if plain else f"{hashlib.sha256(name.encode()).hexdigest()[:40]}.h"
        return f"{label}.agent.{SERVER_DOMAIN}"
    return None


def paths(pki_dir: Path, kind: str, name: str) -> tuple[Path, Path]:
    """Where the certificate and key of ``kind``/``name`` live under ``pki_dir``."""
    check_name(kind, name)
    if kind == "operator" and name == DEFAULT_OPERATOR:
        return pki_dir / "operator.crt", pki_dir / "operator.key"
    folder = pki_dir / _FOLDERS[kind]
    return folder / f"{name}.crt", folder / f"{name}.key"


def ca_paths(pki_dir: Path) -> tuple[Path, Path]:
    return pki_dir / "ca.crt", pki_dir / "ca.key"


# ---- reading the files -------------------------------------------------------------------------


def read_file(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"{what} {path} does not exist (create it with 'ftctl certs init|issue')") from None
    except OSError as exc:
        raise PkiError(f"{what} {path} is unreadable: {exc.strerror or exc}") from None


def load_certs(path: Path, what: str) -> list[x509.Certificate]:
    data = read_file(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise PkiError(f"{what} {path} is not a PEM certificate: {exc}") from None
    return certs


def parse_key(data: bytes, path: Path, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{what} {path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{what} {path} is a {type(key).__name__}, expected an EC key")
    return key


def public_key_der(key: ec.EllipticCurvePrivateKey | x509.Certificate) -> bytes:
    public = key.public_key()
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


# ---- what a certificate says ---------------------------------------------------------------------


def cert_hosts(cert: x509.Certificate) -> list[str]:
    """The DNS and IP SANs of ``cert`` beyond :data:`DEFAULT_HOSTS`."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    hosts = [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]
    return [h for h in hosts if h not in DEFAULT_HOSTS and not h.lower().endswith(SERVER_DOMAIN)]


def cert_identity(cert: x509.Certificate) -> Identity | None:
    """The ftd identity in ``cert``'s URI SAN (``None`` when it has none or more than one)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    found = {i for i in (parse_spiffe(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)) if i}
    return found.pop() if len(found) == 1 else None


def identity_of(cert_pem: bytes) -> Identity | None:
    """The identity of a PEM certificate (the first one of a chain)."""
    certs = x509.load_pem_x509_certificates(cert_pem)
    return cert_identity(certs[0]) if certs else None


def verify_leaf(cert: x509.Certificate, cas: Sequence[x509.Certificate], path: Path, ca_path: Path) -> None:
    """Raises :class:`PkiError` naming ``path`` unless ``cert`` is in its validity period and signed by
    one of ``cas``."""
    now = utc_now()
    if cert.not_valid_after_utc <= now:
        raise PkiError(f"certificate {path} expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                       "rotate it with 'ftctl certs rotate'")
    if cert.not_valid_before_utc > now:
        raise PkiError(f"certificate {path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
                       "(is this host's clock right?)")
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return
        except (ValueError, TypeError, InvalidSignature):
            continue
    raise PkiError(f"certificate {path} was not issued by the CA in {ca_path} (issuer {cert.issuer.rfc4514_string()}); "
                   "it belongs to another cluster or an old CA")


# ---- loading an identity --------------------------------------------------------------------------


def load_identity(pki_dir: Path, kind: str, name: str) -> TlsMaterial:
    """The checked TLS material of ``kind``/``name``: the CA bundle, the certificate (issued by that
    CA, in its validity period, naming this identity) and its key (matching the certificate)."""
    return IdentityFiles(Path(pki_dir), kind, name).load()


@dataclass(frozen=True)
class IdentityFiles:
    """The files of one identity, read afresh on each :meth:`load`: what a long-running process holds
    so that a rotation on disk reaches it (:func:`ftd.rpc.add_port` re-reads on :meth:`stamp` changes)."""

    pki_dir: Path
    kind: str
    name: str

    def __post_init__(self) -> None:
        check_name(self.kind, self.name)

    @property
    def ca_path(self) -> Path:
        return ca_paths(self.pki_dir)[0]

    @property
    def cert_path(self) -> Path:
        return paths(self.pki_dir, self.kind, self.name)[0]

    @property
    def key_path(self) -> Path:
        return paths(self.pki_dir, self.kind, self.name)[1]

    def stamp(self) -> tuple[tuple[int, int, int], ...]:
        """Changes whenever one of the three files is replaced or rewritten (inode, size, mtime)."""
        out = []
        for p in (self.ca_path, self.cert_path, self.key_path):
            try:
                st = p.stat()
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    def load(self, attempts: int = 20) -> TlsMaterial:
        """Reads and checks the three files; a key that does not match its certificate is read again
        (a rotation replaces the key, then the certificate) before giving up."""
        for attempt in range(attempts):
            material, matched = self._load_once()
            if matched:
                return material
            if attempt + 1 < attempts:
                time.sleep(0.005)
        raise PkiError(f"key {self.key_path} does not belong to certificate {self.cert_path}")

    def _load_once(self) -> tuple[TlsMaterial, bool]:
        ca_pem = read_file(self.ca_path, "CA certificate")
        try:
            cas = x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise PkiError(f"CA certificate {self.ca_path} is not a PEM certificate: {exc}") from None
        cert_pem = read_file(self.cert_path, f"{self.kind} certificate")
        try:
            cert = x509.load_pem_x509_certificates(cert_pem)[0]
        except ValueError as exc:
            raise PkiError(f"{self.kind} certificate {self.cert_path} is not a PEM certificate: {exc}") from None
        verify_leaf(cert, cas, self.cert_path, self.ca_path)
        found = cert_identity(cert)
        if found is None or (found.kind, found.name) != (self.kind, self.name):
            raise PkiError(f"certificate {self.cert_path} is for {found or 'no ftd identity'}, "
                           f"expected {self.kind}/{self.name}")
        left = cert.not_valid_after_utc - utc_now()
        if left < EXPIRY_WARNING:
            log.warning("certificate %s expires in %d days (%s): rotate it with 'ftctl certs rotate %s %s'",
                        self.cert_path, left.days, cert.not_valid_after_utc.isoformat(), self.kind, self.name)
        key_pem = read_file(self.key_path, f"{self.kind} key")
        key = parse_key(key_pem, self.key_path, f"{self.kind} key")
        with contextlib.suppress(OSError):
            mode = self.key_path.stat().st_mode & 0o777
            if mode & 0o077:
                log.warning("key %s is accessible by group or others (mode %o): chmod 600 it", self.key_path, mode)
        return TlsMaterial(ca_pem, cert_pem, key_pem), public_key_der(key) == public_key_der(cert)
