"""deploy/kubernetes: etcd (its three members, mutual TLS on both ports, compaction and quota, the same
flags as deploy/systemd/etcd.env), the Job that enables its auth with the systemd script, and the PKI
Secrets docs/kubernetes.md's commands make: every file a pod mounts, with certificates naming every host
their clients dial. The rest of deploy/kubernetes: test_deploy_kubernetes.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes_manifests import (
    COORDINATOR,
    FIELD_VALUES,
    K8S_VERSION,
    NAMESPACE,
    PKI_DIR,
    ROOT,
    container_of,
    container_port,
    env_entry,
    find,
    matches,
    mounted_files,
    pod_spec_of,
    replica_names,
    resolved_env,
    validate,
    workloads,
)

from ftd.ca import init_ca, issue
from ftd.identity import cert_hosts, identity_of, paths
from ftd.rpc import parse_hostport

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOCS_KUBERNETES = ROOT / "docs" / "kubernetes.md"


# ---- etcd ----------------------------------------------------------------------------------------------


def _etcd_args() -> dict[str, str]:
    container = container_of("StatefulSet", "etcd", "etcd")
    assert all(a.startswith("--") and "=" in a for a in container["args"]), "write every flag as --flag=value"
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert len(args) == len(container["args"]), "a flag is given twice"
    return args


def test_etcd_is_three_members_with_stable_names() -> None:
    sts = find("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady would deadlock the bootstrap
    peer = find("Service", sts["spec"]["serviceName"])
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    container = container_of("StatefulSet", "etcd", "etcd")
    assert container["image"] == "quay.io/coreos/etcd:v3.5.17"
    args = _etcd_args()
    assert args["name"] == "$(POD_NAME)"
    assert env_entry(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert members == {f"{name}-{i}": f"https://{name}-{i}.{service}.{NAMESPACE}.svc:2380" for i in range(3)}
    # Each pod advertises exactly the URL the others expect for it.
    for pod_name, url in members.items():
        assert args["initial-advertise-peer-urls"].replace("$(POD_NAME)", pod_name) == url
    assert args["initial-cluster-state"] == "new"
    client_port = container_port(container, "client")
    assert client_port == 2379 and args["listen-client-urls"] == f"https://0.0.0.0:{client_port}"
    assert args["advertise-client-urls"] == f"https://$(POD_NAME).{service}.{NAMESPACE}.svc:{client_port}"
    # The probes use the plain-HTTP metrics listener: the kubelet has no client certificate for 2379.
    metrics_port = container_port(container, "metrics")
    assert args["listen-metrics-urls"] == f"http://0.0.0.0:{metrics_port}"
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"].split("?")[0] == "/health", probe
        assert "exclude=NOSPACE" in get["path"], f"{probe}: a NOSPACE alarm is an alert, not a restart"
        assert container_port(container, get["port"]) == metrics_port, probe
    assert "serializable=true" in container["livenessProbe"]["httpGet"]["path"]  # no restarts on a lost quorum


def test_etcd_requires_mutual_tls_on_both_ports_from_its_pki_secret(tmp_path: Path) -> None:
    args = _etcd_args()
    for url in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
        assert args[url].startswith("https://"), url
    assert all(u.split("=", 1)[1].startswith("https://") for u in args["initial-cluster"].split(","))
    assert args["client-cert-auth"] == args["peer-client-cert-auth"] == "true"
    for side in ("", "peer-"):
        assert args[f"{side}cert-file"] == f"{PKI_DIR}/etcd/$(POD_NAME).crt", side
        assert args[f"{side}key-file"] == f"{PKI_DIR}/etcd/$(POD_NAME).key", side
        assert args[f"{side}trusted-ca-file"] == f"{PKI_DIR}/ca.crt", side
    # Only ftd's etcd certificates join as peers: the CN ftd/ca.py gives the etcd kind.
    init_ca(tmp_path, "training-a")
    crt, _ = paths(tmp_path, "etcd", "etcd-0")
    issue(tmp_path, "etcd", "etcd-0")
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    assert args["peer-cert-allowed-cn"] == cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    files = mounted_files("StatefulSet", "etcd", "etcd")
    assert files[f"{PKI_DIR}/ca.crt"] == ("ftd-pki-etcd", "ca.crt")
    for member in replica_names("StatefulSet", "etcd"):
        for suffix in ("crt", "key"):
            path = args["cert-file" if suffix == "crt" else "key-file"].replace("$(POD_NAME)", member)
            assert files[path] == ("ftd-pki-etcd", f"{member}.{suffix}"), path
    pod = pod_spec_of("StatefulSet", "etcd")
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    assert {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v} == {0o440}


def test_etcd_compacts_its_history_and_states_its_quota() -> None:
    args = _etcd_args()
    assert args["auto-compaction-mode"] == "periodic" and args["auto-compaction-retention"] == "1h"
    quota = int(args["quota-backend-bytes"])
    assert quota == 2 * 1024**3
    (claim,) = find("StatefulSet", "etcd")["spec"]["volumeClaimTemplates"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and quota * 2 <= int(size.removesuffix("Gi")) * 1024**3  # room to defragment
    # Prometheus scrapes the members' own metrics (FtdEtcdNoSpace) from the metrics listener.
    annotations = find("StatefulSet", "etcd")["spec"]["template"]["metadata"]["annotations"]
    container = container_of("StatefulSet", "etcd", "etcd")
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container_port(container, "metrics")


def _etcd_env_flags() -> dict[str, str]:
    """deploy/systemd/etcd.env as etcd flags (ETCD_FOO_BAR=v is --foo-bar=v)."""
    text = (ROOT / "deploy" / "systemd" / "etcd.env").read_text()
    pairs = [line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")]
    assert all(k.startswith("ETCD_") for k, _ in pairs)
    return {k.removeprefix("ETCD_").lower().replace("_", "-"): v for k, v in pairs}


def test_etcd_flags_match_the_systemd_example() -> None:
    """The StatefulSet and deploy/systemd/etcd.env set the same flags; where they may differ (names, URLs,
    file paths: per host), the scheme and port of every URL still agree."""
    k8s, systemd = _etcd_args(), _etcd_env_flags()
    assert set(k8s) == set(systemd)
    per_host = {"name", "data-dir", "listen-client-urls", "advertise-client-urls", "listen-peer-urls",
                "initial-advertise-peer-urls", "initial-cluster", "listen-metrics-urls", "cert-file", "key-file",
                "trusted-ca-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file"}
    assert {f: k8s[f] for f in set(k8s) - per_host} == {f: systemd[f] for f in set(k8s) - per_host}
    for flag in per_host & {f for f in k8s if f.endswith("urls")}:
        scheme_port = [(u.split("://")[0], u.rsplit(":", 1)[1]) for u in (k8s[flag], systemd[flag])]
        assert scheme_port[0] == scheme_port[1], flag
    for flag in per_host & {f for f in k8s if f.endswith("file")}:
        assert k8s[flag].startswith(PKI_DIR) and systemd[flag].startswith(PKI_DIR), flag


def test_etcd_keeps_its_data_on_a_claim_and_has_a_client_service() -> None:
    sts = find("StatefulSet", "etcd")
    container = container_of("StatefulSet", "etcd", "etcd")
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    data_dir = _etcd_args()["data-dir"]
    assert any(n in claims and Path(data_dir).is_relative_to(p) for n, p in mounts.items())
    client = find("Service", "etcd-client")
    assert matches(client["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]


# ---- etcd's auth: the Job -------------------------------------------------------------------------------


def test_the_auth_job_runs_the_systemd_script_against_the_members() -> None:
    script = (ROOT / "deploy" / "systemd" / "etcd-enable-auth.sh").read_text()
    assert find("ConfigMap", "ftd-etcd-auth")["data"]["etcd-enable-auth.sh"] == script
    job = find("Job", "ftd-etcd-auth")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0  # re-created by the next apply, never a stale immutable Job
    container = container_of("Job", "ftd-etcd-auth", "enable-auth")
    assert container["image"] == container_of("StatefulSet", "etcd", "etcd")["image"]  # its etcdctl matches
    env = resolved_env(container)
    etcd = find("StatefulSet", "etcd")
    members = [f"https://{m}.{etcd['spec']['serviceName']}.{NAMESPACE}.svc:2379"
               for m in replica_names("StatefulSet", "etcd")]
    assert env["ETCDCTL_ENDPOINTS"].split(",") == members
    files = mounted_files("Job", "ftd-etcd-auth", "enable-auth")
    # A member's own certificate (CN ftd-etcd, the user the script makes root).
    assert files[env["ETCDCTL_CACERT"]] == ("ftd-pki-etcd", "ca.crt")
    assert files[env["ETCDCTL_CERT"]][0] == files[env["ETCDCTL_KEY"]][0] == "ftd-pki-etcd"
    assert Path(env["ETCDCTL_CERT"]).parent.name == "etcd"
    assert "user ftd-etcd root" in script
    # etcd's image has no shell: the init container provides busybox and the applets the script calls.
    (init,) = pod_spec_of("Job", "ftd-etcd-auth")["initContainers"]
    applets = set(re.search(r"for applet in ([a-z ]+);", init["command"][-1]).group(1).split())  # type: ignore[union-attr]
    used = set(re.findall(r"\b(sed|sleep|tail|tr|grep|awk|cut|head|cat|wc)\b", script))
    assert used <= applets, f"the script calls {sorted(used - applets)}, which the init container does not link"
    assert container["command"][0] == "/tools/bin/sh" and "sh" in applets
    assert env["ETCDCTL_BIN"] == "/usr/local/bin/etcdctl"


def test_the_auth_roles_are_the_documented_ones() -> None:
    script = (ROOT / "deploy" / "systemd" / "etcd-enable-auth.sh").read_text()
    roles = dict(re.findall(r"^role (\S+) (.+)$", script, re.MULTILINE))
    assert {r: p.split() for r, p in roles.items()} == {
        # torch's etcd-v3 handler (training/etcd_v3.py): the rendezvous state and its c10d store.
        "ftd-rendezvous": ["/torch/elastic/rendezvous/", "/torch/elastic/store/"],
    }
    users = dict(re.findall(r"^user (\S+) (\S+)$", script, re.MULTILINE))
    # The coordinator is root: etcd 3.4 lets only root defragment (the leader's NOSPACE recovery).
    assert users == {"root": "root", "ftd-etcd": "root", "ftd-coordinator": "root",
                     "ftd-rendezvous": "ftd-rendezvous"}
    etcd_v3 = (ROOT / "training" / "etcd_v3.py").read_text()
    assert '"/torch/elastic/rendezvous"' in etcd_v3 and 'f"/torch/elastic/store/{params.run_id}"' in etcd_v3


# ---- PKI Secrets: the documented commands make what the pods mount ---------------------------------------


def _doc_block(marker: str) -> str:
    """The fenced code block right after ``<!-- marker -->`` in docs/kubernetes.md."""
    text = DOCS_KUBERNETES.read_text()
    found = re.search(rf"<!-- {re.escape(marker)} -->\s*```[a-z]*\n(.*?)```", text, re.DOTALL)
    assert found, f"docs/kubernetes.md has no code block after <!-- {marker} -->"
    return found.group(1)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (create secret --dry-run=client) is not installed")
def test_the_documented_pki_commands_make_the_secrets_the_pods_mount(tmp_path: Path) -> None:
    """Runs docs/kubernetes.md's PKI block (ftctl certs, then kubectl create secret, client-side only) and
    checks that every Secret file a pod mounts is there, and that each certificate names every host its
    clients dial it at (TLS verifies the dialled name)."""
    block = _doc_block("pki-secrets")
    script = "set -euo pipefail\nkubectl() { command kubectl \"$@\" --dry-run=client -o yaml; echo ---; }\n" + block
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    secrets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out.stdout) if d and d.get("kind") == "Secret"}
    for doc in secrets.values():
        assert validate(doc) == K8S_VERSION
    mounted = {}
    for workload in workloads():
        ns = workload["metadata"]["namespace"]
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            secret = volume.get("secret")
            if secret and secret["secretName"].startswith("ftd-pki-"):
                mounted.setdefault((ns, secret["secretName"]), set()).update(i["key"] for i in secret["items"])
    assert mounted
    for (ns, name), keys in mounted.items():
        assert name in secrets, f"docs/kubernetes.md does not create the Secret {name}"
        assert secrets[name]["metadata"]["namespace"] == ns
        assert keys <= set(secrets[name]["data"]), f"{name} lacks {sorted(keys - set(secrets[name]['data']))}"
    # The cluster the CA was made for is the coordinators' `cluster`.
    config = tomllib.loads(find("ConfigMap", "ftd-coordinator")["data"]["coordinator.toml"])
    pki_dir = tmp_path / "pki"
    assert identity_of(paths(pki_dir, "etcd", "etcd-0")[0].read_bytes()).cluster == config["cluster"]  # type: ignore[union-attr]
    # Every name a client dials is in the certificate it is served with.
    etcd_hosts = {parse_hostport(e)[0] for e in config["etcd_endpoints"].split(",")}
    job_env = resolved_env(container_of("Job", "ftd-etcd-auth", "enable-auth"))
    etcd_hosts |= {u.split("://")[1].rsplit(":", 1)[0] for u in job_env["ETCDCTL_ENDPOINTS"].split(",")}
    etcd_hosts.add(f"etcd-client.{NAMESPACE}.svc")
    for member in replica_names("StatefulSet", "etcd"):
        cert = x509.load_pem_x509_certificate(paths(pki_dir, "etcd", member)[0].read_bytes())
        own = {h for h in etcd_hosts if h.startswith(f"{member}.")}
        assert own and own | {f"etcd-client.{NAMESPACE}.svc"} <= set(cert_hosts(cert)), member
    agent_config = tomllib.loads(find("ConfigMap", "ftd-agent")["data"]["agent.toml"])
    service_host = parse_hostport(agent_config["coordinators"])[0]
    coordinator = container_of(*COORDINATOR, "coordinator")
    for replica in replica_names(*COORDINATOR):
        env = resolved_env(coordinator, {**FIELD_VALUES, "metadata.name": replica})
        advertised = parse_hostport(env["FTD_COORDINATOR_ADVERTISE"])[0]
        cert = x509.load_pem_x509_certificate(paths(pki_dir, "coordinator", replica)[0].read_bytes())
        assert {advertised, service_host} <= set(cert_hosts(cert)), replica


