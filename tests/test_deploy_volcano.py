"""deploy/kubernetes/volcano: a training job gang-scheduled by Volcano beside ftd's agent DaemonSet.

Validation: Volcano's own resources (PodGroup, Queue) against the ``openAPIV3Schema`` of Volcano's real
CRDs, stored in deploy/kubernetes/volcano/crds/ with their source (README.md, hashes checked here), with
the ``jsonschema`` package in strict mode: every object schema that lists its properties and does not
say otherwise (``additionalProperties``, ``x-kubernetes-preserve-unknown-fields``) rejects unknown
fields, as the API server's strict field validation does. ``metadata`` is checked against Kubernetes'
ObjectMeta and core resources (the Job) against Kubernetes 1.30, both with kubernetes-validate (strict).

Then what a schema cannot check: the pods are Volcano's gang (scheduler, PodGroup, queue), the gang is
the job's minimum of nodes, and each pod runs torchrun with ftd's rendezvous reaching its node's agent
by the names the agent's manifest really uses. torchrun's own argument parser and ftd's rendezvous
handler read the pod's command line and environment, so a misspelt option or variable fails here.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_manifests import FIELD_VALUES, container_of, load_settings, pod_spec_of, resolved_env

from ftd.agent.settings import ENV_PREFIX as AGENT_ENV_PREFIX
from ftd.agent.settings import AgentSettings

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "deploy" / "kubernetes"
VOLCANO_DIR = K8S_DIR / "volcano"
CRD_DIR = VOLCANO_DIR / "crds"
K8S_VERSION = "1.30"
MANIFESTS = ("queue.yaml", "training-job.yaml")
UPSTREAM_REPO = "volcano-sh/volcano"
GROUP_NAME_ANNOTATION = "scheduling.k8s.io/group-name"  # Volcano's KubeGroupNameAnnotationKey


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


DOCS: list[tuple[str, dict[str, Any]]] = [(name, doc) for name in MANIFESTS for doc in _load(VOLCANO_DIR / name)]


def _find(kind: str) -> dict[str, Any]:
    found = [d for _, d in DOCS if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/kubernetes/volcano, found {len(found)}"
    return found[0]


# ---- Volcano's CRDs and the strict validator ------------------------------------------------------------


def _crds() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the CRD version's facts: schema, scope, file."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        (crd,) = _load(path)
        assert (crd["apiVersion"], crd["kind"]) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition"), path
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = {
                    "schema": version["schema"]["openAPIV3Schema"], "scope": spec["scope"], "file": path.name}
    return out


CRDS = _crds()


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where every object schema with ``properties`` and no word on extra fields forbids them."""
    out = copy.deepcopy(schema)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for key in ("properties", "patternProperties"):
                for child in node.get(key, {}).values():
                    visit(child)
            for key in ("items", "additionalProperties", "not"):
                visit(node.get(key))
            for key in ("anyOf", "allOf", "oneOf"):
                for child in node.get(key, []):
                    visit(child)
        elif isinstance(node, list):
            for child in node:
                visit(child)

    visit(out)
    return out


def validate_custom(doc: dict[str, Any], strict: bool = True) -> str:
    """Validates a Volcano resource against its stored CRD; returns the CRD's file name. Raises
    LookupError for a kind no stored CRD serves, jsonschema.ValidationError or
    kubernetes_validate.ValidationError for an invalid document."""
    crd = CRDS.get((doc.get("apiVersion", ""), doc.get("kind", "")))
    if crd is None:
        raise LookupError(f"no stored CRD serves {doc.get('apiVersion')} {doc.get('kind')}: {sorted(CRDS)}")
    schema = strict_schema(crd["schema"]) if strict else crd["schema"]
    jsonschema.Draft202012Validator(schema).validate(doc)
    # `metadata` is only `type: object` in a CRD: the API server checks it as ObjectMeta.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]},
                                 K8S_VERSION, strict=strict)
    namespaced = "namespace" in doc["metadata"]
    assert namespaced == (crd["scope"] == "Namespaced"), f"{doc['kind']} is {crd['scope']}-scoped"
    return str(crd["file"])


def validate(doc: dict[str, Any]) -> str:
    """Any document of deploy/kubernetes/volcano: Volcano's kinds by their CRDs, the rest by Kubernetes."""
    if doc["apiVersion"].split("/")[0].endswith("volcano.sh"):
        return validate_custom(doc)
    return str(kubernetes_validate.validate(doc, K8S_VERSION, strict=True))


# ---- the stored CRDs -------------------------------------------------------------------------------------


def _readme_table() -> dict[str, tuple[str, str]]:
    """file -> (upstream path, sha256), from crds/README.md."""
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([0-9a-f]{64})` \|$", (CRD_DIR / "README.md").read_text(),
                      re.MULTILINE)
    return {file: (path, digest) for file, path, digest in rows}


def test_crds_are_the_recorded_upstream_files() -> None:
    readme = (CRD_DIR / "README.md").read_text()
    assert f"https://github.com/{UPSTREAM_REPO}" in readme
    assert re.search(r"commit `[0-9a-f]{40}`", readme), "README.md must name the source commit"
    table = _readme_table()
    assert sorted(table) == sorted(p.name for p in CRD_DIR.glob("*.yaml"))
    for file, (upstream, digest) in table.items():
        assert upstream.endswith("/" + file) and upstream.startswith("config/crd/volcano/bases/"), upstream
        actual = hashlib.sha256((CRD_DIR / file).read_bytes()).hexdigest()
        assert actual == digest, f"{file} differs from the upstream copy recorded in crds/README.md"


def test_the_crds_serve_podgroup_and_queue() -> None:
    assert CRDS[("scheduling.volcano.sh/v1beta1", "PodGroup")]["scope"] == "Namespaced"
    assert CRDS[("scheduling.volcano.sh/v1beta1", "Queue")]["scope"] == "Cluster"


@pytest.mark.parametrize("key", sorted(CRDS), ids=[k for _, k in sorted(CRDS)])
def test_crd_schemas_are_valid_json_schemas(key: tuple[str, str]) -> None:
    jsonschema.Draft202012Validator.check_schema(CRDS[key]["schema"])
    jsonschema.Draft202012Validator.check_schema(strict_schema(CRDS[key]["schema"]))


# ---- schema validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in DOCS])
def test_manifest_validates(name: str, doc: dict[str, Any]) -> None:
    assert validate(doc)


def test_strict_mode_rejects_unknown_fields() -> None:
    podgroup = copy.deepcopy(_find("PodGroup"))
    podgroup["spec"]["minMembers"] = podgroup["spec"].pop("minMember")  # misspelt
    assert validate_custom(podgroup, strict=False)  # the API server would silently drop it: no gang at all
    with pytest.raises(jsonschema.ValidationError, match="minMembers"):
        validate_custom(podgroup)
    queue = copy.deepcopy(_find("Queue"))
    queue["spec"]["reclaimble"] = False
    with pytest.raises(jsonschema.ValidationError, match="reclaimble"):
        validate_custom(queue)
    top = copy.deepcopy(_find("Queue"))
    top["specs"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(top)
    meta = copy.deepcopy(_find("PodGroup"))
    meta["metadata"]["labelz"] = {"a": "b"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_custom(meta)


@pytest.mark.parametrize(("kind", "path", "value"), [
    ("PodGroup", ("spec", "minMember"), "sixteen"),
    ("PodGroup", ("spec", "minMember"), -1),  # minimum: 0
    ("PodGroup", ("spec", "minResources", "nvidia.com/gpu"), "lots"),  # not a quantity
    ("Queue", ("spec", "weight"), 0),  # minimum: 1
    ("Queue", ("spec", "reclaimable"), "no"),
])
def test_the_validator_rejects_wrong_values(kind: str, path: tuple[str, ...], value: Any) -> None:
    doc = copy.deepcopy(_find(kind))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError) as info:
        validate_custom(doc)
    assert tuple(info.value.absolute_path) == path


def test_an_unknown_custom_kind_or_version_is_an_error_not_a_skip() -> None:
    doc = copy.deepcopy(_find("PodGroup"))
    doc["apiVersion"] = "scheduling.volcano.sh/v1beta9"
    with pytest.raises(LookupError):
        validate(doc)
    doc = copy.deepcopy(_find("PodGroup"))
    doc["kind"] = "Job"
    doc["apiVersion"] = "batch.volcano.sh/v1alpha1"  # a vcjob: no CRD stored for it, so not allowed here
    with pytest.raises(LookupError):
        validate(doc)


def test_scope_is_checked() -> None:
    queue = copy.deepcopy(_find("Queue"))
    queue["metadata"]["namespace"] = "ftd"
    with pytest.raises(AssertionError, match="Cluster"):
        validate_custom(queue)


def test_kustomizations() -> None:
    volcano = yaml.safe_load((VOLCANO_DIR / "kustomization.yaml").read_text())
    on_disk = {p.name for p in VOLCANO_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(volcano["resources"]) == sorted(on_disk) == sorted(MANIFESTS)
    images = {i["name"] for i in volcano.get("images", [])}
    assert _train_container()["image"].split(":")[0] in images
    # Not part of ftd's own deployment: Volcano is optional.
    default = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert not [r for r in default["resources"] if "/" in r]


# ---- the gang --------------------------------------------------------------------------------------------


def _job_pod() -> dict[str, Any]:
    return dict(_find("Job")["spec"]["template"])


def _train_container() -> dict[str, Any]:
    (container,) = _job_pod()["spec"]["containers"]
    return dict(container)


def _torchrun_args() -> Any:
    from torch.distributed.run import get_args_parser

    command = _train_container()["command"]
    assert command[0] == "torchrun"
    return get_args_parser().parse_args(command[1:])


def test_the_pods_are_a_volcano_gang_in_the_queue() -> None:
    podgroup, job, queue = _find("PodGroup"), _find("Job"), _find("Queue")
    pod = _job_pod()
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"][GROUP_NAME_ANNOTATION] == podgroup["metadata"]["name"]
    assert job["metadata"]["namespace"] == podgroup["metadata"]["namespace"]  # the annotation is namespace-local
    assert podgroup["spec"]["queue"] == queue["metadata"]["name"]
    assert queue["spec"]["reclaimable"] is False  # an eviction for another queue would be a "dead node"


def test_the_gang_is_the_jobs_minimum_of_nodes_and_every_node_gets_a_pod() -> None:
    podgroup, job = _find("PodGroup"), _find("Job")
    args = _torchrun_args()
    min_nodes, _, max_nodes = args.nnodes.partition(":")
    assert podgroup["spec"]["minMember"] == int(min_nodes) <= int(max_nodes or min_nodes)
    # One pod per ftd node: the active ones and at least one hot spare above the gang.
    assert job["spec"]["parallelism"] > podgroup["spec"]["minMember"]
    assert "completions" not in job["spec"]  # with completions, the Job would start only that many pods
    gpus = int(_train_container()["resources"]["limits"]["nvidia.com/gpu"])
    assert int(args.nproc_per_node) == gpus  # one worker per GPU
    assert int(podgroup["spec"]["minResources"]["nvidia.com/gpu"]) == podgroup["spec"]["minMember"] * gpus
    terms = _job_pod()["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    labels = _job_pod()["metadata"]["labels"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname"
               and all(labels.get(k) == v for k, v in t["labelSelector"]["matchLabels"].items()) for t in terms)


def test_a_lost_node_does_not_fail_the_job() -> None:
    spec = _find("Job")["spec"]
    assert _job_pod()["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules


# ---- torchrun with ftd's rendezvous, reaching the node's agent ---------------------------------------------


def test_torchrun_uses_the_ftd_rendezvous_on_the_agents_coordinators(tmp_path: Path) -> None:
    args = _torchrun_args()
    assert args.rdzv_backend == "ftd"
    agent = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    assert args.rdzv_endpoint == agent.coordinators  # the coordinators, as the agents reach them
    assert args.rdzv_id == _find("PodGroup")["metadata"]["name"] == _find("Job")["metadata"]["name"]
    assert args.max_restarts >= 1000  # the budget is the job's, in --rdzv-conf
    (handler,) = [e for e in importlib.metadata.entry_points(group="torchrun.handlers") if e.name == "ftd"]
    assert handler.value == "ftd.training.rendezvous:handler_creator"


def test_ftds_rendezvous_handler_reads_the_pods_command_line_and_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler torchrun would create in this pod: its node id, address, agent socket, job and budget."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from ftd.training.rendezvous import FtdRendezvousHandler, create_handler

    env = resolved_env(_train_container())
    for key in ("FTD_NODE_ID", "FTD_HOST", "FTD_AGENT_SOCKET"):
        monkeypatch.setenv(key, env[key])
    args = _torchrun_args()
    min_nodes, _, max_nodes = args.nnodes.partition(":")
    params = RendezvousParameters(backend=args.rdzv_backend, endpoint=args.rdzv_endpoint, run_id=args.rdzv_id,
                                  min_nodes=int(min_nodes), max_nodes=int(max_nodes or min_nodes),
                                  local_addr=args.local_addr, **_parse_rendezvous_config(args.rdzv_conf))
    handler = create_handler(params)
    try:
        assert isinstance(handler, FtdRendezvousHandler)
        assert handler.node_id == FIELD_VALUES["spec.nodeName"]  # the id the node's agent registered
        assert handler.local_addr == FIELD_VALUES["status.hostIP"]
        assert handler.job == args.rdzv_id
        assert handler.min_nodes == _find("PodGroup")["spec"]["minMember"]
        assert handler.max_restarts == 50
        assert handler.agent is not None
        agent = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
        assert handler.agent.socket_path == str(agent.effective_socket)
    finally:
        handler.shutdown()


def test_the_pod_is_on_its_nodes_agent(tmp_path: Path) -> None:
    container = _train_container()
    env = {e["name"]: e for e in container["env"]}
    agent_container = container_of("DaemonSet", "ftd-agent", "agent")
    agent_env = {e["name"]: e for e in agent_container["env"]}
    # The same node identity and address as the agent.
    assert env["FTD_NODE_ID"]["valueFrom"] == agent_env["FTD_AGENT_NODE_ID"]["valueFrom"]
    assert env["FTD_HOST"]["valueFrom"] == agent_env["FTD_AGENT_HOST"]["valueFrom"]
    # The agent's socket and tier directories are the same host directories, at the same paths (the
    # Checkpointer opens the paths the agent's GetTiers returns).
    agent = load_settings("DaemonSet", "ftd-agent", "agent", AgentSettings, AGENT_ENV_PREFIX, tmp_path)
    agent_pod, pod = pod_spec_of("DaemonSet", "ftd-agent"), _job_pod()["spec"]

    def host_path(pod_spec: dict[str, Any], c: dict[str, Any], path: Path) -> tuple[str, Path]:
        mounts = [m for m in c["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
        assert "hostPath" in volume, f"{path} is not on a host directory"
        return volume["hostPath"]["path"], path.relative_to(mount["mountPath"])

    needed = [agent.effective_socket, *agent.tiers.values()]
    assert Path(env["FTD_AGENT_SOCKET"]["value"]) == agent.effective_socket
    for path in needed:
        assert host_path(pod, container, path) == host_path(agent_pod, agent_container, path), path
    assert {v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v} == {"Directory"}
    # Connecting to the socket needs write permission on it: the agent's user.
    assert pod["securityContext"]["runAsUser"] == agent_pod["securityContext"]["runAsUser"]


def test_the_store_binds_the_nodes_address() -> None:
    pod = _job_pod()["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = {e["name"]: e for e in _train_container()["env"]}
    assert env["FTD_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"


def test_the_training_container_is_locked_down() -> None:
    pod = _job_pod()["spec"]
    container = _train_container()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["terminationGracePeriodSeconds"] >= 60  # the Checkpointer's emergency flush on SIGTERM
