"""deploy/kubernetes: every manifest validates against the Kubernetes OpenAPI schemas, and says what ftd needs.

Validation uses the ``kubernetes-validate`` package (the schemas ship inside it, no network) against
Kubernetes 1.30 in strict mode, where an unknown field is an error. The semantic tests then check what
a schema cannot: replica counts, probes on the port the daemon really serves, the downward-API
environment, the etcd membership and its TLS flags, the PKI each pod mounts, Pod Security levels (a small
checker of the `baseline` and `restricted` rules), and that the ConfigMaps plus the pods' environment are
accepted by the daemons' own settings loader. The network policies: tests/test_deploy_networkpolicy.py.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from ftd import pki
from ftd.agent.settings import ENV_PREFIX as AGENT_ENV_PREFIX
from ftd.agent.settings import AgentSettings
from ftd.coordinator.settings import ENV_PREFIX as COORDINATOR_ENV_PREFIX
from ftd.coordinator.settings import CoordinatorSettings
from ftd.ftctl.localcluster import ClusterFile
from ftd.rpc import parse_hostport
from ftd.settings import load

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30"
MANIFESTS = ("namespace.yaml", "networkpolicy.yaml", "etcd.yaml", "etcd-auth.yaml", "coordinator.yaml", "agent.yaml")
# Applied by hand, not by the kustomization (deploy/kubernetes/volcano has its own test file).
OPTIONAL = ("optional/dcgm-exporter.yaml",)
NAMESPACE = "ftd"  # the control plane: etcd, coordinators, their Secrets (Pod Security `restricted`)
NODE_NAMESPACE = "ftd-node"  # the agents and the training beside them (`privileged`: hostPath, host network)
PKI_DIR = "/etc/ftd/pki"
DOCS_KUBERNETES = ROOT / "docs" / "kubernetes.md"
# What the downward API would give one pod, for the tests that run the pods' settings through ftd.
FIELD_VALUES = {
    "metadata.name": "pod-xyz",
    "status.podIP": "10.1.2.3",
    "status.hostIP": "192.0.2.7",
    "spec.nodeName": "gpu-node-7",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def _load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d is not None]


DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in MANIFESTS for doc in _load(name)]
OPTIONAL_DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in OPTIONAL for doc in _load(name)]


def _find(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name
             and namespace in (None, d["metadata"].get("namespace"))]
    assert len(found) == 1, f"expected one {kind}/{name} in deploy/kubernetes, found {len(found)}"
    return found[0]


def _validate(doc: dict[str, Any], strict: bool = True) -> str:
    """Raises kubernetes_validate.ValidationError (or SchemaNotFoundError for an unknown kind)."""
    return str(kubernetes_validate.validate(doc, K8S_VERSION, strict=strict))


def _pod_spec(kind: str, name: str) -> dict[str, Any]:
    return dict(_find(kind, name)["spec"]["template"]["spec"])


def _container(kind: str, name: str, container: str) -> dict[str, Any]:
    found = [c for c in _pod_spec(kind, name)["containers"] if c["name"] == container]
    assert len(found) == 1, f"{kind}/{name} has no container {container!r}"
    return dict(found[0])


def _container_port(container: dict[str, Any], port: int | str) -> int:
    """The container port a probe or targetPort refers to, by number or by name."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def _env_entry(container: dict[str, Any], name: str) -> dict[str, Any]:
    found = [e for e in container.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {container['name']} does not set {name} exactly once"
    return dict(found[0])


def _resolved_env(container: dict[str, Any], fields: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API fields from ``fields`` (default
    FIELD_VALUES), secret keys from the Secret in the manifests, and $(VAR) expanded from the variables
    defined before it."""
    fields = FIELD_VALUES if fields is None else fields
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            value = re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                           lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            value = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            secret = _find("Secret", ref["name"])
            value = secret.get("stringData", {})[ref["key"]]
        else:
            raise AssertionError(f"unexpected env source in {entry}")
        env[entry["name"]] = value
    return env


def _settings(kind: str, name: str, container_name: str, cls: type, env_prefix: str, tmp_path: Path) -> Any:
    """Runs the container's command line, its ConfigMap and its environment through ftd's settings loader."""
    pod = _pod_spec(kind, name)
    container = _container(kind, name, container_name)
    argv = list(container["command"])
    config = Path(argv[argv.index("--config") + 1])
    mounts = [m for m in container["volumeMounts"] if config.is_relative_to(m["mountPath"])]
    assert len(mounts) == 1, f"{config} is not on exactly one volume of {container_name}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    data = _find("ConfigMap", volume["configMap"]["name"])["data"]
    key = str(config.relative_to(mounts[0]["mountPath"]))
    assert key in data, f"ConfigMap {volume['configMap']['name']} has no {key} for --config {config}"
    local = tmp_path / key
    local.write_text(data[key])
    argv[argv.index("--config") + 1] = str(local)
    return load(cls, argv[1:], _resolved_env(container), prog=argv[0], env_prefix=env_prefix)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- schema validation -----------------------------------------------------------------------------------


def _id(name: str, doc: dict[str, Any]) -> str:
    return f"{name}:{doc['kind']}/{doc['metadata'].get('namespace', '-')}/{doc['metadata']['name']}"


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[_id(n, d) for n, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert _validate(doc) == K8S_VERSION


@pytest.mark.parametrize(("name", "doc"), OPTIONAL_DOCS, ids=[_id(n, d) for n, d in OPTIONAL_DOCS])
def test_optional_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert _validate(doc) == K8S_VERSION
    # Root and a hostPath (the kubelet's pod-resources socket): only the node namespace admits it.
    assert doc["metadata"].get("namespace") == NODE_NAMESPACE


def test_the_validator_rejects_a_wrong_type() -> None:
    broken = copy.deepcopy(_find("StatefulSet", "ftd-coordinator"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        _validate(broken)
    assert list(info.value.path) == ["spec", "replicas"]


def test_strict_mode_rejects_an_unknown_field() -> None:
    broken = copy.deepcopy(_find("DaemonSet", "ftd-agent"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/healthz"
    assert _validate(broken, strict=False) == K8S_VERSION  # only strict mode catches a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def test_an_unknown_kind_is_an_error_not_a_skip() -> None:
    doc = copy.deepcopy(_find("StatefulSet", "ftd-coordinator"))
    doc["apiVersion"] = "apps/v1beta9"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        _validate(doc)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    on_disk = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk) == sorted(MANIFESTS)
    images = {i["name"] for i in kustomization.get("images", [])}
    used = {c["image"].split(":")[0] for _, d in DOCS if d["kind"] in WORKLOADS
            for c in d["spec"]["template"]["spec"]["containers"]}
    assert "ftd" in images & used
    # networkpolicy.yaml is applied with the workloads it protects, never on its own.
    assert "networkpolicy.yaml" in kustomization["resources"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_kustomize_build_renders_valid_resources() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    assert len(rendered) == len(DOCS)
    for doc in rendered:
        assert _validate(doc) == K8S_VERSION


def test_optional_manifests_stay_out_of_the_kustomization() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert not set(kustomization["resources"]) & set(OPTIONAL)
    assert sorted(str(p.relative_to(K8S_DIR)) for p in (K8S_DIR / "optional").glob("*.yaml")) == sorted(OPTIONAL)


def test_dcgm_exporter_is_an_optional_scrape_target_like_the_agents() -> None:
    docs = {d["kind"]: d for _, d in OPTIONAL_DOCS}
    daemonset = docs["DaemonSet"]
    pod = daemonset["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["image"].startswith("nvcr.io/nvidia/k8s/dcgm-exporter:")
    env = {e["name"]: e.get("value") for e in container["env"]}
    listen_port = int(env["DCGM_EXPORTER_LISTEN"].rsplit(":", 1)[1])
    annotations = pod["metadata"]["annotations"]
    # The same discovery convention as the agent's pods (agent.yaml).
    agent_annotations = _find("DaemonSet", "ftd-agent")["spec"]["template"]["metadata"]["annotations"]
    assert set(annotations) == set(agent_annotations)
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == _container_port(container, "metrics") == listen_port
    assert env["DCGM_EXPORTER_KUBERNETES"] == "true"  # GPU series labelled with the pod using the GPU
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}  # no SYS_ADMIN
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_control_plane_and_the_node_side_have_their_own_namespaces() -> None:
    """agent.yaml is the node side (ftd-node); everything else is the control plane (ftd), apart from the
    default-deny policy each namespace gets. Secrets are namespace-scoped, so nothing in ftd-node can mount
    the coordinators' or etcd's keys."""
    assert _find("Namespace", NAMESPACE) and _find("Namespace", NODE_NAMESPACE)
    for name, doc in DOCS:
        where = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Namespace":
            assert "namespace" not in doc["metadata"], where
        elif name == "agent.yaml":
            assert doc["metadata"].get("namespace") == NODE_NAMESPACE, where
        elif doc["kind"] != "NetworkPolicy":
            assert doc["metadata"].get("namespace") == NAMESPACE, where
    policies = {(d["metadata"]["namespace"], d["metadata"]["name"]) for _, d in DOCS if d["kind"] == "NetworkPolicy"}
    assert {(NAMESPACE, "default-deny-ingress"), (NODE_NAMESPACE, "default-deny-ingress")} <= policies
    secrets = {v["secret"]["secretName"]: _ns for _ns, v in _volumes() if "secret" in v}
    assert {s for s, ns in secrets.items() if s.startswith("ftd-pki-")} == {"ftd-pki-etcd", "ftd-pki-coordinator"}
    assert all(ns == NAMESPACE for s, ns in secrets.items() if s.startswith("ftd-pki-"))


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] in WORKLOADS]


def _volumes() -> list[tuple[str, dict[str, Any]]]:
    """(namespace, volume) of every pod template."""
    return [(d["metadata"]["namespace"], v) for d in _workloads()
            for v in d["spec"]["template"]["spec"].get("volumes", [])]


# ---- coordinator ---------------------------------------------------------------------------------------

COORDINATOR = ("StatefulSet", "ftd-coordinator")
AWAITED = "settings pki_dir/etcd_*_file land with the mTLS wiring"


def _has_settings(cls: type, *names: str) -> bool:
    return set(names) <= {f.name for f in dataclasses.fields(cls)}


def _replicas(kind: str, name: str) -> list[str]:
    """The pod names of a StatefulSet: NAME-0 ... NAME-(replicas-1)."""
    assert kind == "StatefulSet"
    return [f"{name}-{i}" for i in range(_find(kind, name)["spec"]["replicas"])]


def _mounted_files(kind: str, name: str, container_name: str) -> dict[str, tuple[str, str]]:
    """Every file a container sees from a Secret volume: path -> (Secret, key). Secret volumes here list
    their items, so the file set is known without the cluster."""
    pod = _pod_spec(kind, name)
    container = next(c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == container_name)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    files: dict[str, tuple[str, str]] = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes.get(mount["name"], {}).get("secret")  # claim templates are not pod volumes
        if secret is None:
            continue
        assert mount.get("readOnly") is True, f"{name}: Secret volume {mount['name']} is mounted writable"
        assert secret.get("items"), f"{name}: Secret volume {mount['name']} lists no items"
        for item in secret["items"]:
            files[f"{mount['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return files


def test_coordinator_runs_two_replicas_on_different_nodes() -> None:
    sts = _find(*COORDINATOR)
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # neither replica waits for the other
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _matches(sts["spec"]["selector"]["matchLabels"], labels)
    terms = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and _matches(t["labelSelector"]["matchLabels"], labels)
               for t in terms)


def test_coordinator_probes_hit_healthz_and_readyz_on_the_metrics_port(tmp_path: Path) -> None:
    container = _container(*COORDINATOR, "coordinator")
    settings = _settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    metrics_port = parse_hostport(settings.metrics_listen)[1]
    assert metrics_port == 9401
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _container_port(container, get["port"]) == metrics_port, probe


def test_coordinator_settings_from_configmap_and_downward_api(tmp_path: Path) -> None:
    container = _container(*COORDINATOR, "coordinator")
    assert container["command"] == ["ftd-coordinator", "--config", "/etc/ftd/coordinator.toml"]
    assert _env_entry(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    names = [e["name"] for e in container["env"]]
    for later in ("FTD_COORDINATOR_ADVERTISE", "FTD_COORDINATOR_REPLICA_ID", "FTD_COORDINATOR_ETCD_CERT_FILE",
                  "FTD_COORDINATOR_ETCD_KEY_FILE"):
        assert names.index("POD_NAME") < names.index(later), f"$(POD_NAME) must be defined before {later}"
    settings = _settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    sts = _find(*COORDINATOR)
    pod = FIELD_VALUES["metadata.name"]
    grpc_port = parse_hostport(settings.listen)[1]
    assert settings.replica_id == pod  # stable across restarts: the name of the replica's certificate
    # Leader hints carry `advertise`: the pod's stable name under the headless Service (which its certificate
    # names), not a pod IP that no certificate issued beforehand can carry.
    headless = _find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert _matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert settings.advertise == f"{pod}.{sts['spec']['serviceName']}.{NAMESPACE}.svc:{grpc_port}"
    assert _container_port(container, "grpc") == grpc_port == 7400
    assert _container_port(container, "metrics") == parse_hostport(settings.metrics_listen)[1]
    # The coordinators use the etcd members of etcd.yaml, by their stable DNS names.
    etcd = _find("StatefulSet", "etcd")
    members = {f"{m}.{etcd['spec']['serviceName']}.{NAMESPACE}.svc:2379" for m in _replicas("StatefulSet", "etcd")}
    assert set(settings.etcd_endpoints.split(",")) == members


def test_coordinator_service_and_disruption_budget() -> None:
    container = _container(*COORDINATOR, "coordinator")
    labels = _find(*COORDINATOR)["spec"]["template"]["metadata"]["labels"]
    service = _find("Service", "ftd-coordinator")
    assert _matches(service["spec"]["selector"], labels)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 7400 and _container_port(container, ports["grpc"]["targetPort"]) == 7400
    assert ports["metrics"]["port"] == 9401 and _container_port(container, ports["metrics"]["targetPort"]) == 9401
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9401"
    assert annotations["prometheus.io/path"] == "/metrics"
    pdb = _find("PodDisruptionBudget", "ftd-coordinator")
    assert pdb["spec"]["minAvailable"] == 1
    assert _matches(pdb["spec"]["selector"]["matchLabels"], labels)


def test_every_coordinator_replica_finds_its_certificate_in_the_pki_secret() -> None:
    """FTD_COORDINATOR_PKI_DIR and the etcd client files resolve, for each replica, to files of the Secret
    ftd-pki-coordinator in ftd's PKI layout (ca.crt, coordinators/<replica id>.crt|.key)."""
    container = _container(*COORDINATOR, "coordinator")
    files = _mounted_files(*COORDINATOR, "coordinator")
    pod = _pod_spec(*COORDINATOR)
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]  # 0440 files, readable
    assert {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v} == {0o440}
    for replica in _replicas(*COORDINATOR):
        env = _resolved_env(container, {**FIELD_VALUES, "metadata.name": replica})
        assert env["FTD_COORDINATOR_PKI_DIR"] == PKI_DIR
        assert env["FTD_COORDINATOR_REPLICA_ID"] == replica
        expected = {"ETCD_CA_FILE": f"{PKI_DIR}/ca.crt", "ETCD_CERT_FILE": f"{PKI_DIR}/coordinators/{replica}.crt",
                    "ETCD_KEY_FILE": f"{PKI_DIR}/coordinators/{replica}.key"}
        for var, path in expected.items():
            assert env[f"FTD_COORDINATOR_{var}"] == path, (replica, var)
            assert files[path][0] == "ftd-pki-coordinator", (replica, path)
        assert files[f"{PKI_DIR}/coordinators/{replica}.crt"][1] == f"{replica}.crt"
        assert files[f"{PKI_DIR}/coordinators/{replica}.key"][1] == f"{replica}.key"


@pytest.mark.xfail(not _has_settings(CoordinatorSettings, "pki_dir", "etcd_ca_file", "etcd_cert_file", "etcd_key_file"),
                   reason=AWAITED, strict=False)
def test_coordinator_settings_take_the_pki_and_etcd_tls_files(tmp_path: Path) -> None:
    settings = _settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    pod = FIELD_VALUES["metadata.name"]
    assert str(settings.pki_dir) == PKI_DIR
    assert str(settings.etcd_ca_file) == f"{PKI_DIR}/ca.crt"
    assert str(settings.etcd_cert_file) == f"{PKI_DIR}/coordinators/{pod}.crt"
    assert str(settings.etcd_key_file) == f"{PKI_DIR}/coordinators/{pod}.key"


# ---- agent ---------------------------------------------------------------------------------------------


def test_agent_identity_comes_from_the_node(tmp_path: Path) -> None:
    container = _container("DaemonSet", "ftd-agent", "agent")
    assert _env_entry(container, "FTD_AGENT_NODE_ID")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert _env_entry(container, "FTD_AGENT_HOST")["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert settings.effective_node_id == FIELD_VALUES["spec.nodeName"]
    assert settings.effective_host == FIELD_VALUES["status.hostIP"]
    # The registered gRPC address (drills dial it) is the pod IP, on the declared container port.
    assert settings.listen == f"{FIELD_VALUES['status.podIP']}:{_container_port(container, 'grpc')}"
    # Drills need an operator certificate; no second factor (drill token) ships with the manifest.
    assert settings.drill_token == "" and settings.drill_token_file is None
    assert not {e["name"] for e in container["env"]} & {"FTD_AGENT_DRILL_TOKEN", "FTD_AGENT_DRILL_TOKEN_FILE"}
    assert settings.train_cmd == ""  # the manifest launches no training; see the comment in agent.yaml
    service = _find("Service", "ftd-coordinator")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert settings.coordinators == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{grpc_port}"
    assert not _pod_spec("DaemonSet", "ftd-agent").get("hostNetwork", False)


def test_agent_mounts_its_three_host_directories(tmp_path: Path) -> None:
    pod = _pod_spec("DaemonSet", "ftd-agent")
    container = _container("DaemonSet", "ftd-agent", "agent")
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    writable = {v["name"]: v["hostPath"] for v in pod["volumes"]
                if "hostPath" in v and not mounts[v["name"]].get("readOnly")}
    assert sorted(h["path"] for h in writable.values()) == ["/mnt/hdd/ftd", "/mnt/ssd/ftd", "/var/lib/ftd"]
    assert all(h["type"] == "DirectoryOrCreate" for h in writable.values())
    by_host = {h["path"]: Path(mounts[name]["mountPath"]) for name, h in writable.items()}
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    # Where the agent writes is where the host directories are mounted.
    assert settings.workdir == by_host["/var/lib/ftd"]
    assert settings.effective_socket == by_host["/var/lib/ftd"] / "agent.sock"
    assert settings.tiers == {"ssd": by_host["/mnt/ssd/ftd"], "hdd": by_host["/mnt/hdd/ftd"]}


def test_agent_takes_its_node_certificate_from_the_node_not_from_a_secret() -> None:
    """A Secret with every node's key would sit on every node; each node's own files are a read-only
    hostPath instead (agent.yaml), which must exist: type Directory, not DirectoryOrCreate."""
    pod = _pod_spec("DaemonSet", "ftd-agent")
    container = _container("DaemonSet", "ftd-agent", "agent")
    assert _resolved_env(container)["FTD_AGENT_PKI_DIR"] == PKI_DIR
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == PKI_DIR]
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": PKI_DIR, "type": "Directory"}
    assert not [v for v in pod["volumes"] if "secret" in v or "projected" in v]
    assert pod["automountServiceAccountToken"] is False


def test_volcano_training_pods_use_the_nodes_rendezvous_certificate() -> None:
    """torchrun's ftd rendezvous in deploy/kubernetes/volcano dials the coordinators with the node's
    rendezvous/<node>.crt from $FTD_PKI_DIR: the same host directory as the agent's, read-only."""
    (job,) = [d for d in yaml.safe_load_all((K8S_DIR / "volcano" / "training-job.yaml").read_text())
              if d and d["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _resolved_env(container)["FTD_PKI_DIR"] == _resolved_env(
        _container("DaemonSet", "ftd-agent", "agent"))["FTD_AGENT_PKI_DIR"] == PKI_DIR
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == PKI_DIR]
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": PKI_DIR, "type": "Directory"}
    assert job["metadata"]["namespace"] == NODE_NAMESPACE  # hostPath and host network: the privileged namespace


@pytest.mark.xfail(not _has_settings(AgentSettings, "pki_dir"), reason=AWAITED, strict=False)
def test_agent_settings_take_the_pki_dir(tmp_path: Path) -> None:
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert str(settings.pki_dir) == PKI_DIR


def test_agent_probes_and_shutdown(tmp_path: Path) -> None:
    pod = _pod_spec("DaemonSet", "ftd-agent")
    container = _container("DaemonSet", "ftd-agent", "agent")
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    metrics_port = parse_hostport(settings.metrics_listen)[1]
    assert metrics_port == 9402
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _container_port(container, get["port"]) == metrics_port, probe
    assert pod["terminationGracePeriodSeconds"] == 120
    assert container["command"] == ["ftd-agent", "--config", "/etc/ftd/agent.toml"]


# ---- etcd ----------------------------------------------------------------------------------------------


def _etcd_args() -> dict[str, str]:
    container = _container("StatefulSet", "etcd", "etcd")
    assert all(a.startswith("--") and "=" in a for a in container["args"]), "write every flag as --flag=value"
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert len(args) == len(container["args"]), "a flag is given twice"
    return args


def test_etcd_is_three_members_with_stable_names() -> None:
    sts = _find("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady would deadlock the bootstrap
    peer = _find("Service", sts["spec"]["serviceName"])
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    container = _container("StatefulSet", "etcd", "etcd")
    assert container["image"] == "quay.io/coreos/etcd:v3.5.17"
    args = _etcd_args()
    assert args["name"] == "$(POD_NAME)"
    assert _env_entry(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert members == {f"{name}-{i}": f"https://{name}-{i}.{service}.{NAMESPACE}.svc:2380" for i in range(3)}
    # Each pod advertises exactly the URL the others expect for it.
    for pod_name, url in members.items():
        assert args["initial-advertise-peer-urls"].replace("$(POD_NAME)", pod_name) == url
    assert args["initial-cluster-state"] == "new"
    client_port = _container_port(container, "client")
    assert client_port == 2379 and args["listen-client-urls"] == f"https://0.0.0.0:{client_port}"
    assert args["advertise-client-urls"] == f"https://$(POD_NAME).{service}.{NAMESPACE}.svc:{client_port}"
    # The probes use the plain-HTTP metrics listener: the kubelet has no client certificate for 2379.
    metrics_port = _container_port(container, "metrics")
    assert args["listen-metrics-urls"] == f"http://0.0.0.0:{metrics_port}"
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"].split("?")[0] == "/health", probe
        assert "exclude=NOSPACE" in get["path"], f"{probe}: a NOSPACE alarm is an alert, not a restart"
        assert _container_port(container, get["port"]) == metrics_port, probe
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
    # Only ftd's etcd certificates join as peers: the CN ftd/pki.py gives the etcd kind.
    pki.init_ca(tmp_path, "training-a")
    crt, _ = pki.paths(tmp_path, "etcd", "etcd-0")
    pki.issue(tmp_path, "etcd", "etcd-0")
    cert = x509.load_pem_x509_certificate(crt.read_bytes())
    assert args["peer-cert-allowed-cn"] == cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    files = _mounted_files("StatefulSet", "etcd", "etcd")
    assert files[f"{PKI_DIR}/ca.crt"] == ("ftd-pki-etcd", "ca.crt")
    for member in _replicas("StatefulSet", "etcd"):
        for suffix in ("crt", "key"):
            path = args["cert-file" if suffix == "crt" else "key-file"].replace("$(POD_NAME)", member)
            assert files[path] == ("ftd-pki-etcd", f"{member}.{suffix}"), path
    pod = _pod_spec("StatefulSet", "etcd")
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    assert {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v} == {0o440}


def test_etcd_compacts_its_history_and_states_its_quota() -> None:
    args = _etcd_args()
    assert args["auto-compaction-mode"] == "periodic" and args["auto-compaction-retention"] == "1h"
    quota = int(args["quota-backend-bytes"])
    assert quota == 2 * 1024**3
    (claim,) = _find("StatefulSet", "etcd")["spec"]["volumeClaimTemplates"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and quota * 2 <= int(size.removesuffix("Gi")) * 1024**3  # room to defragment
    # Prometheus scrapes the members' own metrics (FtdEtcdNoSpace) from the metrics listener.
    annotations = _find("StatefulSet", "etcd")["spec"]["template"]["metadata"]["annotations"]
    container = _container("StatefulSet", "etcd", "etcd")
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == _container_port(container, "metrics")


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
    sts = _find("StatefulSet", "etcd")
    container = _container("StatefulSet", "etcd", "etcd")
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    data_dir = _etcd_args()["data-dir"]
    assert any(n in claims and Path(data_dir).is_relative_to(p) for n, p in mounts.items())
    client = _find("Service", "etcd-client")
    assert _matches(client["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]


# ---- etcd's auth: the Job -------------------------------------------------------------------------------


def test_the_auth_job_runs_the_systemd_script_against_the_members() -> None:
    script = (ROOT / "deploy" / "systemd" / "etcd-enable-auth.sh").read_text()
    assert _find("ConfigMap", "ftd-etcd-auth")["data"]["etcd-enable-auth.sh"] == script
    job = _find("Job", "ftd-etcd-auth")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0  # re-created by the next apply, never a stale immutable Job
    container = _container("Job", "ftd-etcd-auth", "enable-auth")
    assert container["image"] == _container("StatefulSet", "etcd", "etcd")["image"]  # its etcdctl matches
    env = _resolved_env(container)
    etcd = _find("StatefulSet", "etcd")
    members = [f"https://{m}.{etcd['spec']['serviceName']}.{NAMESPACE}.svc:2379"
               for m in _replicas("StatefulSet", "etcd")]
    assert env["ETCDCTL_ENDPOINTS"].split(",") == members
    files = _mounted_files("Job", "ftd-etcd-auth", "enable-auth")
    # A member's own certificate (CN ftd-etcd, the user the script makes root).
    assert files[env["ETCDCTL_CACERT"]] == ("ftd-pki-etcd", "ca.crt")
    assert files[env["ETCDCTL_CERT"]][0] == files[env["ETCDCTL_KEY"]][0] == "ftd-pki-etcd"
    assert Path(env["ETCDCTL_CERT"]).parent.name == "etcd"
    assert "user ftd-etcd root" in script
    # etcd's image has no shell: the init container provides busybox and the applets the script calls.
    (init,) = _pod_spec("Job", "ftd-etcd-auth")["initContainers"]
    applets = set(re.search(r"for applet in ([a-z ]+);", init["command"][-1]).group(1).split())  # type: ignore[union-attr]
    used = set(re.findall(r"\b(sed|sleep|tail|tr|grep|awk|cut|head|cat|wc)\b", script))
    assert used <= applets, f"the script calls {sorted(used - applets)}, which the init container does not link"
    assert container["command"][0] == "/tools/bin/sh" and "sh" in applets
    assert env["ETCDCTL_BIN"] == "/usr/local/bin/etcdctl"


def test_the_auth_roles_are_the_documented_ones() -> None:
    script = (ROOT / "deploy" / "systemd" / "etcd-enable-auth.sh").read_text()
    roles = dict(re.findall(r"^role (\S+) (.+)$", script, re.MULTILINE))
    assert {r: p.split() for r, p in roles.items()} == {
        "ftd-coordinator": ["/ftd/"],
        # torch's etcd-v3 handler (training/etcd_v3.py): the rendezvous state and its c10d store.
        "ftd-rendezvous": ["/torch/elastic/rendezvous/", "/torch/elastic/store/"],
    }
    users = dict(re.findall(r"^user (\S+) (\S+)$", script, re.MULTILINE))
    assert users == {"root": "root", "ftd-etcd": "root", "ftd-coordinator": "ftd-coordinator",
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
        assert _validate(doc) == K8S_VERSION
    mounted = {}
    for workload in _workloads():
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
    config = tomllib.loads(_find("ConfigMap", "ftd-coordinator")["data"]["coordinator.toml"])
    pki_dir = tmp_path / "pki"
    assert pki.identity_of(pki.paths(pki_dir, "etcd", "etcd-0")[0].read_bytes()).cluster == config["cluster"]  # type: ignore[union-attr]
    # Every name a client dials is in the certificate it is served with.
    etcd_hosts = {parse_hostport(e)[0] for e in config["etcd_endpoints"].split(",")}
    job_env = _resolved_env(_container("Job", "ftd-etcd-auth", "enable-auth"))
    etcd_hosts |= {u.split("://")[1].rsplit(":", 1)[0] for u in job_env["ETCDCTL_ENDPOINTS"].split(",")}
    etcd_hosts.add(f"etcd-client.{NAMESPACE}.svc")
    for member in _replicas("StatefulSet", "etcd"):
        cert = x509.load_pem_x509_certificate(pki.paths(pki_dir, "etcd", member)[0].read_bytes())
        own = {h for h in etcd_hosts if h.startswith(f"{member}.")}
        assert own and own | {f"etcd-client.{NAMESPACE}.svc"} <= set(pki.cert_hosts(cert)), member
    agent_config = tomllib.loads(_find("ConfigMap", "ftd-agent")["data"]["agent.toml"])
    service_host = parse_hostport(agent_config["coordinators"])[0]
    coordinator = _container(*COORDINATOR, "coordinator")
    for replica in _replicas(*COORDINATOR):
        env = _resolved_env(coordinator, {**FIELD_VALUES, "metadata.name": replica})
        advertised = parse_hostport(env["FTD_COORDINATOR_ADVERTISE"])[0]
        cert = x509.load_pem_x509_certificate(pki.paths(pki_dir, "coordinator", replica)[0].read_bytes())
        assert {advertised, service_host} <= set(pki.cert_hosts(cert)), replica


# ---- security: Pod Security levels, non-root, no Kubernetes API ----------------------------------------

# Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/, v1.30), the
# rules that pod specs like these can break; the checker below applies them to the templates.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
LEVELS = ("privileged", "baseline", "restricted")


def pod_security_violations(pod: dict[str, Any], level: str) -> list[str]:
    """What in a pod spec breaks Pod Security ``level`` (empty: it complies)."""
    assert level in LEVELS
    if level == "privileged":
        return []
    bad: list[str] = []
    psc = pod.get("securityContext", {})
    containers = [*pod.get("initContainers", []), *pod["containers"], *pod.get("ephemeralContainers", [])]
    # baseline
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            bad.append(f"{field}: true")
    bad += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    bad += [f"sysctl {s['name']}" for s in psc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    for where, sc in [("pod", psc), *((c["name"], c.get("securityContext", {})) for c in containers)]:
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            bad.append(f"{where}: seccompProfile Unconfined")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            bad.append(f"{where}: appArmorProfile Unconfined")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            bad.append(f"{where}: hostProcess")
        se = sc.get("seLinuxOptions", {})
        if se.get("type", "") not in ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t") \
                or se.get("user") or se.get("role"):
            bad.append(f"{where}: seLinuxOptions {se}")
    for c in containers:
        sc = c.get("securityContext", {})
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        if extra:
            bad.append(f"{c['name']}: adds {sorted(extra)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            bad.append(f"{c['name']}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            bad.append(f"{c['name']}: procMount")
    if level == "baseline":
        return bad
    # restricted
    for v in pod.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES and kind != "hostPath":  # hostPath: reported above
            bad.append(f"volume {v['name']}: {kind}")
    if psc.get("runAsUser") == 0:
        bad.append("pod: runAsUser 0")
    for c in containers:
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            bad.append(f"{c['name']}: runAsNonRoot not true")
        if sc.get("runAsUser") == 0:
            bad.append(f"{c['name']}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{c['name']}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            bad.append(f"{c['name']}: does not drop ALL capabilities")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: adds {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
    return bad


def _enforced(namespace: str) -> str:
    return str(_find("Namespace", namespace)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"])


def test_namespaces_enforce_the_strictest_level_their_pods_meet() -> None:
    """The control plane's namespace enforces `restricted`; the node namespace needs `privileged` because
    the agent's hostPath volumes are beyond `baseline` (and nothing else is)."""
    assert _enforced(NAMESPACE) == "restricted"
    assert _enforced(NODE_NAMESPACE) == "privileged"
    for workload in _workloads():
        ns, pod = workload["metadata"]["namespace"], workload["spec"]["template"]["spec"]
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        assert pod_security_violations(pod, _enforced(ns)) == [], where
        # ...and the level is no looser than it must be.
        stricter = LEVELS[LEVELS.index(_enforced(ns)) + 1:]
        assert all(pod_security_violations(pod, level) for level in stricter), f"{where}: {ns} could be stricter"
    agent = _pod_spec("DaemonSet", "ftd-agent")
    assert pod_security_violations(agent, "baseline") == [f"volume {v['name']}: hostPath" for v in agent["volumes"]
                                                         if "hostPath" in v]


@pytest.mark.parametrize("workload", ["StatefulSet/etcd", "StatefulSet/ftd-coordinator", "Job/ftd-etcd-auth"])
def test_control_plane_pods_meet_restricted_with_a_read_only_root(workload: str) -> None:
    kind, name = workload.split("/")
    pod = _pod_spec(kind, name)
    assert pod_security_violations(pod, "restricted") == []
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize(("change", "expected"), [
    (lambda c, p: c["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    (lambda c, p: c["securityContext"].update(runAsUser=0), "runAsUser 0"),
    (lambda c, p: c["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    (lambda c, p: c["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "SYS_ADMIN"),
    (lambda c, p: c["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "drop ALL"),
    (lambda c, p: p["securityContext"]["seccompProfile"].update(type="Unconfined"), "Unconfined"),
    (lambda c, p: p.update(hostNetwork=True), "hostNetwork"),
    (lambda c, p: p["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "hostPath"),
], ids=["escalation", "root-user", "run-as-root", "capability", "no-drop-all", "seccomp", "host-network", "hostpath"])
def test_the_pod_security_checker_catches_each_rule(change: Any, expected: str) -> None:
    pod = copy.deepcopy(_pod_spec(*COORDINATOR))
    change(pod["containers"][0], pod)
    assert any(expected in v for v in pod_security_violations(pod, "restricted")), expected


def _effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def test_every_container_runs_as_non_root() -> None:
    checked = 0
    for doc in _workloads():
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            where = f"{doc['kind']}/{doc['metadata']['name']} container {container['name']}"
            assert _effective(pod, container, "runAsNonRoot") is True, where
            assert _effective(pod, container, "runAsUser") not in (None, 0), where
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
            checked += 1
    assert checked == 4  # etcd, coordinator, agent, the etcd auth Job


def test_the_only_root_step_is_the_agents_chown_of_its_host_directories() -> None:
    """hostPath DirectoryOrCreate makes root-owned directories; one init container hands them to the agent's
    user with CAP_CHOWN alone. Nothing else may run as root."""
    root = []
    for doc in _workloads():
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []):
            if _effective(pod, container, "runAsUser") == 0 or _effective(pod, container, "runAsNonRoot") is not True:
                root.append((doc["metadata"]["name"], container))
    assert [(n, c["name"]) for n, c in root] == [("ftd-agent", "own-dirs")]
    container = root[0][1]
    sc = container["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False
    agent_user = _pod_spec("DaemonSet", "ftd-agent")["securityContext"]["runAsUser"]
    assert container["command"][:2] == ["chown", f"{agent_user}:{agent_user}"]
    assert sorted(container["command"][2:]) == ["/mnt/hdd/ftd", "/mnt/ssd/ftd", "/var/lib/ftd"]


# Signs of a Kubernetes API client in ftd's code; if one appears, give its ServiceAccount the narrowest Role.
API_CLIENT = re.compile(r"^\s*(from|import)\s+kubernetes\b|/var/run/secrets/kubernetes\.io|KUBERNETES_SERVICE_HOST",
                        re.MULTILINE)


def test_nothing_has_kubernetes_api_access() -> None:
    """No daemon calls the Kubernetes API, so there is no RBAC at all and no pod mounts a token."""
    kinds = {d["kind"] for _, d in DOCS}
    assert not kinds & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    accounts = {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == "ServiceAccount"}
    assert set(accounts) == {"ftd-coordinator", "ftd-agent"}
    assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
    for doc in _workloads():
        pod = doc["spec"]["template"]["spec"]
        assert pod.get("automountServiceAccountToken") is False, doc["metadata"]["name"]
        assert pod.get("serviceAccountName", "default") in {*accounts, "default"}
    assert _pod_spec("DaemonSet", "ftd-agent")["serviceAccountName"] == "ftd-agent"
    assert _pod_spec(*COORDINATOR)["serviceAccountName"] == "ftd-coordinator"
    code = [p for d in ("agent", "coordinator", "ftd", "ftctl", "training", "storage_backends", "checkpoints")
            for p in (ROOT / d).rglob("*.py")]
    assert code
    users = [str(p.relative_to(ROOT)) for p in code if API_CLIENT.search(p.read_text(errors="replace"))]
    assert users == [], f"these use the Kubernetes API: give them a Role in the manifests: {users}"


# ---- the probed paths exist on the real daemons --------------------------------------------------------


def _get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@pytest.mark.etcd
def test_probe_paths_are_served_by_live_daemons(local_cluster: ClusterFile) -> None:
    """The manifests' probes are only meaningful if /healthz and /readyz are real endpoints: prometheus_client's
    exposition server answers every path with the metrics, so a bare 200 would prove nothing."""
    daemons = [local_cluster.coordinators[0], *local_cluster.agents]
    for proc in daemons:
        for path in ("/healthz", "/readyz"):
            status, body = _get(proc.info["metrics"], path)
            assert status == 200, f"{proc.name} {path}: HTTP {status}"
            assert "# TYPE" not in body, f"{proc.name} {path} answers with the metrics page, not a probe"
