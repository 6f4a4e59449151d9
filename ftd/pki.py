"""The cluster's PKI: one CA per cluster and one certificate per identity, for mTLS on every gRPC hop.

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

Keys are written 0600 and directories 0700, each file atomically (temp + fsync + rename), so a
reader sees the old file or the new one, never half of either. A rotation writes the key first and the
certificate second; :func:`load_identity` re-reads until the two match.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger("ftd.pki")

KINDS = ("node", "coordinator", "etcd", "operator", "rendezvous")
LOCAL = "local"  # the kind of an unauthenticated peer on the agent's Unix socket (never in a certificate)
TRUST_DOMAIN = "ftd"
DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")
DEFAULT_OPERATOR = "operator"
CA_DAYS = 3650
LEAF_DAYS = 365
_BACKDATE = dt.timedelta(minutes=5)  # tolerate clocks a little behind the CA's
EXPIRY_WARNING = dt.timedelta(days=14)  # loading a certificate closer to its end than this logs a warning
_FOLDERS = {"node": "nodes", "rendezvous": "rendezvous", "coordinator": "coordinators", "etcd": "etcd",
            "operator": "operators"}
_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_CLUSTER = re.compile(r"[A-Za-z0-9._-]{1,63}")
_HOST = re.compile(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")


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
    if len(parts) != 3 or not _CLUSTER.fullmatch(parts[0]):
        return None
    cluster, kind, name = parts
    try:
        check_name(kind, name)
    except PkiError:
        return None
    return Identity(kind, name, cluster)


def paths(pki_dir: Path, kind: str, name: str) -> tuple[Path, Path]:
    """Where the certificate and key of ``kind``/``name`` live under ``pki_dir``."""
    check_name(kind, name)
    if kind == "operator" and name == DEFAULT_OPERATOR:
        return pki_dir / "operator.crt", pki_dir / "operator.key"
    folder = pki_dir / _FOLDERS[kind]
    return folder / f"{name}.crt", folder / f"{name}.key"


def ca_paths(pki_dir: Path) -> tuple[Path, Path]:
    return pki_dir / "ca.crt", pki_dir / "ca.key"


# ---- files ---------------------------------------------------------------------------------------


def _mkdirs(path: Path) -> None:
    """Creates ``path`` with mode 0700 (an existing directory keeps its mode: it may be shared)."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """``path`` holds ``data`` with ``mode``, replaced in one rename after an fsync of the data (and of
    the directory, so the rename survives a crash)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise PkiError(f"{what} {path} does not exist (create it with 'ftctl certs init|issue')") from None
    except OSError as exc:
        raise PkiError(f"{what} {path} is unreadable: {exc.strerror or exc}") from None


def _load_certs(path: Path, what: str) -> list[x509.Certificate]:
    data = _read(path, what)
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise PkiError(f"{what} {path} is not a PEM certificate: {exc}") from None
    return certs


def _parse_key(data: bytes, path: Path, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{what} {path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{what} {path} is a {type(key).__name__}, expected an EC key")
    return key


def _spki(key: ec.EllipticCurvePrivateKey | x509.Certificate) -> bytes:
    public = key.public_key()
    return public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# ---- certificates --------------------------------------------------------------------------------


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _host_sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    seen: set[str] = set()
    for given in [*DEFAULT_HOSTS, *hosts]:
        host = given.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if not _HOST.fullmatch(host):
                raise PkiError(f"bad host {host[:260]!r} for a certificate: expected an IP address or a DNS "
                               "name") from None
            out.append(x509.DNSName(host))
    return out


def cert_hosts(cert: x509.Certificate) -> list[str]:
    """The DNS and IP SANs of ``cert`` beyond :data:`DEFAULT_HOSTS`."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    hosts = [*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))]
    return [h for h in hosts if h not in DEFAULT_HOSTS]


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


def _ca_cluster(ca: x509.Certificate, path: Path) -> str:
    try:
        san = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    for uri in uris:
        cluster = uri[len(prefix):] if uri.startswith(prefix) else ""
        if _CLUSTER.fullmatch(cluster):
            return cluster
    raise PkiError(f"CA certificate {path} names no ftd cluster (no spiffe://{TRUST_DOMAIN}/<cluster> SAN)")


def init_ca(pki_dir: Path, cluster: str, days: int = CA_DAYS, force: bool = False) -> Path:
    """Creates the cluster CA in ``pki_dir`` (``ca.crt`` and ``ca.key``, EC P-256, ``days`` valid).
    Refuses to replace an existing CA unless ``force``: every certificate it issued would stop being
    trusted. Returns the path of ``ca.crt``."""
    if not _CLUSTER.fullmatch(cluster):
        raise PkiError(f"bad cluster name {cluster[:80]!r}: expected [A-Za-z0-9._-]{{1,63}}")
    pki_dir = Path(pki_dir)
    crt_path, key_path = ca_paths(pki_dir)
    if not force and (crt_path.exists() or key_path.exists()):
        raise PkiError(f"a CA already exists in {pki_dir} ({crt_path}); refusing to replace it "
                       "(every certificate it issued would stop being trusted)")
    _mkdirs(pki_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ftd"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"ftd cluster CA {cluster}")])
    now = _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.SubjectAlternativeName([
            x509.UniformResourceIdentifier(f"spiffe://{TRUST_DOMAIN}/{cluster}")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_atomic(key_path, _key_pem(key), 0o600)
    write_atomic(crt_path, _cert_pem(cert), 0o644)
    log.info("created the CA of cluster %s in %s", cluster, pki_dir)
    return crt_path


def _load_ca(pki_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, str]:
    crt_path, key_path = ca_paths(pki_dir)
    ca = _load_certs(crt_path, "CA certificate")[0]
    key = _parse_key(_read(key_path, "CA key"), key_path, "CA key")
    if _spki(key) != _spki(ca):
        raise PkiError(f"CA key {key_path} does not belong to CA certificate {crt_path}")
    if ca.not_valid_after_utc <= _now():
        raise PkiError(f"CA certificate {crt_path} expired on {ca.not_valid_after_utc:%Y-%m-%d}")
    return ca, key, _ca_cluster(ca, crt_path)


def _sign_leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, cluster: str, kind: str, name: str,
               hosts: Sequence[str], days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ftd"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, cluster),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"ftd-{kind}")])
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_uri(cluster, kind, name)),
                                       *_host_sans(hosts)])
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(ca.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def issue(pki_dir: Path, kind: str, name: str, hosts: Sequence[str] = (), days: int = LEAF_DAYS,
          force: bool = False) -> Path:
    """Issues a certificate for ``kind``/``name`` signed by the CA in ``pki_dir``, valid ``days`` (at
    most until the CA expires), with ``hosts`` (and :data:`DEFAULT_HOSTS`) as DNS/IP SANs. Refuses to
    replace an existing one unless ``force`` (use :func:`rotate`). Returns the certificate's path."""
    pki_dir = Path(pki_dir)
    crt_path, key_path = paths(pki_dir, kind, name)
    if days < 0:
        raise PkiError(f"bad validity for {kind}/{name}: {days} days")
    if not force and crt_path.exists():
        raise PkiError(f"{kind} certificate {crt_path} already exists; rotate it with "
                       f"'ftctl certs rotate {kind} {name}'")
    ca, ca_key, cluster = _load_ca(pki_dir)
    key, cert = _sign_leaf(ca, ca_key, cluster, kind, name, hosts, days)
    _mkdirs(crt_path.parent)
    write_atomic(key_path, _key_pem(key), 0o600)
    write_atomic(crt_path, _cert_pem(cert), 0o644)
    log.info("issued %s/%s (serial %x, hosts %s) until %s", kind, name, cert.serial_number,
             ",".join([*DEFAULT_HOSTS, *hosts]), cert.not_valid_after_utc.isoformat())
    return crt_path


def bootstrap(pki_dir: Path, cluster: str, nodes: Iterable[str] = (), coordinators: Iterable[str] = (),
              etcd: Iterable[str] = (), hosts: Sequence[str] = (), days: int = LEAF_DAYS) -> list[Path]:
    """What ``ftctl up`` needs, created where missing and kept where present (a re-run issues nothing
    twice): the CA, the default operator, and per node its agent and rendezvous certificates, per
    coordinator replica and per etcd member one certificate, each for ``hosts`` too. Returns the
    certificates issued."""
    pki_dir = Path(pki_dir)
    ca_path = ca_paths(pki_dir)[0]
    if not ca_path.exists():
        init_ca(pki_dir, cluster)
    existing = _ca_cluster(_load_certs(ca_path, "CA certificate")[0], ca_path)
    if existing != cluster:
        raise PkiError(f"the CA in {ca_path} is of cluster {existing!r}, not {cluster!r}")
    wanted = [("operator", DEFAULT_OPERATOR), *(("node", n) for n in nodes), *(("rendezvous", n) for n in nodes),
              *(("coordinator", c) for c in coordinators), *(("etcd", m) for m in etcd)]
    return [issue(pki_dir, kind, name, hosts, days) for kind, name in wanted
            if not paths(pki_dir, kind, name)[0].exists()]


def rotate(pki_dir: Path, kind: str, name: str, hosts: Sequence[str] | None = None, days: int = LEAF_DAYS) -> Path:
    """A new key and certificate for an existing identity, keeping its hosts unless ``hosts`` is given.
    Servers built with :func:`ftd.rpc.add_port` from :class:`IdentityFiles` serve it to new
    connections without a restart; clients use it for channels they open afterwards."""
    pki_dir = Path(pki_dir)
    crt_path, _ = paths(pki_dir, kind, name)
    old = _load_certs(crt_path, f"{kind} certificate")[0]
    return issue(pki_dir, kind, name, cert_hosts(old) if hosts is None else hosts, days, force=True)


# ---- loading -------------------------------------------------------------------------------------


def verify_leaf(cert: x509.Certificate, cas: Sequence[x509.Certificate], path: Path, ca_path: Path) -> None:
    """Raises :class:`PkiError` naming ``path`` unless ``cert`` is in its validity period and signed by
    one of ``cas``."""
    now = _now()
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
        ca_pem = _read(self.ca_path, "CA certificate")
        try:
            cas = x509.load_pem_x509_certificates(ca_pem)
        except ValueError as exc:
            raise PkiError(f"CA certificate {self.ca_path} is not a PEM certificate: {exc}") from None
        cert_pem = _read(self.cert_path, f"{self.kind} certificate")
        try:
            cert = x509.load_pem_x509_certificates(cert_pem)[0]
        except ValueError as exc:
            raise PkiError(f"{self.kind} certificate {self.cert_path} is not a PEM certificate: {exc}") from None
        verify_leaf(cert, cas, self.cert_path, self.ca_path)
        found = cert_identity(cert)
        if found is None or (found.kind, found.name) != (self.kind, self.name):
            raise PkiError(f"certificate {self.cert_path} is for {found or 'no ftd identity'}, "
                           f"expected {self.kind}/{self.name}")
        left = cert.not_valid_after_utc - _now()
        if left < EXPIRY_WARNING:
            log.warning("certificate %s expires in %d days (%s): rotate it with 'ftctl certs rotate %s %s'",
                        self.cert_path, left.days, cert.not_valid_after_utc.isoformat(), self.kind, self.name)
        key_pem = _read(self.key_path, f"{self.kind} key")
        key = _parse_key(key_pem, self.key_path, f"{self.kind} key")
        with contextlib.suppress(OSError):
            mode = self.key_path.stat().st_mode & 0o777
            if mode & 0o077:
                log.warning("key %s is accessible by group or others (mode %o): chmod 600 it", self.key_path, mode)
        return TlsMaterial(ca_pem, cert_pem, key_pem), _spki(key) == _spki(cert)


def certificate_info(path: Path) -> dict[str, object]:
    """Identity, serial, hosts and validity of the certificate at ``path``, for ``ftctl certs list``."""
    cert = _load_certs(path, "certificate")[0]
    found = cert_identity(cert)
    return {"path": str(path), "identity": str(found) if found else None, "serial": f"{cert.serial_number:x}",
            "hosts": cert_hosts(cert), "not_after": cert.not_valid_after_utc.isoformat(),
            "expired": cert.not_valid_after_utc <= _now()}


def serial_of(cert_pem: bytes) -> int:
    """The serial number of a PEM certificate (what tests and ``ftctl certs list`` compare)."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number
