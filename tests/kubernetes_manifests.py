"""deploy/kubernetes as data, for the tests of its manifests (test_deploy_kubernetes*.py, test_deploy_volcano.py):
the documents of every manifest, look-ups (a kind by name, a pod template, a container, a port, an
environment entry, the files a Secret volume puts in a container), the environment as the kubelet resolves
it, and a daemon's settings loaded from its pod's command line, ConfigMap and environment."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from ftd.settings import load

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30"
MANIFESTS = ("namespace.yaml", "networkpolicy.yaml", "etcd.yaml", "etcd-auth.yaml", "coordinator.yaml", "agent.yaml")
# Applied by hand, not by the kustomization (deploy/kubernetes/volcano has its own test file).
OPTIONAL = ("optional/dcgm-exporter.yaml",)
NAMESPACE = "ftd"  # the control plane: etcd, coordinators, their Secrets (Pod Security `restricted`)
NODE_NAMESPACE = "ftd-node"  # the agents and the training beside them (`privileged`: hostPath, host network)
PKI_DIR = "/etc/ftd/pki"
# What the downward API would give one pod, for the tests that run the pods' settings through ftd.
FIELD_VALUES = {
    "metadata.name": "pod-xyz",
    "status.podIP": "10.1.2.3",
    "status.hostIP": "192.0.2.7",
    "spec.nodeName": "gpu-node-7",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
COORDINATOR = ("StatefulSet", "ftd-coordinator")


def load_manifest(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S_DIR / name).read_text()) if d is not None]


DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in MANIFESTS for doc in load_manifest(name)]
OPTIONAL_DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in OPTIONAL for doc in load_manifest(name)]


def find(kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name
             and namespace in (None, d["metadata"].get("namespace"))]
    assert len(found) == 1, f"expected one {kind}/{name} in deploy/kubernetes, found {len(found)}"
    return found[0]


def validate(doc: dict[str, Any], strict: bool = True) -> str:
    """Raises kubernetes_validate.ValidationError (or SchemaNotFoundError for an unknown kind)."""
    return str(kubernetes_validate.validate(doc, K8S_VERSION, strict=strict))


def pod_spec_of(kind: str, name: str) -> dict[str, Any]:
    return dict(find(kind, name)["spec"]["template"]["spec"])


def container_of(kind: str, name: str, container: str) -> dict[str, Any]:
    found = [c for c in pod_spec_of(kind, name)["containers"] if c["name"] == container]
    assert len(found) == 1, f"{kind}/{name} has no container {container!r}"
    return dict(found[0])


def container_port(container: dict[str, Any], port: int | str) -> int:
    """The container port a probe or targetPort refers to, by number or by name."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


def env_entry(container: dict[str, Any], name: str) -> dict[str, Any]:
    found = [e for e in container.get("env", []) if e["name"] == name]
    assert len(found) == 1, f"container {container['name']} does not set {name} exactly once"
    return dict(found[0])


def resolved_env(container: dict[str, Any], fields: dict[str, str] | None = None) -> dict[str, str]:
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
            secret = find("Secret", ref["name"])
            value = secret.get("stringData", {})[ref["key"]]
        else:
            raise AssertionError(f"unexpected env source in {entry}")
        env[entry["name"]] = value
    return env


def load_settings(kind: str, name: str, container_name: str, cls: type, env_prefix: str, tmp_path: Path) -> Any:
    """Runs the container's command line, its ConfigMap and its environment through ftd's settings loader."""
    pod = pod_spec_of(kind, name)
    container = container_of(kind, name, container_name)
    argv = list(container["command"])
    config = Path(argv[argv.index("--config") + 1])
    mounts = [m for m in container["volumeMounts"] if config.is_relative_to(m["mountPath"])]
    assert len(mounts) == 1, f"{config} is not on exactly one volume of {container_name}"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    data = find("ConfigMap", volume["configMap"]["name"])["data"]
    key = str(config.relative_to(mounts[0]["mountPath"]))
    assert key in data, f"ConfigMap {volume['configMap']['name']} has no {key} for --config {config}"
    local = tmp_path / key
    local.write_text(data[key])
    argv[argv.index("--config") + 1] = str(local)
    return load(cls, argv[1:], resolved_env(container), prog=argv[0], env_prefix=env_prefix)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] in WORKLOADS]


def pod_volumes() -> list[tuple[str, dict[str, Any]]]:
    """(namespace, volume) of every pod template."""
    return [(d["metadata"]["namespace"], v) for d in workloads()
            for v in d["spec"]["template"]["spec"].get("volumes", [])]


def replica_names(kind: str, name: str) -> list[str]:
    """The pod names of a StatefulSet: NAME-0 ... NAME-(replicas-1)."""
    assert kind == "StatefulSet"
    return [f"{name}-{i}" for i in range(find(kind, name)["spec"]["replicas"])]


def mounted_files(kind: str, name: str, container_name: str) -> dict[str, tuple[str, str]]:
    """Every file a container sees from a Secret volume: path -> (Secret, key). Secret volumes here list
    their items, so the file set is known without the cluster."""
    pod = pod_spec_of(kind, name)
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
