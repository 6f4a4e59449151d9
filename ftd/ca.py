"""CA administration: creating the cluster CA, issuing certificates from it and rotating them (what
``ftctl certs`` and ``ftctl up`` run, on the operator's machine where ``ca.key`` stays). What a running
process reads back (its identity, a peer's) is :mod:`ftd.identity`, which also gives the layout of a
PKI directory.

Keys are EC P-256, written 0600 and directories 0700, each file atomically (temp + fsync + rename).
A rotation writes the key first and the certificate second, so a reader that sees the new key re-reads
until the certificate matches (:meth:`ftd.identity.IdentityFiles.load`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ftd.identity import (
    CLUSTER_RE,
    DEFAULT_HOSTS,
    DEFAULT_OPERATOR,
    SERVER_DOMAIN,
    TRUST_DOMAIN,
    PkiError,
    ca_paths,
    cert_hosts,
    cert_identity,
    load_certs,
    parse_key,
    paths,
    public_key_der,
    read_file,
    server_name,
    spiffe_uri,
    utc_now,
)

CA_DAYS = 3650
LEAF_DAYS = 365
_BACKDATE = dt.timedelta(minutes=5)  # tolerate clocks a little behind the CA's
_HOST = re.compile(r"[A-Za-z0-9*]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")
log = logging.getLogger("ftd.pki")


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


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


# ---- certificates --------------------------------------------------------------------------------


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


def _ca_cluster(ca: x509.Certificate, path: Path) -> str:
    try:
        san = ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    for uri in uris:
        cluster = uri[len(prefix):] if uri.startswith(prefix) else ""
        if CLUSTER_RE.fullmatch(cluster):
            return cluster
    raise PkiError(f"CA certificate {path} names no ftd cluster (no spiffe://{TRUST_DOMAIN}/<cluster> SAN)")


def init_ca(pki_dir: Path, cluster: str, days: int = CA_DAYS, force: bool = False) -> Path:
    """Creates the cluster CA in ``pki_dir`` (``ca.crt`` and ``ca.key``, EC P-256, ``days`` valid).
    Refuses to replace an existing CA unless ``force``: every certificate it issued would stop being
    trusted. Returns the path of ``ca.crt``."""
    if not CLUSTER_RE.fullmatch(cluster):
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
    now = utc_now()
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
    ca = load_certs(crt_path, "CA certificate")[0]
    key = parse_key(read_file(key_path, "CA key"), key_path, "CA key")
    if public_key_der(key) != public_key_der(ca):
        raise PkiError(f"CA key {key_path} does not belong to CA certificate {crt_path}")
    if ca.not_valid_after_utc <= utc_now():
        raise PkiError(f"CA certificate {crt_path} expired on {ca.not_valid_after_utc:%Y-%m-%d}")
    return ca, key, _ca_cluster(ca, crt_path)


# etcd admits only client certificates carrying this DNS SAN (``--client-cert-allowed-hostname``), under
# SERVER_DOMAIN (the CA's names, which no ``hosts`` may give and ``cert_hosts`` leaves out). etcd 3.4 checks
# no permission on leases, alarms or compaction (and names any lease's keys before 3.4.26: CVE-2023-32082), so
# no certificate a node holds carries it by default (docs/security.md): the coordinators' and the members'
# own always do, a node's rendezvous certificate only when the cluster opts in to torchrun's etcd-v3
# rendezvous, a node's agent or an operator's never.
ETCD_CLIENT_HOST = "etcd-client.ftd.internal"
ETCD_CLIENT_KINDS = ("coordinator", "etcd")  # always etcd clients
ETCD_OPTIONAL_KINDS = ("rendezvous",)  # only with etcd_client=True (torchrun --rdzv-backend=etcd-v3)


def etcd_client_name(kind: str, etcd_client: bool | None = None) -> bool:
    """Whether a ``kind`` certificate carries :data:`ETCD_CLIENT_HOST` (``None``: the kind's default).
    Refuses what cannot work (a coordinator or a member without it) or must not be (a node's agent or an
    operator with it: etcd 3.4 would let them keep any lease alive)."""
    if kind in ETCD_CLIENT_KINDS:
        if etcd_client is False:
            raise PkiError(f"{kind} certificates always carry etcd's client name {ETCD_CLIENT_HOST}: "
                           "without it etcd refuses them")
        return True
    if kind in ETCD_OPTIONAL_KINDS:
        return bool(etcd_client)
    if etcd_client:
        raise PkiError(f"{kind} certificates never reach etcd (only coordinators, members and, for torchrun's "
                       "etcd-v3 rendezvous, rendezvous certificates may carry its client name)")
    return False


def has_etcd_client_name(cert: x509.Certificate) -> bool:
    """Whether etcd admits ``cert`` as a client (it carries :data:`ETCD_CLIENT_HOST`)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return ETCD_CLIENT_HOST in san.get_values_for_type(x509.DNSName)


def _sign_leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, cluster: str, kind: str, name: str,
               hosts: Sequence[str], days: int, etcd_client: bool | None = None,
               ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = utc_now()
    not_after = min(now + dt.timedelta(days=days), ca.not_valid_after_utc)
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ftd"),
                         x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, cluster),
                         x509.NameAttribute(NameOID.COMMON_NAME, f"ftd-{kind}")])
    etcd = [ETCD_CLIENT_HOST] if etcd_client_name(kind, etcd_client) else []  # the name etcd admits clients by
    served = server_name(kind, name)  # the name clients verify this server by (ftd.identity.server_name)
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_uri(cluster, kind, name)),
                                       *_host_sans([*hosts, *etcd]), *([x509.DNSName(served)] if served else [])])
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
          force: bool = False, etcd_client: bool | None = None) -> Path:
    """Issues a certificate for ``kind``/``name`` signed by the CA in ``pki_dir``, valid ``days`` (at
    most until the CA expires), with ``hosts`` (and :data:`DEFAULT_HOSTS`) as DNS/IP SANs, and etcd's
    client name as :func:`etcd_client_name` decides (a rendezvous certificate only with ``etcd_client``).
    Refuses to replace an existing one unless ``force`` (use :func:`rotate`). Returns the certificate's path."""
    pki_dir = Path(pki_dir)
    crt_path, key_path = paths(pki_dir, kind, name)
    reserved = [h for h in hosts if h.strip().strip(".").lower().endswith(SERVER_DOMAIN)]
    if reserved:
        raise PkiError(f"host {reserved[0]!r} for {kind}/{name}: names under {SERVER_DOMAIN} are the CA's, given "
                       "only to the server they name (a client verifies a coordinator or an agent by them)")
    if days < 0:
        raise PkiError(f"bad validity for {kind}/{name}: {days} days")
    if not force and crt_path.exists():
        raise PkiError(f"{kind} certificate {crt_path} already exists; rotate it with "
                       f"'ftctl certs rotate {kind} {name}'")
    etcd = etcd_client_name(kind, etcd_client)  # refused before the CA key is read
    ca, ca_key, cluster = _load_ca(pki_dir)
    key, cert = _sign_leaf(ca, ca_key, cluster, kind, name, hosts, days, etcd)
    _mkdirs(crt_path.parent)
    write_atomic(key_path, _key_pem(key), 0o600)
    write_atomic(crt_path, _cert_pem(cert), 0o644)
    log.info("issued %s/%s (serial %x, hosts %s%s) until %s", kind, name, cert.serial_number,
             ",".join([*DEFAULT_HOSTS, *hosts]), ", etcd client" if etcd else "", cert.not_valid_after_utc.isoformat())
    return crt_path


def bootstrap(pki_dir: Path, cluster: str, nodes: Iterable[str] = (), coordinators: Iterable[str] = (),
              etcd: Iterable[str] = (), hosts: Sequence[str] = (), days: int = LEAF_DAYS,
              etcd_rendezvous: bool = False) -> list[Path]:
    """What ``ftctl up`` needs, created where missing and kept where present (a re-run issues nothing
    twice): the CA, the default operator, and per node its agent and rendezvous certificates, per
    coordinator replica and per etcd member one certificate, each for ``hosts`` too. The rendezvous
    certificates reach etcd only with ``etcd_rendezvous`` (``ftctl up --etcd-v3-rendezvous``); one whose
    etcd name differs from it is issued again, so a re-run without the flag takes etcd away from the nodes.
    Returns the certificates issued."""
    pki_dir = Path(pki_dir)
    ca_path = ca_paths(pki_dir)[0]
    if not ca_path.exists():
        init_ca(pki_dir, cluster)
    existing = _ca_cluster(load_certs(ca_path, "CA certificate")[0], ca_path)
    if existing != cluster:
        raise PkiError(f"the CA in {ca_path} is of cluster {existing!r}, not {cluster!r}")
    wanted = [("operator", DEFAULT_OPERATOR), *(("node", n) for n in nodes), *(("rendezvous", n) for n in nodes),
              *(("coordinator", c) for c in coordinators), *(("etcd", m) for m in etcd)]
    etcd_client = {"rendezvous": etcd_rendezvous}
    return [issue(pki_dir, kind, name, hosts, days, force=True, etcd_client=etcd_client.get(kind))
            for kind, name in wanted
            if not paths(pki_dir, kind, name)[0].exists() or _lacks_server_name(pki_dir, kind, name)
            or (kind == "rendezvous" and _etcd_name_differs(pki_dir, name, etcd_rendezvous))]


def _etcd_name_differs(pki_dir: Path, node: str, wanted: bool) -> bool:
    """A node's rendezvous certificate reaches etcd where the cluster did not opt in (one of an older
    ftctl, or of a run with ``--etcd-v3-rendezvous``), or does not where it did."""
    try:
        cert = load_certs(paths(pki_dir, "rendezvous", node)[0], "rendezvous certificate")[0]
    except PkiError:
        return True
    return has_etcd_client_name(cert) != wanted


def _lacks_server_name(pki_dir: Path, kind: str, name: str) -> bool:
    """A certificate issued before servers carried the name their clients verify (issue 20): ``ftctl
    up`` issues it again, or every client would refuse the server."""
    served = server_name(kind, name)
    if served is None:
        return False
    try:
        cert = load_certs(paths(pki_dir, kind, name)[0], f"{kind} certificate")[0]
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (PkiError, x509.ExtensionNotFound):
        return True
    return served not in san.get_values_for_type(x509.DNSName)


def rotate(pki_dir: Path, kind: str, name: str, hosts: Sequence[str] | None = None, days: int = LEAF_DAYS,
           etcd_client: bool | None = None) -> Path:
    """A new key and certificate for an existing identity, keeping its hosts unless ``hosts`` is given,
    and whether etcd admits it unless ``etcd_client`` is given (a rendezvous certificate keeps or lacks
    etcd's client name as before).
    Servers built with :func:`ftd.rpc.add_port` from :class:`~ftd.identity.IdentityFiles` serve it to new
    connections without a restart; clients use it for channels they open afterwards."""
    pki_dir = Path(pki_dir)
    crt_path, _ = paths(pki_dir, kind, name)
    old = load_certs(crt_path, f"{kind} certificate")[0]
    if etcd_client is None and kind in ETCD_OPTIONAL_KINDS:
        etcd_client = has_etcd_client_name(old)
    return issue(pki_dir, kind, name, cert_hosts(old) if hosts is None else hosts, days, force=True,
                 etcd_client=etcd_client)


# ---- inspection (ftctl certs list) ---------------------------------------------------------------


def certificate_info(path: Path) -> dict[str, object]:
    """Identity, serial, hosts and validity of the certificate at ``path``, for ``ftctl certs list``."""
    cert = load_certs(path, "certificate")[0]
    found = cert_identity(cert)
    return {"path": str(path), "identity": str(found) if found else None, "serial": f"{cert.serial_number:x}",
            "hosts": cert_hosts(cert), "not_after": cert.not_valid_after_utc.isoformat(),
            "expired": cert.not_valid_after_utc <= utc_now()}


def serial_of(cert_pem: bytes) -> int:
    """The serial number of a PEM certificate (what tests and ``ftctl certs list`` compare)."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number
