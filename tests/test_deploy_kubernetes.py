"""deploy/kubernetes: every manifest validates against the Kubernetes OpenAPI schemas, and says what ftd needs.

Validation uses the ``kubernetes-validate`` package (the schemas ship inside it, no network) against
Kubernetes 1.30 in strict mode, where an unknown field is an error. The semantic tests then check what
a schema cannot: replica counts, probes on the port the daemon really serves, the downward-API
environment, the etcd membership, and that the ConfigMaps plus the pods' environment are accepted by
the daemons' own settings loader.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ftd.agent.settings import ENV_PREFIX as AGENT_ENV_PREFIX
from ftd.agent.settings import AgentSettings
from ftd.coordinator.settings import ENV_PREFIX as COORDINATOR_ENV_PREFIX
from ftd.coordinator.settings import CoordinatorSettings
from ftd.ftctl.localcluster import ClusterFile
from ftd.rpc import parse_hostport
from ftd.settings import load

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30"
MANIFESTS = ("namespace.yaml", "rbac.yaml", "etcd.yaml", "coordinator.yaml", "agent.yaml")
# Applied by hand, not by the kustomization (deploy/kubernetes/volcano has its own test file).
OPTIONAL = ("optional/dcgm-exporter.yaml",)
NAMESPACE = "ftd"
# What the downward API would give one pod, for the tests that run the pods' settings through ftd.
FIELD_VALUES = {
    "metadata.name": "pod-xyz",
    "status.podIP": "10.1.2.3",
    "status.hostIP": "192.0.2.7",
    "spec.nodeName": "gpu-node-7",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def _load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d is not None]


DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in MANIFESTS for doc in _load(name)]
OPTIONAL_DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in OPTIONAL for doc in _load(name)]


def _find(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
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


def _resolved_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: downward-API fields from FIELD_VALUES, secret
    keys from the Secret in the manifests, and $(VAR) expanded from the variables defined before it."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            value = re.sub(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                           lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        elif "fieldRef" in entry["valueFrom"]:
            value = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
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


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert _validate(doc) == K8S_VERSION


@pytest.mark.parametrize(("name", "doc"), OPTIONAL_DOCS,
                         ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in OPTIONAL_DOCS])
def test_optional_manifest_validates_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    assert _validate(doc) == K8S_VERSION
    assert doc["metadata"].get("namespace") == NAMESPACE


def test_the_validator_rejects_a_wrong_type() -> None:
    broken = copy.deepcopy(_find("Deployment", "ftd-coordinator"))
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
    doc = copy.deepcopy(_find("Deployment", "ftd-coordinator"))
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


def test_everything_namespaced_lives_in_ftd() -> None:
    assert _find("Namespace", NAMESPACE)
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for name, doc in DOCS:
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{name}: {doc['kind']}/{doc['metadata']['name']}"


# ---- coordinator ---------------------------------------------------------------------------------------


def test_coordinator_runs_two_replicas_on_different_nodes() -> None:
    deployment = _find("Deployment", "ftd-coordinator")
    assert deployment["spec"]["replicas"] == 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert _matches(deployment["spec"]["selector"]["matchLabels"], labels)
    terms = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and _matches(t["labelSelector"]["matchLabels"], labels)
               for t in terms)


def test_coordinator_probes_hit_healthz_and_readyz_on_the_metrics_port(tmp_path: Path) -> None:
    container = _container("Deployment", "ftd-coordinator", "coordinator")
    settings = _settings("Deployment", "ftd-coordinator", "coordinator", CoordinatorSettings,
                         COORDINATOR_ENV_PREFIX, tmp_path)
    metrics_port = parse_hostport(settings.metrics_listen)[1]
    assert metrics_port == 9401
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert _container_port(container, get["port"]) == metrics_port, probe


def test_coordinator_settings_from_configmap_and_downward_api(tmp_path: Path) -> None:
    container = _container("Deployment", "ftd-coordinator", "coordinator")
    assert container["command"] == ["ftd-coordinator", "--config", "/etc/ftd/coordinator.toml"]
    assert _env_entry(container, "POD_IP")["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert _env_entry(container, "FTD_COORDINATOR_REPLICA_ID")["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.name"
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("FTD_COORDINATOR_ADVERTISE")  # $(POD_IP) must be defined first
    settings = _settings("Deployment", "ftd-coordinator", "coordinator", CoordinatorSettings,
                         COORDINATOR_ENV_PREFIX, tmp_path)
    grpc_port = parse_hostport(settings.listen)[1]
    assert settings.advertise == f"{FIELD_VALUES['status.podIP']}:{grpc_port}"
    assert settings.replica_id == FIELD_VALUES["metadata.name"]
    assert _container_port(container, "grpc") == grpc_port == 7400
    assert _container_port(container, "metrics") == parse_hostport(settings.metrics_listen)[1]
    # The coordinators use the etcd members of etcd.yaml, by their stable DNS names.
    sts = _find("StatefulSet", "etcd")
    members = {f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc:2379"
               for i in range(sts["spec"]["replicas"])}
    assert set(settings.etcd_endpoints.split(",")) == members


def test_coordinator_service_and_disruption_budget() -> None:
    container = _container("Deployment", "ftd-coordinator", "coordinator")
    labels = _find("Deployment", "ftd-coordinator")["spec"]["template"]["metadata"]["labels"]
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


# ---- agent ---------------------------------------------------------------------------------------------


def test_agent_identity_comes_from_the_node(tmp_path: Path) -> None:
    container = _container("DaemonSet", "ftd-agent", "agent")
    assert _env_entry(container, "FTD_AGENT_NODE_ID")["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert _env_entry(container, "FTD_AGENT_HOST")["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    token = _env_entry(container, "FTD_AGENT_DRILL_TOKEN")["valueFrom"]["secretKeyRef"]
    assert token["key"] in _find("Secret", token["name"])["stringData"]
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert settings.effective_node_id == FIELD_VALUES["spec.nodeName"]
    assert settings.effective_host == FIELD_VALUES["status.hostIP"]
    # The registered gRPC address (drills dial it) is the pod IP, on the declared container port.
    assert settings.listen == f"{FIELD_VALUES['status.podIP']}:{_container_port(container, 'grpc')}"
    assert settings.drill_token == "", "drills are off until an operator sets a secret token"
    assert settings.train_cmd == ""  # the manifest launches no training; see the comment in agent.yaml
    service = _find("Service", "ftd-coordinator")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert settings.coordinators == f"{service['metadata']['name']}.{NAMESPACE}.svc:{grpc_port}"
    assert not _pod_spec("DaemonSet", "ftd-agent").get("hostNetwork", False)


def test_agent_mounts_its_three_host_directories(tmp_path: Path) -> None:
    pod = _pod_spec("DaemonSet", "ftd-agent")
    container = _container("DaemonSet", "ftd-agent", "agent")
    host_paths = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert sorted(h["path"] for h in host_paths.values()) == ["/mnt/hdd/ftd", "/mnt/ssd/ftd", "/var/lib/ftd"]
    assert all(h["type"] == "DirectoryOrCreate" for h in host_paths.values())
    mounted = {m["name"]: Path(m["mountPath"]) for m in container["volumeMounts"]}
    by_host = {h["path"]: mounted[name] for name, h in host_paths.items()}
    settings = _settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    # Where the agent writes is where the host directories are mounted.
    assert settings.workdir == by_host["/var/lib/ftd"]
    assert settings.effective_socket == by_host["/var/lib/ftd"] / "agent.sock"
    assert settings.tiers == {"ssd": by_host["/mnt/ssd/ftd"], "hdd": by_host["/mnt/hdd/ftd"]}


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


def test_etcd_is_three_members_with_stable_names() -> None:
    sts = _find("StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # OrderedReady would deadlock the bootstrap
    peer = _find("Service", sts["spec"]["serviceName"])
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True
    container = _container("StatefulSet", "etcd", "etcd")
    assert container["image"] == "quay.io/coreos/etcd:v3.5.17"
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args["name"] == "$(POD_NAME)"
    assert _env_entry(container, "POD_NAME")["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert members == {f"{name}-{i}": f"http://{name}-{i}.{service}.{NAMESPACE}.svc:2380" for i in range(3)}
    # Each pod advertises exactly the URL the others expect for it.
    for pod_name, url in members.items():
        assert args["initial-advertise-peer-urls"].replace("$(POD_NAME)", pod_name) == url
    assert args["initial-cluster-state"] == "new"
    client_port = _container_port(container, "client")
    assert client_port == 2379 and args["listen-client-urls"].endswith(f":{client_port}")
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"].split("?")[0] == "/health", probe
        assert _container_port(container, get["port"]) == client_port, probe


def test_etcd_keeps_its_data_on_a_claim_and_has_a_client_service() -> None:
    sts = _find("StatefulSet", "etcd")
    container = _container("StatefulSet", "etcd", "etcd")
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    data_dir = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--data-dir="))
    assert any(n in claims and Path(data_dir).is_relative_to(p) for n, p in mounts.items())
    client = _find("Service", "etcd-client")
    assert _matches(client["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]


# ---- security and RBAC ---------------------------------------------------------------------------------


def _effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def test_every_container_runs_as_non_root() -> None:
    checked = 0
    for _, doc in DOCS:
        if doc["kind"] not in WORKLOADS:
            continue
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
    assert checked == 3  # etcd, coordinator, agent


def test_the_only_root_step_is_the_agents_chown_of_its_host_directories() -> None:
    """hostPath DirectoryOrCreate makes root-owned directories; one init container hands them to the agent's
    user with CAP_CHOWN alone. Nothing else may run as root."""
    root = []
    for _, doc in DOCS:
        if doc["kind"] not in WORKLOADS:
            continue
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


def test_rbac_is_minimal() -> None:
    kinds = {d["kind"] for _, d in DOCS}
    assert not kinds & {"Role", "RoleBinding"}  # the coordinator needs nothing from the Kubernetes API
    coordinator_sa = _find("ServiceAccount", "ftd-coordinator")
    assert coordinator_sa["automountServiceAccountToken"] is False
    assert _pod_spec("Deployment", "ftd-coordinator")["serviceAccountName"] == "ftd-coordinator"
    role = _find("ClusterRole", "ftd-agent")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    binding = _find("ClusterRoleBinding", "ftd-agent")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "ftd-agent"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ftd-agent", "namespace": NAMESPACE}]
    assert _find("ServiceAccount", "ftd-agent")
    assert _pod_spec("DaemonSet", "ftd-agent")["serviceAccountName"] == "ftd-agent"
    assert [d["metadata"]["name"] for _, d in DOCS if d["kind"] == "ClusterRoleBinding"] == ["ftd-agent"]


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
