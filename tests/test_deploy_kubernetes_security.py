"""deploy/kubernetes's security: each namespace enforces the strictest Pod Security level its pods meet (a
small checker of the `baseline` and `restricted` rules), every container runs as non-root with a read-only
root, the one root step is the agent's chown, and nothing has Kubernetes API access. The rest of
deploy/kubernetes: test_deploy_kubernetes.py."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from kubernetes_manifests import (
    COORDINATOR,
    DOCS,
    NAMESPACE,
    NODE_NAMESPACE,
    ROOT,
    find,
    pod_spec_of,
    workloads,
)

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
    return str(find("Namespace", namespace)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"])


def test_namespaces_enforce_the_strictest_level_their_pods_meet() -> None:
    """The control plane's namespace enforces `restricted`; the node namespace needs `privileged` because
    the agent's hostPath volumes are beyond `baseline` (and nothing else is)."""
    assert _enforced(NAMESPACE) == "restricted"
    assert _enforced(NODE_NAMESPACE) == "privileged"
    for workload in workloads():
        ns, pod = workload["metadata"]["namespace"], workload["spec"]["template"]["spec"]
        where = f"{workload['kind']}/{workload['metadata']['name']}"
        assert pod_security_violations(pod, _enforced(ns)) == [], where
        # ...and the level is no looser than it must be.
        stricter = LEVELS[LEVELS.index(_enforced(ns)) + 1:]
        assert all(pod_security_violations(pod, level) for level in stricter), f"{where}: {ns} could be stricter"
    agent = pod_spec_of("DaemonSet", "ftd-agent")
    assert pod_security_violations(agent, "baseline") == [f"volume {v['name']}: hostPath" for v in agent["volumes"]
                                                         if "hostPath" in v]


@pytest.mark.parametrize("workload", ["StatefulSet/etcd", "StatefulSet/ftd-coordinator", "Job/ftd-etcd-auth"])
def test_control_plane_pods_meet_restricted_with_a_read_only_root(workload: str) -> None:
    kind, name = workload.split("/")
    pod = pod_spec_of(kind, name)
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
    pod = copy.deepcopy(pod_spec_of(*COORDINATOR))
    change(pod["containers"][0], pod)
    assert any(expected in v for v in pod_security_violations(pod, "restricted")), expected


def _effective(pod: dict[str, Any], container: dict[str, Any], key: str) -> Any:
    own = container.get("securityContext", {})
    return own[key] if key in own else pod.get("securityContext", {}).get(key)


def test_every_container_runs_as_non_root() -> None:
    checked = 0
    for doc in workloads():
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
    for doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        for container in pod.get("initContainers", []):
            if _effective(pod, container, "runAsUser") == 0 or _effective(pod, container, "runAsNonRoot") is not True:
                root.append((doc["metadata"]["name"], container))
    assert [(n, c["name"]) for n, c in root] == [("ftd-agent", "own-dirs")]
    container = root[0][1]
    sc = container["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert sc["allowPrivilegeEscalation"] is False
    agent_user = pod_spec_of("DaemonSet", "ftd-agent")["securityContext"]["runAsUser"]
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
    for doc in workloads():
        pod = doc["spec"]["template"]["spec"]
        assert pod.get("automountServiceAccountToken") is False, doc["metadata"]["name"]
        assert pod.get("serviceAccountName", "default") in {*accounts, "default"}
    assert pod_spec_of("DaemonSet", "ftd-agent")["serviceAccountName"] == "ftd-agent"
    assert pod_spec_of(*COORDINATOR)["serviceAccountName"] == "ftd-coordinator"
    code = [p for d in ("agent", "coordinator", "ftd", "ftctl", "training", "storage_backends", "checkpoints")
            for p in (ROOT / d).rglob("*.py")]
    assert code
    users = [str(p.relative_to(ROOT)) for p in code if API_CLIENT.search(p.read_text(errors="replace"))]
    assert users == [], f"these use the Kubernetes API: give them a Role in the manifests: {users}"


