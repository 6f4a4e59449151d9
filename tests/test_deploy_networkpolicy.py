"""deploy/kubernetes/networkpolicy.yaml, evaluated as data: who may open a TCP connection to which pod port.

A small evaluator of Kubernetes' NetworkPolicy ingress rules (networking.k8s.io/v1), without a cluster:
a pod selected by no Ingress policy accepts everything; a selected pod accepts a connection when some
rule of some policy selecting it matches both the source (podSelector in the policy's namespace,
namespaceSelector, both in one peer = both must match, ipBlock) and the port (number or named container
port). The pods are the manifests' own pod templates, plus the other parties the policies are written for
(operator pods, Prometheus, strangers). The matrix is the one in docs/kubernetes.md ("Network policies").
"""

from __future__ import annotations

import copy
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "kubernetes"
POLICIES_FILE = K8S_DIR / "networkpolicy.yaml"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


# ---- the evaluator ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # named container ports
    ip: str = "10.244.0.10"
    host_network: bool = False


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector: matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist); {} selects all."""
    if selector is None:
        return True
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    assert not unknown, f"unknown selector fields {unknown}"
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def namespace_labels(namespace: str) -> dict[str, str]:
    """A namespace's labels as the API server sets them (kubernetes.io/metadata.name) plus the manifests'."""
    own = next((d["metadata"].get("labels", {}) for d in MANIFEST_DOCS
                if d["kind"] == "Namespace" and d["metadata"]["name"] == namespace), {})
    return {**own, "kubernetes.io/metadata.name": namespace}


def peer_matches(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        # Cluster pods are matched by selectors; ipBlock is for traffic from outside the pod network, here
        # the host-network pods (which connect from their node's address).
        if not source.host_network:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(e) for e in block.get("except", []))
    if source.host_network:
        return False  # no selector matches a host-network pod's traffic
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(source.namespace)):
            return False
    elif source.namespace != policy_namespace:
        return False  # a bare podSelector means pods of the policy's own namespace
    return selects(peer.get("podSelector"), source.labels)


def port_matches(rule_port: dict[str, Any], target: Pod, port: int, protocol: str = "TCP") -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    if "port" not in rule_port:
        return True
    wanted = rule_port["port"]
    number = target.ports.get(wanted) if isinstance(wanted, str) else wanted
    if number is None:
        return False
    return number <= port <= rule_port.get("endPort", number)


def allowed(source: Pod, target: Pod, port: int, policies: list[dict[str, Any]], protocol: str = "TCP") -> bool:
    """May ``source`` open a TCP connection (or send a UDP datagram) to ``target``:``port`` under ``policies``?"""
    if target.host_network:
        return True  # policies do not isolate host-network pods
    isolating = [p for p in policies if p["metadata"]["namespace"] == target.namespace
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], target.labels)]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers and not any(peer_matches(p, policy["metadata"]["namespace"], source) for p in peers):
                continue
            ports = rule.get("ports")
            if ports and not any(port_matches(p, target, port, protocol) for p in ports):
                continue
            return True
    return False


# ---- the manifests' pods ---------------------------------------------------------------------------------


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


MANIFEST_DOCS = [d for name in yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())["resources"]
                 for d in _load(K8S_DIR / name)]
POLICIES = [d for d in MANIFEST_DOCS if d["kind"] == "NetworkPolicy"]


def _pod(kind: str, name: str, index: int = 0) -> Pod:
    (workload,) = [d for d in MANIFEST_DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    template = workload["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
             if "name" in p}
    return Pod(f"{name}-{index}", workload["metadata"]["namespace"], dict(template["metadata"]["labels"]), ports,
               ip=f"10.244.{len(name)}.{index + 10}", host_network=bool(template["spec"].get("hostNetwork")))


ETCD = _pod("StatefulSet", "etcd")
ETCD_PEER = _pod("StatefulSet", "etcd", 1)
COORDINATOR = _pod("StatefulSet", "ftd-coordinator")
OTHER_COORDINATOR = _pod("StatefulSet", "ftd-coordinator", 1)
AGENT = _pod("DaemonSet", "ftd-agent")
OTHER_AGENT = _pod("DaemonSet", "ftd-agent", 1)
AUTH_JOB = _pod("Job", "ftd-etcd-auth")
OPERATOR = Pod("toolbox", "ftd", {"ftd.io/operator": "true"})
OPERATOR_ELSEWHERE = Pod("toolbox", "default", {"ftd.io/operator": "true"})
OPERATOR_ON_NODE_SIDE = Pod("toolbox", "ftd-node", {"ftd.io/operator": "true"})
PROMETHEUS = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
STRANGER = Pod("web", "default", {"app": "web"})
STRANGER_IN_FTD = Pod("debug", "ftd", {"app": "debug"})
# A training pod of deploy/kubernetes/volcano (host network, in ftd-node) and one on the pod network.
TRAINING_HOST_NETWORK = Pod("llm-7b-0", "ftd-node", {"app.kubernetes.io/name": "llm-7b"}, ip="192.168.10.7",
                            host_network=True)
TRAINING = Pod("llm-7b-0", "ftd-node", {"app.kubernetes.io/name": "llm-7b"})

ETCD_CLIENT, ETCD_PEER_PORT, ETCD_METRICS = (ETCD.ports[n] for n in ("client", "peer", "metrics"))
COORDINATOR_GRPC, COORDINATOR_METRICS = COORDINATOR.ports["grpc"], COORDINATOR.ports["metrics"]
COORDINATOR_BEACONS = COORDINATOR.ports["beacons"]  # UDP
AGENT_GRPC, AGENT_METRICS = AGENT.ports["grpc"], AGENT.ports["metrics"]
AGENT_PEER_COPY = AGENT.ports["peer-copy"]

EVERYONE = {
    "etcd": ETCD_PEER, "coordinator": OTHER_COORDINATOR, "agent": OTHER_AGENT, "auth-job": AUTH_JOB,
    "operator": OPERATOR, "operator-elsewhere": OPERATOR_ELSEWHERE, "operator-node-side": OPERATOR_ON_NODE_SIDE,
    "prometheus": PROMETHEUS, "stranger": STRANGER, "stranger-in-ftd": STRANGER_IN_FTD, "training": TRAINING,
    "training-host-network": TRAINING_HOST_NETWORK,
}
# (target, port) -> who may connect; everyone else in EVERYONE may not. docs/kubernetes.md's table.
MATRIX: dict[tuple[str, int], set[str]] = {
    ("etcd", ETCD_CLIENT): {"coordinator", "auth-job"},
    ("etcd", ETCD_PEER_PORT): {"etcd"},
    ("etcd", ETCD_METRICS): {"prometheus"},
    ("coordinator", COORDINATOR_GRPC): {"agent", "coordinator", "operator"},
    ("coordinator", COORDINATOR_METRICS): {"prometheus"},
    ("coordinator", COORDINATOR_BEACONS): {"agent"},  # UDP liveness beacons
    ("agent", AGENT_GRPC): {"agent", "coordinator", "operator"},
    ("agent", AGENT_METRICS): {"prometheus"},
    ("agent", AGENT_PEER_COPY): {"agent"},  # a spare's agent pulling a shard for its restore
}
TARGETS = {"etcd": ETCD, "coordinator": COORDINATOR, "agent": AGENT}


# ---- the matrix ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "port"), sorted(MATRIX), ids=[f"{t}:{p}" for t, p in sorted(MATRIX)])
def test_the_policy_matrix(target: str, port: int) -> None:
    protocol = "UDP" if (target, port) == ("coordinator", COORDINATOR_BEACONS) else "TCP"
    may = {who for who, pod in EVERYONE.items() if allowed(pod, TARGETS[target], port, POLICIES, protocol)}
    assert may == MATRIX[(target, port)], f"{target}:{port}"


def test_every_declared_port_is_in_the_matrix() -> None:
    """A container port nobody may reach is a port someone forgot; one missing here escapes the matrix."""
    for name, pod in TARGETS.items():
        assert {(name, p) for p in pod.ports.values()} <= set(MATRIX), name


def test_the_headline_cases() -> None:
    assert not allowed(AGENT, ETCD, ETCD_CLIENT, POLICIES)  # a node never talks to etcd
    assert allowed(COORDINATOR, ETCD, ETCD_CLIENT, POLICIES)
    assert not allowed(COORDINATOR, ETCD, ETCD_PEER_PORT, POLICIES)  # clients stay off the peer port
    assert allowed(ETCD_PEER, ETCD, ETCD_PEER_PORT, POLICIES)
    assert allowed(AGENT, COORDINATOR, COORDINATOR_GRPC, POLICIES)
    assert not allowed(STRANGER, COORDINATOR, COORDINATOR_GRPC, POLICIES)
    assert allowed(OPERATOR, AGENT, AGENT_GRPC, POLICIES)
    assert not allowed(PROMETHEUS, COORDINATOR, COORDINATOR_GRPC, POLICIES)  # metrics only


def test_every_pod_of_both_namespaces_is_isolated() -> None:
    """The default deny: a pod that a future manifest adds is closed until a policy opens it."""
    newcomer = {ns: Pod("new", ns, {"app": "new"}, {"http": 8080}) for ns in ("ftd", "ftd-node")}
    for pod in newcomer.values():
        assert not any(allowed(src, pod, 8080, POLICIES) for src in EVERYONE.values() if not src.host_network)
    for ns in newcomer:
        deny = [p for p in POLICIES if p["metadata"]["namespace"] == ns and p["spec"]["podSelector"] == {}
                and not p["spec"].get("ingress")]
        assert [p["metadata"]["name"] for p in deny] == ["default-deny-ingress"], ns


def test_host_network_pods_need_an_ip_block_for_the_nodes() -> None:
    """The Volcano training pods dial the coordinators from their node's address: no selector admits them
    (docs/kubernetes.md says to add the nodes' network), and an ipBlock for that network does."""
    assert not allowed(TRAINING_HOST_NETWORK, COORDINATOR, COORDINATOR_GRPC, POLICIES)
    with_nodes = copy.deepcopy(POLICIES)
    (coordinator_policy,) = [p for p in with_nodes if p["metadata"]["name"] == "ftd-coordinator"]
    coordinator_policy["spec"]["ingress"].append(
        {"from": [{"ipBlock": {"cidr": "192.168.0.0/16"}}], "ports": [{"protocol": "TCP", "port": COORDINATOR_GRPC}]})
    assert allowed(TRAINING_HOST_NETWORK, COORDINATOR, COORDINATOR_GRPC, with_nodes)
    assert not allowed(TRAINING_HOST_NETWORK, ETCD, ETCD_CLIENT, with_nodes)
    assert not allowed(STRANGER, COORDINATOR, COORDINATOR_GRPC, with_nodes)  # pods are not matched by ipBlock


def test_the_policies_select_the_workloads_they_are_named_for() -> None:
    named = {p["metadata"]["name"]: p for p in POLICIES if p["spec"]["podSelector"]}
    assert selects(named["etcd"]["spec"]["podSelector"], ETCD.labels)
    assert selects(named["ftd-coordinator"]["spec"]["podSelector"], COORDINATOR.labels)
    assert selects(named["ftd-agent"]["spec"]["podSelector"], AGENT.labels)
    assert not selects(named["etcd"]["spec"]["podSelector"], COORDINATOR.labels)


# ---- the evaluator itself --------------------------------------------------------------------------------


def _policy(namespace: str, ingress: list[dict[str, Any]], selector: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": namespace},
            "spec": {"podSelector": selector or {}, "policyTypes": ["Ingress"], "ingress": ingress}}


def test_evaluator_one_peer_with_both_selectors_means_and_two_peers_mean_or() -> None:
    """The classic mistake: `- namespaceSelector: A` + `podSelector: B` in ONE list item is "B pods in A
    namespaces"; as two items it is "anything in A, or B pods of this namespace"."""
    target = Pod("t", "ns1", {"app": "t"}, {"grpc": 7000})
    b_in_a = Pod("s", "a", {"app": "b"})
    other_in_a = Pod("s", "a", {"app": "other"})
    ns_a = {"matchLabels": {"kubernetes.io/metadata.name": "a"}}
    pod_b = {"matchLabels": {"app": "b"}}
    conjunction = [_policy("ns1", [{"from": [{"namespaceSelector": ns_a, "podSelector": pod_b}]}])]
    disjunction = [_policy("ns1", [{"from": [{"namespaceSelector": ns_a}, {"podSelector": pod_b}]}])]
    assert allowed(b_in_a, target, 7000, conjunction) and not allowed(other_in_a, target, 7000, conjunction)
    assert allowed(other_in_a, target, 7000, disjunction)  # any pod of namespace a
    assert not allowed(Pod("s", "c", {"app": "b"}), target, 7000, disjunction)  # bare podSelector: ns1 only
    assert allowed(Pod("s", "ns1", {"app": "b"}), target, 7000, disjunction)


def test_evaluator_ports_selectors_and_isolation() -> None:
    target = Pod("t", "ns1", {"app": "t"}, {"grpc": 7000})
    src = Pod("s", "ns1", {"app": "s"})
    assert allowed(src, target, 7000, [])  # no policy: not isolated
    assert not allowed(src, target, 7000, [_policy("ns1", [])])  # selected, no rule: isolated
    assert allowed(src, target, 7000, [_policy("ns1", [{}])])  # an empty rule admits everything
    assert allowed(src, target, 7000, [_policy("ns1", [{"ports": [{"port": "grpc"}]}])])  # named port
    assert not allowed(src, target, 7001, [_policy("ns1", [{"ports": [{"port": "grpc"}]}])])
    assert allowed(src, target, 7005, [_policy("ns1", [{"ports": [{"port": 7000, "endPort": 7010}]}])])
    assert not allowed(src, target, 7000, [_policy("ns1", [{"ports": [{"protocol": "UDP", "port": 7000}]}])])
    assert allowed(src, target, 7000, [_policy("ns2", [])])  # another namespace's policy does not apply
    assert allowed(src, target, 7000, [_policy("ns1", [], {"matchLabels": {"app": "other"}})])  # not selected
    expr = {"matchExpressions": [{"key": "app", "operator": "In", "values": ["s", "x"]}]}
    assert allowed(src, target, 7000, [_policy("ns1", [{"from": [{"podSelector": expr}]}])])
    notin = {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["s"]}]}
    assert not allowed(src, target, 7000, [_policy("ns1", [{"from": [{"podSelector": notin}]}])])
