"""deploy/ builds into valid Kubernetes and Gateway API objects that agree with each other and with kvgate.

The kustomizations are built by a small Python subset of kustomize (resources, namespace, configMapGenerator,
JSON6902 patches, replicas, images); a kustomization using anything else fails the build, and when kubectl is
on PATH the result is compared with `kubectl kustomize`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate.router.cli import build_parser, cli_settings
from kvgate.router.config import from_sources

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SCHEMAS = REPO.parent / "shared" / "schemas"  # Gateway API CRDs, beside the repository
KUBERNETES_VERSION = "1.33"
OVERLAYS = ("overlays/dev", "overlays/production", "overlays/picker")
KUSTOMIZATIONS = tuple(sorted(str(p.parent.relative_to(DEPLOY)) for p in DEPLOY.rglob("kustomization.yaml")))
# The paths kvgate serves on `listen` and, when `admin_listen` is set, on the admin listener (router/server.py).
KVGATE_PUBLIC_PATHS = frozenset({
    "/healthz", "/readyz", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
})
KVGATE_ADMIN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/debug/fleet"})
GATEWAY = "kvgate"  # Deployment and container name of the gateway
# validated against shared/schemas, not kubernetes-validate
CRD_GROUPS = ("gateway.networking.k8s.io/", "inference.networking.k8s.io/", "inference.networking.x-k8s.io/")
POOL_READS = [{"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
               "verbs": ["get", "list", "watch"]},
              {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
               "verbs": ["get", "list", "watch"]},
              {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
SLICE_READS = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
SUPPORTED_FIELDS = frozenset({
    "apiVersion", "kind", "namespace", "resources", "configMapGenerator", "patches", "replicas", "images",
})


# ---- a kustomize subset ---------------------------------------------------------------------------------

@dataclass
class Resource:
    """One built object, with the namespace its file gave it (kustomize's name references key on that)."""

    obj: dict[str, Any]
    origin_namespace: str | None


def load_documents(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in a text."""
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


@functools.cache
def build(directory: str) -> tuple[Resource, ...]:
    """Build deploy/<directory> as kustomize would (for the fields in SUPPORTED_FIELDS)."""
    root = DEPLOY / directory
    (kustomization,) = load_documents((root / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED_FIELDS
    assert not unsupported, f"{directory}: teach tests/test_manifests.py kustomize's {sorted(unsupported)}"
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        path = (root / entry).resolve()
        if path.is_dir():
            resources += [copy.deepcopy(r) for r in build(str(path.relative_to(DEPLOY)))]
        else:
            documents = load_documents(path.read_text())
            resources += [Resource(doc, doc["metadata"].get("namespace")) for doc in documents]
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (root / f).read_text() for f in generator["files"]}
        resources.append(Resource({"apiVersion": "v1", "kind": "ConfigMap",
                                   "metadata": {"name": generator["name"]}, "data": data}, None))
    for patch in kustomization.get("patches", []):
        target = find_obj([r.obj for r in resources], patch["target"]["kind"], patch["target"]["name"])
        for operation in yaml.safe_load(patch["patch"]):
            apply_json_patch(target, operation)
    for replica in kustomization.get("replicas", []):
        find_obj([r.obj for r in resources], "Deployment", replica["name"])["spec"]["replicas"] = replica["count"]
    for image in kustomization.get("images", []):
        retag(resources, image)
    if "namespace" in kustomization:
        set_namespace(resources, kustomization["namespace"])
    return tuple(resources)


def objects(directory: str) -> list[dict[str, Any]]:
    """The built objects of deploy/<directory>."""
    return [r.obj for r in build(directory)]


def apply_json_patch(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """Apply one RFC 6902 add, replace or remove operation in place."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    assert op in ("add", "replace", "remove"), f"unsupported patch op {op}"
    if isinstance(node, list):
        if op == "add":
            node.insert(len(node) if last == "-" else int(last), operation["value"])
        elif op == "replace":
            node[int(last)] = operation["value"]
        else:
            del node[int(last)]
    elif op == "remove":
        del node[last]
    else:
        assert op == "add" or last in node, f"replace of missing {operation['path']}"
        node[last] = operation["value"]


def retag(resources: list[Resource], image: dict[str, str]) -> None:
    """kustomize `images:`: rename and retag containers whose image name matches (NAME:TAG images only)."""
    for resource in resources:
        for spec in pod_spec(resource.obj).get("containers", []):
            name, _, tag = spec["image"].rpartition(":")
            if name == image["name"]:
                spec["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def set_namespace(resources: list[Resource], namespace: str) -> None:
    """kustomize `namespace:`, with its rewrite of RoleBinding subjects that name a ServiceAccount here."""
    accounts = {(r.obj["metadata"]["name"], r.origin_namespace)
                for r in resources if r.obj["kind"] == "ServiceAccount"}
    for resource in resources:
        resource.obj["metadata"]["namespace"] = namespace
        for subject in resource.obj.get("subjects", []):
            if subject["kind"] == "ServiceAccount" and (subject["name"], subject.get("namespace")) in accounts:
                subject["namespace"] = namespace


# ---- reading the built objects --------------------------------------------------------------------------

def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template spec of a workload, or {} for anything else."""
    return obj.get("spec", {}).get("template", {}).get("spec", {}) if obj["kind"] == "Deployment" else {}


def of_kind(built: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The built objects of one kind."""
    return [obj for obj in built if obj["kind"] == kind]


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """A named container of a Deployment."""
    (found,) = [c for c in pod_spec(deployment)["containers"] if c["name"] == name]
    return found


def cli_value(args: list[str], flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in an argument list."""
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def mounted_file(built: list[dict[str, Any]], deployment: dict[str, Any], path: str) -> str:
    """The text a ConfigMap volume puts at `path` in the gateway container."""
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    for mount in container(deployment, GATEWAY)["volumeMounts"]:
        if mount["mountPath"] == path:
            key = mount["subPath"]
        elif path.startswith(mount["mountPath"].rstrip("/") + "/"):
            key = path[len(mount["mountPath"].rstrip("/")) + 1:]
        else:
            continue
        config_map = find_obj(built, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
        return config_map["data"][key]
    raise AssertionError(f"nothing is mounted at {path}")


def find_obj(built: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one built object of this kind and name."""
    (found,) = [obj for obj in of_kind(built, kind) if obj["metadata"]["name"] == name]
    return found


def kvgate_setting(built: list[dict[str, Any]], name: str) -> Any:
    """The value kvgate ends up with for a setting: config file < KVGATE_* env < CLI flag."""
    deployment = find_obj(built, "Deployment", GATEWAY)
    gateway = container(deployment, GATEWAY)
    args = gateway.get("args", [])
    flag = cli_value(args, "--" + name.replace("_", "-"))
    if flag is not None:
        return flag
    env = {e["name"]: e for e in gateway.get("env", [])}
    if f"KVGATE_{name.upper()}" in env:  # a literal value, or where the pod takes it from
        entry = env[f"KVGATE_{name.upper()}"]
        return entry.get("value", entry.get("valueFrom"))
    config_path = cli_value(args, "--config")
    config = yaml.safe_load(mounted_file(built, deployment, config_path)) if config_path else {}
    return config.get(name)


def prestop_sleep(spec: dict[str, Any]) -> int:
    """Seconds the preStop hook sleeps (0 without one)."""
    return spec.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """An equality selector selects these labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_of(address: str) -> int:
    """The port of a HOST:PORT setting."""
    return int(address.rpartition(":")[2])


def workloads(built: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Deployments of a build."""
    return of_kind(built, "Deployment")


# ---- schemas --------------------------------------------------------------------------------------------

@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """openAPIV3Schema of every CRD version in shared/schemas, keyed by (apiVersion, kind)."""
    if not SCHEMAS.is_dir():
        pytest.skip(f"Gateway API CRDs not found at {SCHEMAS} (the shared/ folder beside the repository)")
    found = {}
    for path in SCHEMAS.glob("*.yaml"):
        for crd in load_documents(path.read_text()):
            for version in crd["spec"]["versions"]:
                api_version = f"{crd['spec']['group']}/{version['name']}"
                found[(api_version, crd["spec"]["names"]["kind"])] = version["schema"]["openAPIV3Schema"]
    return found


def pruned_fields(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """Fields the API server would silently drop: absent from a structural schema that lists properties."""
    open_ended = schema.get("x-kubernetes-preserve-unknown-fields", False)
    if isinstance(value, dict) and "properties" in schema and not open_ended:
        props = schema["properties"]
        return [f"{where}.{k}" for k in value if k not in props] + [
            p for k, v in value.items() if k in props for p in pruned_fields(v, props[k], f"{where}.{k}")]
    if isinstance(value, list) and "items" in schema:
        return [p for i, v in enumerate(value) for p in pruned_fields(v, schema["items"], f"{where}[{i}]")]
    return []


# ---- tests: the build itself ----------------------------------------------------------------------------

def test_every_manifest_under_deploy_is_part_of_a_kustomization() -> None:
    listed = {(DEPLOY / d / "kustomization.yaml").resolve() for d in KUSTOMIZATIONS}
    for directory in KUSTOMIZATIONS:
        (kustomization,) = load_documents((DEPLOY / directory / "kustomization.yaml").read_text())
        listed |= {(DEPLOY / directory / e).resolve() for e in kustomization.get("resources", [])}
        listed |= {(DEPLOY / directory / f).resolve() for g in kustomization.get("configMapGenerator", [])
                   for f in g["files"]}
    on_disk = {p.resolve() for p in DEPLOY.rglob("*.yaml")}
    assert on_disk - listed == set()
    assert len(KUSTOMIZATIONS) >= 4


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_kustomization_builds_into_valid_kubernetes_objects(directory: str) -> None:
    built = objects(directory)
    assert built
    for obj in built:
        if not obj["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_custom_resources_match_their_crd_schema(directory: str) -> None:
    schemas = crd_schemas()
    custom = [obj for obj in objects(directory) if obj["apiVersion"].startswith(CRD_GROUPS)]
    for obj in custom:
        schema = schemas[(obj["apiVersion"], obj["kind"])]
        jsonschema.Draft202012Validator(schema).validate(obj)
        assert pruned_fields(obj["spec"], schema["properties"]["spec"], "spec") == []
    assert bool(custom) == (directory != "base/vllm")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_python_build_matches_kubectl_kustomize(directory: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH")
    output = subprocess.run([kubectl, "kustomize", str(DEPLOY / directory)], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    # kustomize appends a content hash to generated ConfigMap names; this subset keeps the plain name.
    generated = {obj["metadata"]["name"] for obj in of_kind(objects(directory), "ConfigMap")}
    for name in generated:
        output = re.sub(rf"\b{re.escape(name)}-[a-z0-9]{{10}}\b", name, output)
    key = lambda obj: (obj["kind"], obj["metadata"]["name"])  # noqa: E731
    assert sorted(load_documents(output), key=key) == sorted(objects(directory), key=key)


# ---- tests: cross references, on what is actually applied ----------------------------------------------

@pytest.fixture(params=OVERLAYS)
def built(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """The objects of one deployable overlay."""
    return objects(request.param)


def test_selectors_select_their_pods(built: list[dict[str, Any]]) -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in workloads(built)}
    for deployment in workloads(built):
        assert matches(deployment["spec"]["selector"]["matchLabels"], pods[deployment["metadata"]["name"]])
    selectors = [s["spec"]["selector"] for s in of_kind(built, "Service")]
    selectors += [p["spec"]["selector"]["matchLabels"] for p in of_kind(built, "PodDisruptionBudget")]
    selectors += [n["spec"]["podSelector"]["matchLabels"] for n in of_kind(built, "NetworkPolicy")]
    selectors += [p["spec"]["selector"]["matchLabels"] for p in of_kind(built, "InferencePool")]
    for selector in selectors:
        assert [name for name, labels in pods.items() if matches(selector, labels)], selector
    assert len(selectors) == 6 + 2 * len(of_kind(built, "InferencePool"))  # a pool and its picker Service


def test_workload_labels_follow_one_scheme(built: list[dict[str, Any]]) -> None:
    for obj in built:
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] != "ConfigMap":
            assert labels.get("app.kubernetes.io/part-of") == "kvgate", obj["metadata"]["name"]
            assert {"app.kubernetes.io/name", "app.kubernetes.io/component"} <= labels.keys()


def test_probes_use_declared_ports_and_served_paths(built: list[dict[str, Any]]) -> None:
    for deployment in workloads(built):
        for spec in pod_spec(deployment)["containers"]:
            ports = {p["name"] for p in spec["ports"]} | {p["containerPort"] for p in spec["ports"]}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert spec[kind]["httpGet"]["port"] in ports, (spec["name"], kind)
    gateway = container(find_obj(built, "Deployment", GATEWAY), GATEWAY)
    probe_paths = {k: gateway[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probe_paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert set(probe_paths.values()) <= KVGATE_PUBLIC_PATHS
    assert {gateway[k]["httpGet"]["port"] for k in probe_paths} == {"http"}  # the port `listen` serves


def test_gateway_ports_match_its_listen_settings(built: list[dict[str, Any]]) -> None:
    deployment = find_obj(built, "Deployment", GATEWAY)
    ports = {p["name"]: p["containerPort"] for p in container(deployment, GATEWAY)["ports"]}
    assert ports["http"] == port_of(kvgate_setting(built, "listen"))
    assert ports["admin"] == port_of(kvgate_setting(built, "admin_listen"))
    assert ports["peers"] == port_of(kvgate_setting(built, "peer_listen"))
    peers = find_obj(built, "Service", kvgate_setting(built, "peer_service"))  # each replica's peers: all the pods
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert [(p["name"], p["targetPort"]) for p in peers["spec"]["ports"]] == [("peers", "peers")]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["admin"]
    assert annotations["prometheus.io/path"] in KVGATE_ADMIN_PATHS


def test_gateway_config_file_is_accepted_by_kvgate(built: list[dict[str, Any]], tmp_path: Path) -> None:
    deployment = find_obj(built, "Deployment", GATEWAY)
    path = tmp_path / "config.yaml"
    path.write_text(mounted_file(built, deployment, cli_value(container(deployment, GATEWAY)["args"], "--config")))
    config = from_sources({"config": str(path)}, {"KVGATE_NAMESPACE": deployment["metadata"]["namespace"]})
    assert (config.discovery, config.service) == ("kubernetes", ("vllm",))
    assert config.namespace == deployment["metadata"]["namespace"]
    vllm = container(find_obj(built, "Deployment", "vllm"), "vllm")
    assert config.saturation.seats == int(cli_value(vllm["args"], "--max-num-seqs"))  # the seats kvgate assumes
    # vLLM refuses a `priority` unless it schedules by priority.
    assert config.upstream_priority == (cli_value(vllm["args"], "--scheduling-policy") == "priority")


def test_grace_period_outlasts_prestop_and_drain(built: list[dict[str, Any]]) -> None:
    gateway = find_obj(built, "Deployment", GATEWAY)
    drain = float(kvgate_setting(built, "drain_delay")) + float(kvgate_setting(built, "drain_timeout"))
    sleep = prestop_sleep(container(gateway, GATEWAY))
    assert sleep > 0
    assert pod_spec(gateway)["terminationGracePeriodSeconds"] > sleep + drain
    vllm = find_obj(built, "Deployment", "vllm")
    server = container(vllm, "vllm")
    shutdown = float(cli_value(server["args"], "--shutdown-timeout"))
    assert shutdown > 0 and "--enable-prefix-caching" in server["args"]
    assert pod_spec(vllm)["terminationGracePeriodSeconds"] > prestop_sleep(server) + shutdown


def test_role_grants_only_the_reads_its_discovery_needs_to_the_gateway(built: list[dict[str, Any]]) -> None:
    (role,) = of_kind(built, "Role")
    reads = POOL_READS + SLICE_READS if kvgate_setting(built, "discovery") == "inferencepool" else SLICE_READS
    assert role["rules"] == reads  # the replicas' and the peers' (kvgate-peers) slices
    assert not of_kind(built, "ClusterRole") and not of_kind(built, "ClusterRoleBinding")
    (binding,) = of_kind(built, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    (account,) = of_kind(built, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert pod_spec(find_obj(built, "Deployment", GATEWAY))["serviceAccountName"] == account["metadata"]["name"]
    assert pod_spec(find_obj(built, "Deployment", "vllm"))["automountServiceAccountToken"] is False


def test_httproute_sends_to_the_gateway_service_or_the_pool_without_timeouts(built: list[dict[str, Any]]) -> None:
    (route,) = of_kind(built, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    pools = of_kind(built, "InferencePool")
    if pools:
        assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                        "name": pools[0]["metadata"]["name"]}]
    else:
        service = find_obj(built, "Service", GATEWAY)
        assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [
            (service["metadata"]["name"], service["spec"]["ports"][0]["port"])]
        target = service["spec"]["ports"][0]["targetPort"]
        assert target in {p["name"] for p in container(find_obj(built, "Deployment", GATEWAY), GATEWAY)["ports"]}
    assert rule["timeouts"] == {"request": "0s", "backendRequest": "0s"}


def test_inference_pool_is_picked_by_kvgate_and_offers_the_vllm_port(tmp_path: Path) -> None:
    built = objects("overlays/picker")
    (pool,) = of_kind(built, "InferencePool")
    deployment = find_obj(built, "Deployment", GATEWAY)
    args = container(deployment, GATEWAY)["args"]
    config_file = tmp_path / "config.yaml"
    config_file.write_text(mounted_file(built, deployment, cli_value(args, "--config")))
    settings = cli_settings(build_parser().parse_args([*args[:2], str(config_file), *args[3:]]))
    config = from_sources(settings, {"KVGATE_NAMESPACE": "kvgate"})  # what kvgate serve makes of the pod's args
    assert (config.discovery, config.pool, config.picker_address) == ("inferencepool", "vllm", ("0.0.0.0", 9002))
    assert kvgate_setting(built, "discovery") == "inferencepool"
    assert kvgate_setting(built, "pool") == pool["metadata"]["name"]
    vllm = find_obj(built, "Deployment", "vllm")
    assert matches(pool["spec"]["selector"]["matchLabels"], vllm["spec"]["template"]["metadata"]["labels"])
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        p["containerPort"] for p in container(vllm, "vllm")["ports"] if p["name"] == "http"]
    picker_ref = pool["spec"]["endpointPickerRef"]
    service = find_obj(built, "Service", picker_ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"]]
    gateway = container(find_obj(built, "Deployment", GATEWAY), GATEWAY)
    container_ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert container_ports[port["targetPort"]] == port_of(kvgate_setting(built, "picker_listen"))
    assert port["appProtocol"] == "kubernetes.io/h2c" and picker_ref["failureMode"] == "FailClose"
    objectives = of_kind(built, "InferenceObjective")
    assert objectives and {o["spec"]["poolRef"]["name"] for o in objectives} == {pool["metadata"]["name"]}
    (policy,) = of_kind(built, "NetworkPolicy")
    assert {"port": "picker", "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]


def test_gateway_discovers_the_vllm_service_or_pool_of_its_namespace(built: list[dict[str, Any]]) -> None:
    assert kvgate_setting(built, "namespace") == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    if kvgate_setting(built, "discovery") == "inferencepool":
        return  # the pool: test_inference_pool_is_picked_by_kvgate_and_offers_the_vllm_port
    assert kvgate_setting(built, "discovery") == "kubernetes"
    service = find_obj(built, "Service", kvgate_setting(built, "service"))
    assert kvgate_setting(built, "port_name") in {p["name"] for p in service["spec"]["ports"]}
    assert service["metadata"]["namespace"] == find_obj(built, "Deployment", GATEWAY)["metadata"]["namespace"]
    server_ports = {p["name"] for p in container(find_obj(built, "Deployment", "vllm"), "vllm")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= server_ports


def test_resources_pin_memory_and_gpus_but_not_gateway_cpu(built: list[dict[str, Any]]) -> None:
    gateway = container(find_obj(built, "Deployment", GATEWAY), GATEWAY)["resources"]
    assert "cpu" in gateway["requests"] and "cpu" not in gateway["limits"]
    assert gateway["requests"]["memory"] == gateway["limits"]["memory"]
    server = container(find_obj(built, "Deployment", "vllm"), "vllm")["resources"]
    assert server["requests"]["nvidia.com/gpu"] == server["limits"]["nvidia.com/gpu"] == "1"
    assert server["requests"]["memory"] == server["limits"]["memory"]


def test_gateway_runs_locked_down_and_spread(built: list[dict[str, Any]]) -> None:
    spec = pod_spec(find_obj(built, "Deployment", GATEWAY))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    context = container(find_obj(built, "Deployment", GATEWAY), GATEWAY)["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}
    keys = {c["topologyKey"] for c in spec["topologySpreadConstraints"]}
    assert keys == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}


def test_vllm_pods_land_on_gpus_with_room_for_a_slow_load() -> None:
    deployment = find_obj(objects("overlays/production"), "Deployment", "vllm")
    server, spec = container(deployment, "vllm"), pod_spec(deployment)
    assert "nvidia.com/gpu.product" in spec["nodeSelector"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    probes = (startup, server["readinessProbe"], server["livenessProbe"])
    assert {p["httpGet"]["path"] for p in probes} == {"/health"}
    assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+", server["image"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = [m for m in server["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert any(env["HF_HOME"].startswith(m["mountPath"]) for m in server["volumeMounts"])


def test_overlays_differ_where_they_should() -> None:
    dev, production = objects("overlays/dev"), objects("overlays/production")
    assert find_obj(dev, "Deployment", GATEWAY)["spec"]["replicas"] == 1
    assert find_obj(production, "Deployment", GATEWAY)["spec"]["replicas"] == 3
    assert kvgate_setting(dev, "api_keys_file") is None
    keys_file = kvgate_setting(production, "api_keys_file")
    deployment = find_obj(production, "Deployment", GATEWAY)
    mounts = {m["name"]: m["mountPath"] for m in container(deployment, GATEWAY)["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod_spec(deployment)["volumes"] if "secret" in v}
    holding_keys = [secrets[name] for name, path in mounts.items() if keys_file.startswith(path + "/")]
    assert holding_keys == ["kvgate-api-keys"]
    models = [cli_value(container(find_obj(b, "Deployment", "vllm"), "vllm")["args"], "--model")
              for b in (dev, production)]
    assert models == ["Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen3-8B"]


def test_vllm_publishes_kv_events_that_the_gateway_subscribes_to(built: list[dict[str, Any]]) -> None:
    server = container(find_obj(built, "Deployment", "vllm"), "vllm")
    events = json.loads(cli_value(server["args"], "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    # The pods bind (`*`) and every gateway replica connects to each pod's address from discovery.
    for vllm_key, setting, port_name in (("endpoint", "kv_events_endpoint", "kv-events"),
                                         ("replay_endpoint", "kv_events_replay_endpoint", "kv-replay")):
        assert events[vllm_key] == f"tcp://*:{ports[port_name]}"
        assert kvgate_setting(built, setting) == f"tcp://{{host}}:{ports[port_name]}"
    assert kvgate_setting(built, "kv_events_topic") == events["topic"]
    # Portable hashes, equal on every pod: sha256_cbor with a fixed seed.
    assert cli_value(server["args"], "--prefix-caching-hash-algo") == "sha256_cbor"
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env["PYTHONHASHSEED"] is not None and env["PYTHONHASHSEED"].isdigit()


def test_gateway_mounts_the_tokenizer_of_the_model_vllm_serves(built: list[dict[str, Any]]) -> None:
    served = cli_value(container(find_obj(built, "Deployment", "vllm"), "vllm")["args"], "--model")
    setting = kvgate_setting(built, "tokenizer")
    (item,) = setting.split(",") if isinstance(setting, str) else setting
    model, _, directory = item.partition("=")
    assert model == served
    deployment = find_obj(built, "Deployment", GATEWAY)
    gateway_mounts = {m["name"]: m for m in container(deployment, GATEWAY)["volumeMounts"]}
    (fetcher,) = pod_spec(deployment)["initContainers"]
    (volume,) = [name for name, m in gateway_mounts.items() if directory.startswith(m["mountPath"] + "/")]
    assert gateway_mounts[volume]["readOnly"] is True
    assert volume in {m["name"] for m in fetcher["volumeMounts"]}
    script = "\n".join(fetcher["args"])
    assert f'"{served}"' in script and f'local_dir="{directory}"' in script and "tokenizer_config.json" in script
