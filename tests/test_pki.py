"""The cluster PKI (ftd/ca.py, ftd/identity.py) and ``ftctl certs``: layout, modes, identities in the SAN, rotation,
and the errors for missing, unreadable, expired, foreign and mismatched files."""

from __future__ import annotations

import datetime as dt
import shutil
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from hypothesis import given
from hypothesis import strategies as st

from ftd.ca import bootstrap, etcd_client_name, has_etcd_client_name, init_ca, issue, rotate, serial_of
from ftd.ftctl import certs
from ftd.identity import (
    KINDS,
    Identity,
    IdentityFiles,
    PkiError,
    cert_hosts,
    identity_of,
    load_certs,
    load_identity,
    parse_spiffe,
    spiffe_uri,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "pki"
    init_ca(path, "c1")
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_ca_layout_and_modes(root: Path) -> None:
    assert (root / "ca.crt").is_file()
    assert mode(root / "ca.key") == 0o600
    assert mode(root) == 0o700
    ca = load_cert(root / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    years = (ca.not_valid_after_utc - ca.not_valid_before_utc).days / 365
    assert 9.9 < years < 10.1
    with pytest.raises(PkiError, match="already exists"):
        init_ca(root, "c1")


def test_issue_node_with_identity_and_hosts(root: Path) -> None:
    crt = issue(root, "node", "node-1", hosts=["node-1.example", "10.0.0.7"])
    assert crt == root / "nodes" / "node-1.crt"
    assert mode(root / "nodes" / "node-1.key") == 0o600
    assert mode(root / "nodes") == 0o700
    cert = load_cert(crt)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://ftd/c1/node/node-1"]
    # the name a client verifies the agent by (ftd.identity.server_name), beside the given hosts
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "node-1.example", "node-1.agent.ftd.internal"}
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1", "10.0.0.7"}
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert 364 <= (cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).days <= 365
    material = load_identity(root, "node", "node-1")
    assert identity_of(material.cert_pem) == Identity("node", "node-1", "c1")
    assert material.ca_pem == (root / "ca.crt").read_bytes()
    assert "PRIVATE" not in repr(material)


def test_layout_of_every_kind(root: Path) -> None:
    expected = {("operator", "operator"): "operator.crt", ("operator", "alice"): "operators/alice.crt",
                ("coordinator", "c0"): "coordinators/c0.crt", ("etcd", "m0"): "etcd/m0.crt",
                ("rendezvous", "node-1"): "rendezvous/node-1.crt"}
    for (kind, name), rel in expected.items():
        assert issue(root, kind, name) == root / rel
        assert load_identity(root, kind, name).cert_pem == (root / rel).read_bytes()
    # etcd maps a client certificate's CN to its user; --peer-cert-allowed-cn keys on it too
    assert load_cert(root / "etcd/m0.crt").subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value \
        == "ftd-etcd"


def test_validity_is_configurable(root: Path) -> None:
    cert = load_cert(issue(root, "node", "n", days=30))
    assert 29 <= (cert.not_valid_after_utc - dt.datetime.now(dt.timezone.utc)).days <= 30


def test_issue_refuses_to_overwrite_and_rotate_replaces(root: Path) -> None:
    issue(root, "coordinator", "c0", hosts=["coord.example"])
    before = load_identity(root, "coordinator", "c0")
    stamp = IdentityFiles(root, "coordinator", "c0").stamp()
    with pytest.raises(PkiError, match="ftctl certs rotate coordinator c0"):
        issue(root, "coordinator", "c0")
    rotate(root, "coordinator", "c0")
    after = load_identity(root, "coordinator", "c0")
    assert serial_of(after.cert_pem) != serial_of(before.cert_pem)
    assert after.key_pem != before.key_pem
    assert cert_hosts(load_cert(root / "coordinators/c0.crt")) == ["coord.example"]  # kept
    assert IdentityFiles(root, "coordinator", "c0").stamp() != stamp
    assert mode(root / "coordinators/c0.key") == 0o600
    assert not [p for p in (root / "coordinators").iterdir() if p.name.endswith(".tmp")]


def test_rotate_of_an_unissued_identity_names_the_path(root: Path) -> None:
    with pytest.raises(PkiError, match=r"nodes/ghost\.crt does not exist"):
        rotate(root, "node", "ghost")


def test_missing_and_unreadable_files_name_the_path(root: Path) -> None:
    with pytest.raises(PkiError, match=r"node certificate .*nodes/n1\.crt does not exist"):
        load_identity(root, "node", "n1")
    issue(root, "node", "n1")
    key = root / "nodes/n1.key"
    key.unlink()
    key.mkdir()  # unreadable as a file, even for root
    with pytest.raises(PkiError, match=r"node key .*nodes/n1\.key is unreadable"):
        load_identity(root, "node", "n1")
    (root / "nodes/n1.crt").write_text("garbage")
    with pytest.raises(PkiError, match=r"nodes/n1\.crt is not a PEM certificate"):
        load_identity(root, "node", "n1")


def test_expired_certificate(root: Path) -> None:
    issue(root, "node", "old", days=0)
    with pytest.raises(PkiError, match=r"certificate .*nodes/old\.crt expired on .*ftctl certs rotate"):
        load_identity(root, "node", "old")


def test_certificate_of_a_foreign_ca(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    init_ca(other, "c1")  # same cluster name, another CA
    issue(other, "node", "n1")
    (root / "nodes").mkdir(mode=0o700)
    for ext in ("crt", "key"):
        shutil.copy(other / f"nodes/n1.{ext}", root / f"nodes/n1.{ext}")
    with pytest.raises(PkiError, match=r"nodes/n1\.crt was not issued by the CA in .*ca\.crt"):
        load_identity(root, "node", "n1")


def test_certificate_for_another_identity_or_key(root: Path) -> None:
    issue(root, "node", "n1")
    issue(root, "node", "n2")
    shutil.copy(root / "nodes/n1.crt", root / "nodes/n3.crt")
    shutil.copy(root / "nodes/n1.key", root / "nodes/n3.key")
    with pytest.raises(PkiError, match=r"nodes/n3\.crt is for node/n1, expected node/n3"):
        load_identity(root, "node", "n3")
    shutil.copy(root / "nodes/n2.key", root / "nodes/n1.key")  # e.g. caught between a rotation's renames
    with pytest.raises(PkiError, match=r"key .*nodes/n1\.key does not belong to certificate .*nodes/n1\.crt"):
        IdentityFiles(root, "node", "n1").load(attempts=2)


def test_bad_names_and_kinds(root: Path) -> None:
    for kind, name in (("node", "../evil"), ("node", ".."), ("node", ""), ("admin", "x"), ("node", "a/b")):
        with pytest.raises(PkiError, match=r"bad node name|unknown identity kind"):
            issue(root, kind, name)
    with pytest.raises(PkiError, match="bad host"):
        issue(root, "node", "n1", hosts=["not a host"])
    with pytest.raises(PkiError, match="bad cluster name"):
        init_ca(root.parent / "x", "a/b")
    with pytest.raises(PkiError, match=r"CA certificate .*nothing/ca\.crt does not exist"):
        issue(root.parent / "nothing", "node", "n1")


names = st.from_regex(r"[A-Za-z0-9._-]{1,40}", fullmatch=True).filter(lambda s: set(s) != {"."})


@given(cluster=st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True), kind=st.sampled_from(KINDS), name=names)
def test_spiffe_round_trip(cluster: str, kind: str, name: str) -> None:
    assert parse_spiffe(spiffe_uri(cluster, kind, name)) == Identity(kind, name, cluster)


@given(st.text(max_size=80))
def test_parse_spiffe_never_crashes(text: str) -> None:
    found = parse_spiffe(text)
    assert found is None or found.uri == text


def test_ftctl_certs_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {certs.ENV_PKI_DIR: str(tmp_path / "pki")}

    def ftctl(*argv: str) -> int:
        parser = certs.argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command", required=True)
        certs.register(sub)
        return certs.run(parser.parse_args(["certs", *argv]), env)

    assert ftctl("init", "--cluster", "demo") == 0
    assert ftctl("issue", "node", "n1", "--host", "n1.example") == 0
    assert ftctl("issue", "node", "n2", "--pki-dir", str(tmp_path / "other")) == 1  # the flag wins over the env
    assert "other/ca.crt does not exist" in capsys.readouterr().err
    assert ftctl("--pki-dir", str(tmp_path / "pki"), "issue", "coordinator", "c0") == 0
    serial = serial_of((tmp_path / "pki/nodes/n1.crt").read_bytes())
    assert ftctl("rotate", "node", "n1") == 0
    assert serial_of((tmp_path / "pki/nodes/n1.crt").read_bytes()) != serial
    assert ftctl("issue", "node", "n1") == 1
    assert "ftctl certs rotate node n1" in capsys.readouterr().err
    assert ftctl("list", "--json") == 0
    rows = certs.json.loads(capsys.readouterr().out)
    assert [r["identity"] for r in rows] == [None, "coordinator/c0", "node/n1"]
    assert rows[2]["hosts"] == ["n1.example"]
    assert certs.main(["--workdir", str(tmp_path / "none"), "list"]) == 1
    assert "no PKI directory at" in capsys.readouterr().err
    assert certs.main(["rotate", "node", "n1"]) == 1  # no PKI directory given


def test_bootstrap_creates_what_is_missing_once(tmp_path: Path) -> None:
    root = tmp_path / "cluster" / "pki"
    issued = bootstrap(root, "demo", nodes=["node-0", "node-1"], coordinators=["c0"], etcd=["etcd0"],
                           hosts=["127.0.0.1"])
    rel = sorted(str(p.relative_to(root)) for p in issued)
    assert rel == ["coordinators/c0.crt", "etcd/etcd0.crt", "nodes/node-0.crt", "nodes/node-1.crt", "operator.crt",
                   "rendezvous/node-0.crt", "rendezvous/node-1.crt"]
    assert mode(root) == 0o700 and mode(root / "ca.key") == 0o600
    assert all(mode(p.with_suffix(".key")) == 0o600 for p in issued)
    assert bootstrap(root, "demo", nodes=["node-0", "node-1", "node-2"]) == [root / "nodes/node-2.crt",
                                                                                 root / "rendezvous/node-2.crt"]
    assert load_identity(root, "node", "node-2").ca_pem == (root / "ca.crt").read_bytes()
    with pytest.raises(PkiError, match=r"the CA in .*ca\.crt is of cluster 'demo', not 'prod'"):
        bootstrap(root, "prod")


def test_existing_directories_keep_their_mode(tmp_path: Path) -> None:
    shared = tmp_path / "etc-ftd"
    shared.mkdir(mode=0o755)
    init_ca(shared, "c1")
    assert mode(shared) == 0o755
    issue(shared, "node", "n1")
    assert mode(shared / "nodes") == 0o700


def test_a_certificate_near_its_end_is_warned_about(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    issue(root, "node", "soon", days=3)
    with caplog.at_level("WARNING", logger="ftd.pki"):
        load_identity(root, "node", "soon")
    assert "nodes/soon.crt expires in 2 days" in caplog.text
    assert "ftctl certs rotate node soon" in caplog.text


# ---- etcd's client name (docs/security.md#etcd-least-privilege-and-space) -----------------------


def reaches_etcd(path: Path) -> bool:
    return has_etcd_client_name(load_certs(path, "certificate")[0])


def test_only_coordinators_and_members_reach_etcd_by_default() -> None:
    assert [k for k in KINDS if etcd_client_name(k)] == ["coordinator", "etcd"]
    assert etcd_client_name("rendezvous", True) and not etcd_client_name("rendezvous", False)
    for kind in ("node", "operator"):  # etcd 3.4 would let them keep any lease alive
        with pytest.raises(PkiError, match=f"{kind} certificates never reach etcd"):
            etcd_client_name(kind, True)
    with pytest.raises(PkiError, match="coordinator certificates always carry etcd's client name"):
        etcd_client_name("coordinator", False)


def test_a_rendezvous_certificate_reaches_etcd_only_when_asked_and_rotation_keeps_it(root: Path) -> None:
    plain, opted = issue(root, "rendezvous", "n1"), issue(root, "rendezvous", "n2", etcd_client=True)
    assert not reaches_etcd(plain) and reaches_etcd(opted)
    assert reaches_etcd(issue(root, "coordinator", "c0")) and not reaches_etcd(issue(root, "node", "n1"))
    assert not reaches_etcd(rotate(root, "rendezvous", "n1")) and reaches_etcd(rotate(root, "rendezvous", "n2"))
    assert cert_hosts(load_certs(opted, "certificate")[0]) == []  # the CA's name, not a host to keep
    assert reaches_etcd(rotate(root, "rendezvous", "n1", etcd_client=True))
    assert not reaches_etcd(rotate(root, "rendezvous", "n1", etcd_client=False))


def test_bootstrap_gives_rendezvous_certificates_etcd_only_when_the_cluster_opts_in(tmp_path: Path) -> None:
    root = tmp_path / "pki"
    bootstrap(root, "demo", nodes=["node-0"], coordinators=["c0"])
    assert not reaches_etcd(root / "rendezvous/node-0.crt") and reaches_etcd(root / "coordinators/c0.crt")
    assert bootstrap(root, "demo", nodes=["node-0"], etcd_rendezvous=True) == [root / "rendezvous/node-0.crt"]
    assert reaches_etcd(root / "rendezvous/node-0.crt")


def test_ftctl_certs_etcd_client_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def ftctl(*argv: str) -> int:
        return certs.main(["--pki-dir", str(tmp_path / "pki"), *argv])

    assert ftctl("init", "--cluster", "c1") == 0
    assert ftctl("issue", "rendezvous", "n1", "--etcd-client") == 0
    assert reaches_etcd(tmp_path / "pki/rendezvous/n1.crt")
    assert ftctl("rotate", "rendezvous", "n1", "--keep-old") == 0  # keeps it
    assert reaches_etcd(tmp_path / "pki/rendezvous/n1.crt")
    assert ftctl("rotate", "rendezvous", "n1", "--keep-old", "--no-etcd-client") == 0
    assert not reaches_etcd(tmp_path / "pki/rendezvous/n1.crt")
    assert ftctl("issue", "node", "n1", "--etcd-client") == 1
    assert "node certificates never reach etcd" in capsys.readouterr().err
    assert not (tmp_path / "pki/nodes/n1.crt").exists()
