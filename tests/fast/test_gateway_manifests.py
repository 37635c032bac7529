"""docker/k8s/gateway/: the manifests that put the Deployment behind the Kubernetes inference gateway.

- InferencePool, InferenceObjective, Gateway and HTTPRoute are checked against our own JSON schemas of the fields
  our manifests use (below): types, required fields, enums, ranges, name and label syntax, and the rule that a
  Service endpointPickerRef needs a port. They are strict: an unknown or misspelt field fails, as
  `kubectl apply --validate=strict` would.
- The picker's Deployment, Service, RBAC and ConfigMap validate against Kubernetes' schemas (kubernetes-validate).
- The API versions and the picker image we target are pinned: changing one in a manifest without changing the
  constants here (and rereading the schemas below against that release) fails.
- The objects point at each other and at ../deployment.yaml, and the picker's metric flags name metrics that
  the server really exports.

Why not validate against the real CRDs: no package registry ships the Gateway API Inference Extension's or the
Gateway API's CRDs (checked: PyPI, npm, Debian), and the only copy reachable from here is reference material we may
not commit. So the schemas below restate the published v1.0.0 (inference extension) and v1 (Gateway API) fields we
rely on. To check against the real CRDs, run `kubectl apply --dry-run=server -f docker/k8s/gateway/` on a cluster
that has them installed.
Offline, no cluster, a second or two.
"""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from app.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
GATEWAY_DIR = REPO / "docker" / "k8s" / "gateway"

# What we target. Moving to another release means changing these AND rereading the schemas below against it.
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"  # Gateway API Inference Extension v1.0.0
INFERENCE_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"  # same release
GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.0"
PINNED_API = {"InferencePool": INFERENCE_POOL_API, "InferenceObjective": INFERENCE_OBJECTIVE_API,
              "Gateway": GATEWAY_API_VERSION, "HTTPRoute": GATEWAY_API_VERSION}


def load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(GATEWAY_DIR.glob("*.yaml")) for doc in load(path)]


def one(kind: str) -> dict:
    found = [doc for _, doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in {GATEWAY_DIR}, found {len(found)}"
    return found[0]


# ---- our schemas of the fields we use ------------------------------------------------------------
# Building blocks: Kubernetes object names, API groups and kinds as references spell them, durations.
NAME = {"type": "string", "minLength": 1, "maxLength": 253}
SECTION = {"type": "string", "minLength": 1, "maxLength": 253,
           "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
GROUP = {"type": "string", "maxLength": 253,
         "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"}
KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"}
DURATION = {"type": "string", "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"}
PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}
# Kubernetes label syntax: a key is an optional DNS-subdomain prefix and "/" and a name of up to 63 characters;
# a value is up to 63 characters, empty or alphanumeric at both ends with - _ . inside.
LABEL_KEY = {"type": "string", "maxLength": 316,
             "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"}
LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
LABELS = {"type": "object", "propertyNames": LABEL_KEY, "additionalProperties": LABEL_VALUE}


def obj(required: list[str], **properties) -> dict:
    """An object with exactly these fields (unknown ones fail, as with --validate=strict)."""
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


def top(api_version: str, kind: str, spec: dict) -> dict:
    return obj(["apiVersion", "kind", "metadata", "spec"], apiVersion={"const": api_version}, kind={"const": kind},
               metadata=METADATA, spec=spec)


METADATA = obj(["name"], name={"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
               labels=LABELS)

# The endpoint picker reference: kind defaults to Service, and a Service must be given a port (the Service's
# port, not the pods'). failureMode says what the gateway does when the picker does not answer.
PICKER_REF = obj(["name"], group=GROUP, kind=KIND, name=NAME, port=obj(["number"], number=PORT_NUMBER),
                 failureMode={"enum": ["FailOpen", "FailClose"]})
PICKER_REF |= {"if": {"anyOf": [{"not": {"required": ["kind"]}},
                                {"required": ["kind"], "properties": {"kind": {"const": "Service"}}}]},
               "then": {"required": ["port"]}}

SCHEMAS = {
    # The Gateway API Inference Extension v1.0.0: a pool is its members (pods matching every label, no
    # expressions), the one port they serve on, and its picker.
    "InferencePool": top(INFERENCE_POOL_API, "InferencePool", obj(
        ["selector", "targetPorts", "endpointPickerRef"],
        selector=obj(["matchLabels"], matchLabels=LABELS),
        targetPorts={"type": "array", "minItems": 1, "maxItems": 1, "items": obj(["number"], number=PORT_NUMBER)},
        endpointPickerRef=PICKER_REF)),
    # An objective names its pool (an InferencePool unless said otherwise) and an integer priority (may be
    # negative; unset counts as 0).
    "InferenceObjective": top(INFERENCE_OBJECTIVE_API, "InferenceObjective", obj(
        ["poolRef"], poolRef=obj(["name"], group=GROUP, kind=KIND, name=NAME), priority={"type": "integer"})),
    # The Gateway API v1 standard channel: names, lengths, patterns, enums and list sizes of the fields we use.
    "Gateway": top(GATEWAY_API_VERSION, "Gateway", obj(
        ["gatewayClassName", "listeners"], gatewayClassName=NAME,
        listeners={"type": "array", "minItems": 1, "maxItems": 64, "items": obj(
            ["name", "port", "protocol"], name=SECTION, port=PORT_NUMBER,
            protocol={"type": "string", "minLength": 1, "maxLength": 255,
                      "pattern": r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|[a-z0-9]([-a-z0-9]*[a-z0-9])?"
                                 r"(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9]+$"})})),
    "HTTPRoute": top(GATEWAY_API_VERSION, "HTTPRoute", obj(
        ["parentRefs", "rules"],
        parentRefs={"type": "array", "maxItems": 32, "items": obj(["name"], name=NAME, group=GROUP, kind=KIND)},
        rules={"type": "array", "minItems": 1, "maxItems": 16, "items": obj(
            [], matches={"type": "array", "maxItems": 64, "items": obj(
                [], path=obj([], type={"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                             value={"type": "string", "maxLength": 1024, "pattern": "^/"}))},
            backendRefs={"type": "array", "maxItems": 16, "items": obj(
                ["name"], group=GROUP, kind=KIND, name=NAME, port=PORT_NUMBER,
                weight={"type": "integer", "minimum": 0, "maximum": 1000000})},
            timeouts=obj([], request=DURATION, backendRequest=DURATION))})),
}


def schema_errors(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(SCHEMAS[doc["kind"]]).iter_errors(doc)]


def test_our_schemas_are_valid_json_schema():
    for kind, schema in SCHEMAS.items():
        jsonschema.Draft7Validator.check_schema(schema)


# ---- the versions we target -------------------------------------------------------------------


def test_the_api_versions_and_picker_image_are_the_pinned_ones():
    """A manifest moved to another release must move the constants (and the schemas) with it."""
    versions = {doc["kind"]: doc["apiVersion"] for _, doc in manifests() if doc["kind"] in PINNED_API}
    assert versions == PINNED_API, ("a manifest's apiVersion changed: update PINNED_API and reread the schemas "
                                    "in this file against that release")
    images = [c["image"] for c in one("Deployment")["spec"]["template"]["spec"]["containers"]]
    assert images == [EPP_IMAGE], "the picker image changed: update EPP_IMAGE, and check epp.yaml's plugin names"


# ---- the manifests ----------------------------------------------------------------------------


def test_gateway_manifests_validate():
    docs = manifests()
    assert sorted(d["kind"] for _, d in docs) == sorted(
        ["InferencePool", "InferenceObjective", "Gateway", "HTTPRoute",
         "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"])
    for name, doc in docs:
        if doc["kind"] in SCHEMAS:
            errors = schema_errors(doc)
        else:
            errors = []
            for version in ("1.29.0", kv.latest_version()):
                try:
                    kv.validate(doc, version, strict=True)
                except kv.ValidationError as exc:
                    errors.append(f"Kubernetes {version}: {'.'.join(map(str, exc.path))}: {exc.message}")
        assert not errors, f"{name} ({doc['kind']}): {errors}"


@pytest.mark.parametrize("break_it, expected", [
    (lambda p: p["spec"].update(targetPorts=[]), "should be non-empty"),
    (lambda p: p["spec"].update(endpointPickerRefs=p["spec"].pop("endpointPickerRef")), "endpointPickerRef"),
    (lambda p: p["spec"]["endpointPickerRef"].pop("port"), "spec.endpointPickerRef: 'port' is a required"),
    (lambda p: p["spec"]["endpointPickerRef"].update(kind="Service", port={}), "'number' is a required"),
    (lambda p: p["spec"]["targetPorts"][0].update(number=70000), "is greater than the maximum"),
    (lambda p: p["spec"]["selector"].update(matchExpressions=[]), "'matchExpressions' was unexpected"),
    (lambda p: p.update(apiVersion="inference.networking.x-k8s.io/v1alpha2"), "was expected"),
    (lambda p: p["spec"]["endpointPickerRef"].update(failureMode="FailSometimes"), "is not one of"),
    (lambda p: p["spec"]["selector"]["matchLabels"].update(app="-bad-"), "does not match"),
])
def test_the_schema_rejects_a_broken_pool(break_it, expected):
    """Guards against a validator that passes everything."""
    pool = copy.deepcopy(one("InferencePool"))
    break_it(pool)
    errors = schema_errors(pool)
    assert any(expected in e for e in errors), errors


def test_only_a_service_picker_needs_a_port():
    pool = copy.deepcopy(one("InferencePool"))
    ref = pool["spec"]["endpointPickerRef"]
    ref.pop("port")
    ref.update(group="example.com", kind="PickerGateway")
    assert schema_errors(pool) == []


def test_the_checks_reject_a_broken_objective_and_route():
    objective = copy.deepcopy(one("InferenceObjective"))
    objective["spec"]["priority"] = "high"
    assert any("is not of type 'integer'" in e for e in schema_errors(objective))
    objective["spec"]["poolRefs"] = objective["spec"].pop("poolRef")
    assert any("'poolRefs' was unexpected" in e for e in schema_errors(objective))
    route = copy.deepcopy(one("HTTPRoute"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "10 minutes"
    assert any("does not match" in e for e in schema_errors(route))


def epp_args() -> dict[str, str]:
    container = one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    return dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])


def test_the_objects_point_at_each_other_and_at_the_deployment():
    pool, epp_service = one("InferencePool"), one("Service")
    deployment = load(REPO / "docker" / "k8s" / "deployment.yaml")[0]
    pod = deployment["spec"]["template"]
    # the pool's members are the Deployment's pods, on the server's port
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pool["spec"]["targetPorts"][0]["number"] == pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    # the pool's picker is the EPP Service, which selects the EPP pods and forwards to their gRPC port
    ref = pool["spec"]["endpointPickerRef"]
    service_port = epp_service["spec"]["ports"][0]["port"]
    assert (ref["name"], ref["port"]["number"]) == (epp_service["metadata"]["name"], service_port)
    epp = one("Deployment")
    assert epp_service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert epp_args()["pool-name"] == pool["metadata"]["name"]
    assert epp_args()["grpc-port"] == str(epp_service["spec"]["ports"][0]["port"])
    # its config file is the ConfigMap's key, and it runs as the account its Role is bound to
    config = one("ConfigMap")
    mount = epp["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["mountPath"]
    assert epp_args()["config-file"].removeprefix(mount + "/") in config["data"]
    assert one("RoleBinding")["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert one("RoleBinding")["roleRef"]["name"] == one("Role")["metadata"]["name"]
    # the route sends the API to the pool, through the Gateway; the objective is about the same pool
    route = one("HTTPRoute")
    assert route["spec"]["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
    assert one("InferenceObjective")["spec"]["poolRef"]["name"] == pool["metadata"]["name"]


def test_the_pickers_plugins_are_all_scheduled():
    config = yaml.safe_load(one("ConfigMap")["data"]["plugins.yaml"])
    defined = {plugin["type"] for plugin in config["plugins"]}
    scheduled = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert scheduled <= defined and defined - scheduled == {"single-profile-handler"}


def test_the_pickers_metric_flags_name_metrics_the_server_exports():
    exported = {family.name for family in Metrics().registry.collect()}
    flags = {k: v for k, v in epp_args().items() if k.endswith("-metric")}
    assert set(flags) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric", "cache-info-metric", "lora-info-metric"}
    named = {flag: metric for flag, metric in flags.items() if metric}
    assert flags["lora-info-metric"] == "", "no LoRA adapters: the LoRA signal is switched off"
    assert set(named.values()) <= exported, set(named.values()) - exported
    # and a picker left on its defaults finds vLLM's names
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:cache_config_info"} <= exported
