"""deploy/kubernetes: every manifest validates against the Kubernetes OpenAPI schemas, and says what ftd needs.

Validation uses the ``kubernetes-validate`` package (the schemas ship inside it, no network) against
Kubernetes 1.30 in strict mode, where an unknown field is an error. This file: the schemas, the
kustomization and the optional manifests, the two namespaces, and what a schema cannot check of the
coordinators and agents (replica counts, probes on the port the daemon really serves, the downward-API
environment, the PKI each pod mounts, and that the ConfigMaps plus the pods' environment are accepted by
the daemons' own settings loader), with the probed paths served by live daemons. etcd, its auth Job and
the documented PKI commands: test_deploy_kubernetes_etcd.py; Pod Security levels, non-root and API access:
test_deploy_kubernetes_security.py; the network policies: test_deploy_networkpolicy.py. The manifests as
data: kubernetes_manifests.py.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_manifests import (
    COORDINATOR,
    DOCS,
    FIELD_VALUES,
    K8S_DIR,
    K8S_VERSION,
    MANIFESTS,
    NAMESPACE,
    NODE_NAMESPACE,
    OPTIONAL,
    OPTIONAL_DOCS,
    PKI_DIR,
    WORKLOADS,
    container_of,
    container_port,
    env_entry,
    find,
    load_settings,
    matches,
    mounted_files,
    pod_spec_of,
    pod_volumes,
    replica_names,
    resolved_env,
    validate,
)

from ftd.agent.settings import ENV_PREFIX as AGENT_ENV_PREFIX
from ftd.agent.settings import AgentSettings
from ftd.coordinator.settings import ENV_PREFIX as COORDINATOR_ENV_PREFIX
from ftd.coordinator.settings import CoordinatorSettings
from ftd.ftctl.localcluster import ClusterFile
from ftd.rpc import parse_hostport

# ---- schema validation -----------------------------------------------------------------------------------


def _id(name: str, doc: dict[str, Any]) -> str:
    return f"{name}:{doc['kind']}/{doc['metadata'].get('namespace', '-')}/{doc['metadata']['name']}"


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[_id(n, d) for n, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert validate(doc) == K8S_VERSION


@pytest.mark.parametrize(("name", "doc"), OPTIONAL_DOCS, ids=[_id(n, d) for n, d in OPTIONAL_DOCS])
def test_optional_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert validate(doc) == K8S_VERSION
    # Root and a hostPath (the kubelet's pod-resources socket): only the node namespace admits it.
    assert doc["metadata"].get("namespace") == NODE_NAMESPACE


def test_the_validator_rejects_a_wrong_type() -> None:
    broken = copy.deepcopy(find("StatefulSet", "ftd-coordinator"))
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        validate(broken)
    assert list(info.value.path) == ["spec", "replicas"]


def test_strict_mode_rejects_an_unknown_field() -> None:
    broken = copy.deepcopy(find("DaemonSet", "ftd-agent"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/healthz"
    assert validate(broken, strict=False) == K8S_VERSION  # only strict mode catches a misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


def test_an_unknown_kind_is_an_error_not_a_skip() -> None:
    doc = copy.deepcopy(find("StatefulSet", "ftd-coordinator"))
    doc["apiVersion"] = "apps/v1beta9"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate(doc)


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
        assert validate(doc) == K8S_VERSION


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
    agent_annotations = find("DaemonSet", "ftd-agent")["spec"]["template"]["metadata"]["annotations"]
    assert set(annotations) == set(agent_annotations)
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == container_port(container, "metrics") == listen_port
    assert env["DCGM_EXPORTER_KUBERNETES"] == "true"  # GPU series labelled with the pod using the GPU
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}  # no SYS_ADMIN
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_control_plane_and_the_node_side_have_their_own_namespaces() -> None:
    """agent.yaml is the node side (ftd-node); everything else is the control plane (ftd), apart from the
    default-deny policy each namespace gets. Secrets are namespace-scoped, so nothing in ftd-node can mount
    the coordinators' or etcd's keys."""
    assert find("Namespace", NAMESPACE) and find("Namespace", NODE_NAMESPACE)
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
    secrets = {v["secret"]["secretName"]: _ns for _ns, v in pod_volumes() if "secret" in v}
    assert {s for s, ns in secrets.items() if s.startswith("ftd-pki-")} == {"ftd-pki-etcd", "ftd-pki-coordinator"}
    assert all(ns == NAMESPACE for s, ns in secrets.items() if s.startswith("ftd-pki-"))


# ---- coordinator ---------------------------------------------------------------------------------------

AWAITED = "settings pki_dir/etcd_*_file land with the mTLS wiring"


def _has_settings(cls: type, *names: str) -> bool:
    return set(names) <= {f.name for f in dataclasses.fields(cls)}


def test_coordinator_runs_two_replicas_on_different_nodes() -> None:
    sts = find(*COORDINATOR)
    assert sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # neither replica waits for the other
    assert sts["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert matches(sts["spec"]["selector"]["matchLabels"], labels)
    terms = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and matches(t["labelSelector"]["matchLabels"], labels)
               for t in terms)


def test_coordinator_probes_hit_healthz_and_readyz_on_the_metrics_port(tmp_path: Path) -> None:
    container = container_of(*COORDINATOR, "coordinator")
    settings = load_settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    metrics_port = parse_hostport(settings.metrics_listen)[1]
    assert metrics_port == 9401
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert container_port(container, get["port"]) == metrics_port, probe


def test_coordinator_settings_from_configmap_and_downward_api(tmp_path: Path) -> None:
    container = container_of(*COORDINATOR, "coordinator")
    assert container["command"] == ["ftd-coordinator", "--config", "/etc/ftd/coordinator.toml"]
    assert env_entry(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    names = [e["name"] for e in container["env"]]
    for later in ("FTD_COORDINATOR_ADVERTISE", "FTD_COORDINATOR_REPLICA_ID", "FTD_COORDINATOR_ETCD_CERT_FILE",
                  "FTD_COORDINATOR_ETCD_KEY_FILE"):
        assert names.index("POD_NAME") < names.index(later), f"$(POD_NAME) must be defined before {later}"
    settings = load_settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    sts = find(*COORDINATOR)
    pod = FIELD_VALUES["metadata.name"]
    grpc_port = parse_hostport(settings.listen)[1]
    assert settings.replica_id == pod  # stable across restarts: the name of the replica's certificate
    # Leader hints carry `advertise`: the pod's stable name under the headless Service (which its certificate
    # names), not a pod IP that no certificate issued beforehand can carry.
    headless = find("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert matches(headless["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert settings.advertise == f"{pod}.{sts['spec']['serviceName']}.{NAMESPACE}.svc:{grpc_port}"
    assert container_port(container, "grpc") == grpc_port == 7400
    assert container_port(container, "metrics") == parse_hostport(settings.metrics_listen)[1]
    # The coordinators use the etcd members of etcd.yaml, by their stable DNS names.
    etcd = find("StatefulSet", "etcd")
    members = {f"{m}.{etcd['spec']['serviceName']}.{NAMESPACE}.svc:2379" for m in replica_names("StatefulSet", "etcd")}
    assert set(settings.etcd_endpoints.split(",")) == members


def test_coordinator_service_and_disruption_budget() -> None:
    container = container_of(*COORDINATOR, "coordinator")
    labels = find(*COORDINATOR)["spec"]["template"]["metadata"]["labels"]
    service = find("Service", "ftd-coordinator")
    assert matches(service["spec"]["selector"], labels)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 7400 and container_port(container, ports["grpc"]["targetPort"]) == 7400
    assert ports["metrics"]["port"] == 9401 and container_port(container, ports["metrics"]["targetPort"]) == 9401
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9401"
    assert annotations["prometheus.io/path"] == "/metrics"
    pdb = find("PodDisruptionBudget", "ftd-coordinator")
    assert pdb["spec"]["minAvailable"] == 1
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)


def test_every_coordinator_replica_finds_its_certificate_in_the_pki_secret() -> None:
    """FTD_COORDINATOR_PKI_DIR and the etcd client files resolve, for each replica, to files of the Secret
    ftd-pki-coordinator in ftd's PKI layout (ca.crt, coordinators/<replica id>.crt|.key)."""
    container = container_of(*COORDINATOR, "coordinator")
    files = mounted_files(*COORDINATOR, "coordinator")
    pod = pod_spec_of(*COORDINATOR)
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]  # 0440 files, readable
    assert {v["secret"]["defaultMode"] for v in pod["volumes"] if "secret" in v} == {0o440}
    for replica in replica_names(*COORDINATOR):
        env = resolved_env(container, {**FIELD_VALUES, "metadata.name": replica})
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
    settings = load_settings(*COORDINATOR, "coordinator", CoordinatorSettings, COORDINATOR_ENV_PREFIX, tmp_path)
    pod = FIELD_VALUES["metadata.name"]
    assert str(settings.pki_dir) == PKI_DIR
    assert str(settings.etcd_ca_file) == f"{PKI_DIR}/ca.crt"
    assert str(settings.etcd_cert_file) == f"{PKI_DIR}/coordinators/{pod}.crt"
    assert str(settings.etcd_key_file) == f"{PKI_DIR}/coordinators/{pod}.key"


# ---- agent ---------------------------------------------------------------------------------------------


def test_agent_identity_comes_from_the_node(tmp_path: Path) -> None:
    container = container_of("DaemonSet", "ftd-agent", "agent")
    assert env_entry(container, "FTD_AGENT_NODE_ID")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env_entry(container, "FTD_AGENT_HOST")["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    settings = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert settings.effective_node_id == FIELD_VALUES["spec.nodeName"]
    assert settings.effective_host == FIELD_VALUES["status.hostIP"]
    # The registered gRPC address (drills dial it) is the pod IP, on the declared container port.
    assert settings.listen == f"{FIELD_VALUES['status.podIP']}:{container_port(container, 'grpc')}"
    # Drills need an operator certificate; no second factor (drill token) ships with the manifest.
    assert settings.drill_token == "" and settings.drill_token_file is None
    assert not {e["name"] for e in container["env"]} & {"FTD_AGENT_DRILL_TOKEN", "FTD_AGENT_DRILL_TOKEN_FILE"}
    assert settings.train_cmd == ""  # the manifest launches no training; see the comment in agent.yaml
    service = find("Service", "ftd-coordinator")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert settings.coordinators == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{grpc_port}"
    assert not pod_spec_of("DaemonSet", "ftd-agent").get("hostNetwork", False)


def test_agent_mounts_its_three_host_directories(tmp_path: Path) -> None:
    pod = pod_spec_of("DaemonSet", "ftd-agent")
    container = container_of("DaemonSet", "ftd-agent", "agent")
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    writable = {v["name"]: v["hostPath"] for v in pod["volumes"]
                if "hostPath" in v and not mounts[v["name"]].get("readOnly")}
    assert sorted(h["path"] for h in writable.values()) == ["/mnt/hdd/ftd", "/mnt/ssd/ftd", "/var/lib/ftd"]
    assert all(h["type"] == "DirectoryOrCreate" for h in writable.values())
    by_host = {h["path"]: Path(mounts[name]["mountPath"]) for name, h in writable.items()}
    settings = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    # Where the agent writes is where the host directories are mounted.
    assert settings.workdir == by_host["/var/lib/ftd"]
    assert settings.effective_socket == by_host["/var/lib/ftd"] / "agent.sock"
    assert settings.tiers == {"ssd": by_host["/mnt/ssd/ftd"], "hdd": by_host["/mnt/hdd/ftd"]}


def test_agent_takes_its_node_certificate_from_the_node_not_from_a_secret() -> None:
    """A Secret with every node's key would sit on every node; each node's own files are a read-only
    hostPath instead (agent.yaml), which must exist: type Directory, not DirectoryOrCreate."""
    pod = pod_spec_of("DaemonSet", "ftd-agent")
    container = container_of("DaemonSet", "ftd-agent", "agent")
    assert resolved_env(container)["FTD_AGENT_PKI_DIR"] == PKI_DIR
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
    assert resolved_env(container)["FTD_PKI_DIR"] == resolved_env(
        container_of("DaemonSet", "ftd-agent", "agent"))["FTD_AGENT_PKI_DIR"] == PKI_DIR
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == PKI_DIR]
    assert mount.get("readOnly") is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"] == {"path": PKI_DIR, "type": "Directory"}
    assert job["metadata"]["namespace"] == NODE_NAMESPACE  # hostPath and host network: the privileged namespace


@pytest.mark.xfail(not _has_settings(AgentSettings, "pki_dir"), reason=AWAITED, strict=False)
def test_agent_settings_take_the_pki_dir(tmp_path: Path) -> None:
    settings = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert str(settings.pki_dir) == PKI_DIR


def test_agent_probes_and_shutdown(tmp_path: Path) -> None:
    pod = pod_spec_of("DaemonSet", "ftd-agent")
    container = container_of("DaemonSet", "ftd-agent", "agent")
    settings = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    metrics_port = parse_hostport(settings.metrics_listen)[1]
    assert metrics_port == 9402
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert container_port(container, get["port"]) == metrics_port, probe
    assert pod["terminationGracePeriodSeconds"] == 120
    assert container["command"] == ["ftd-agent", "--config", "/etc/ftd/agent.toml"]


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
