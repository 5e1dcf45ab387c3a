"""The local control plane's pure cores: selectors, OpenAPI (and its protobuf), structural
schema handling with CEL, Table output and the patch types.

Each is what a real client reads from a real API server; the e2e suite
(e2e/tests/test_cluster.py) drives them with the real kubectl and Helm. Here their edges are
checked directly and fast, against the generated CRDs.
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

import pytest
import yaml
from op_builders import EXAMPLES

from kvpool.operator import gen
from kvpool.operator.cluster import (
    openapi,
    patches,
    protobuf,
    rbac,
    selectors,
    structural,
    tables,
)

CRDS = {
    kind: gen.crd(kind, plural, short, spec, status)
    for kind, plural, short, spec, status in gen.KINDS
}
NOW = datetime.datetime(2025, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


def _schema(kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = CRDS[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _example(kind: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "cpu-demo.yaml").read_text()) if d]
    found: dict[str, Any] = next(d for d in docs if d["kind"] == kind)
    return found


# -- selectors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("a=b", {"a": "b"}, True),
        ("a==b,c", {"a": "b", "c": "x"}, True),
        ("a!=b", {"a": "b"}, False),
        ("!a", {}, True),
        ("a in (x, y)", {"a": "y"}, True),
        ("a notin (x,y),b", {"a": "z", "b": ""}, True),
        ("a in (x,y)", {}, False),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selectors.label_matcher(selector)(labels) is matches


def test_field_selectors_and_refusals() -> None:
    pod = {"metadata": {"name": "p", "namespace": "n"}, "status": {"phase": "Running"}}
    assert selectors.field_matcher("metadata.name=p,status.phase!=Pending", "Pod")(pod)
    assert not selectors.field_matcher("metadata.name==q", "Pod")(pod)
    with pytest.raises(selectors.SelectorError, match="not supported"):
        selectors.field_matcher("status.phase=Running", "ConfigMap")
    obj = {"matchLabels": {"a": "b"}, "matchExpressions": [{"key": "c", "operator": "Exists"}]}
    assert selectors.selector_matcher(obj)({"a": "b", "c": "1"})
    assert selectors.selector_string(obj) == "a=b,c"


# -- OpenAPI -----------------------------------------------------------------------------------
def test_crd_definition_is_published_with_gvk_metadata_and_a_v2_form() -> None:
    ((name, schema),) = openapi.crd_definitions(CRDS["P2PGroup"]).values()
    assert name == "io.kvpool.v1alpha1.P2PGroup"
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "kvpool.io", "version": "v1alpha1", "kind": "P2PGroup"}
    ]
    assert schema["properties"]["metadata"]["$ref"].endswith(openapi.OBJECT_META)
    v2 = openapi.to_v2(schema)
    text = str(v2)
    assert "nullable" not in text and "anyOf" not in text and "x-kubernetes-validations" not in text
    overrides = v2["properties"]["spec"]["properties"]["engine"]["properties"]["lmcacheOverrides"]
    assert "type" not in overrides  # preserve-unknown-fields: any value passes kubectl's check


def test_builtin_definitions_become_openapi() -> None:
    defs = openapi.builtin_definitions(
        {
            "io.k8s.apimachinery.pkg.util.intstr.IntOrString": {
                "oneOf": [{"type": ["string", "null"]}, {"type": ["integer", "null"]}]
            },
            "x.Pod": {
                "type": ["object", "null"],
                "properties": {
                    "port": {"$ref": "#/$defs/io.k8s.apimachinery.pkg.util.intstr.IntOrString"}
                },
            },
        }
    )
    assert defs["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] == {
        "type": "string",
        "format": "int-or-string",
    }
    assert defs["x.Pod"]["type"] == "object"
    assert defs["x.Pod"]["properties"]["port"]["$ref"].startswith(openapi.V2_REF)


def test_v3_document_has_a_patch_path_without_field_validation_and_the_closure() -> None:
    ((name, schema),) = openapi.crd_definitions(CRDS["KVCachePool"]).values()
    meta = {"type": "object", "properties": {"name": {"type": "string"}}}
    defs = {name: schema, openapi.OBJECT_META: meta, "unused": {"type": "string"}}
    served = openapi.Served("kvpool.io", "v1alpha1", "kvcachepools", "KVCachePool", True, name)
    doc = openapi.v3_document(defs, [served])
    path = "/apis/kvpool.io/v1alpha1/namespaces/{namespace}/kvcachepools/{name}"
    patch = doc["paths"][path]["patch"]
    assert patch["x-kubernetes-group-version-kind"]["kind"] == "KVCachePool"
    assert "fieldValidation" not in {p["name"] for p in patch["parameters"]}
    assert set(doc["components"]["schemas"]) == {name, openapi.OBJECT_META}
    assert "#/components/schemas/" in str(doc["components"]["schemas"][name])
    index = openapi.v3_index({"apis/kvpool.io/v1alpha1": "ABC"})
    assert index["paths"]["apis/kvpool.io/v1alpha1"]["serverRelativeURL"].endswith("hash=ABC")


def _decode_schema(data: bytes) -> dict[int, list[Any]]:
    out: dict[int, list[Any]] = {}
    for field, value in protobuf._fields(data):
        out.setdefault(field, []).append(value)
    return out


def test_v2_protobuf_carries_definitions_types_properties_and_extensions() -> None:
    doc = {
        "swagger": "2.0",
        "info": {"title": "K", "version": "v"},
        "definitions": {
            "a.B": {
                "type": "object",
                "required": ["x"],
                "properties": {
                    "x": {"type": "integer", "minimum": 1},
                    "y": {"$ref": "#/definitions/a.C"},
                },
                "x-kubernetes-group-version-kind": [{"group": "a", "version": "v1", "kind": "B"}],
            },
        },
    }
    top = _decode_schema(protobuf.document(doc))
    assert top[1] == [b"2.0"]
    (named,) = _decode_schema(top[9][0])[1]
    entry = _decode_schema(named)
    assert entry[1] == [b"a.B"]
    schema = _decode_schema(entry[2][0])
    assert _decode_schema(schema[22][0])[1] == [b"object"]
    assert schema[19] == [b"x"]
    props = [_decode_schema(p) for p in _decode_schema(schema[25][0])[1]]
    assert [p[1][0] for p in props] == [b"x", b"y"]
    assert _decode_schema(props[1][2][0])[1] == [b"#/definitions/a.C"]
    ext = _decode_schema(schema[31][0])
    assert ext[1] == [b"x-kubernetes-group-version-kind"]
    assert b'"kind": "B"' in _decode_schema(ext[2][0])[2][0]


def _k8s_secret() -> bytes:
    def field(n: int, data: bytes) -> bytes:
        return protobuf._bytes(n, data)

    entry = field(1, b"release") + field(2, b"\x00\x01binary")
    label = field(1, b"owner") + field(2, b"helm")
    meta = field(1, b"sh.helm.release.v1.x.v1") + field(11, label)
    secret = field(1, meta) + field(2, entry) + field(3, b"helm.sh/release.v1")
    envelope = field(1, field(1, b"v1") + field(2, b"Secret")) + field(2, secret)
    return protobuf.K8S_MAGIC + envelope


def test_kubernetes_protobuf_secret_decodes_to_its_json() -> None:
    obj = protobuf.decode_k8s(_k8s_secret())
    assert obj["kind"] == "Secret" and obj["type"] == "helm.sh/release.v1"
    assert obj["metadata"] == {"name": "sh.helm.release.v1.x.v1", "labels": {"owner": "helm"}}
    assert base64.b64decode(obj["data"]["release"]) == b"\x00\x01binary"
    with pytest.raises(ValueError, match="prefix"):
        protobuf.decode_k8s(b"{}")


# -- structural schemas ------------------------------------------------------------------------
def test_examples_are_admitted_pruned_and_defaulted() -> None:
    p2p = _example("P2PGroup")
    out, errors = structural.admit({**p2p, "spec": {**p2p["spec"], "typo": 1}}, _schema("P2PGroup"))
    assert errors == []
    assert "typo" not in out["spec"]
    assert out["spec"]["p2p"] is True  # the schema's default
    assert out["metadata"] == p2p["metadata"]


def test_schema_and_cel_errors_name_the_field_like_the_api_server() -> None:
    p2p = _example("P2PGroup")
    bad = {**p2p, "spec": {**p2p["spec"], "replicas": 100}}
    _out, errors = structural.admit(bad, _schema("P2PGroup"))
    assert errors == ["spec.replicas: Invalid value: 100: 100 is greater than the maximum of 64"]
    bad = {**p2p, "spec": {**p2p["spec"], "replicas": "two"}}
    _out, errors = structural.admit(bad, _schema("P2PGroup"))
    assert errors[0].startswith(
        'spec.replicas: Invalid value: "two": spec.replicas in body must be of type integer'
    )
    transfer = {"delayPull": True, "pullMode": False}
    bad = {**p2p, "spec": {**p2p["spec"], "transfer": transfer}}
    _out, errors = structural.admit(bad, _schema("P2PGroup"))
    assert errors == ['spec.transfer: Invalid value: "object": delayPull needs pullMode and useNPU']
    message = structural.invalid_message("P2PGroup.kvpool.io", "x", errors)
    assert message.startswith('P2PGroup.kvpool.io "x" is invalid: spec.transfer')


# -- tables ------------------------------------------------------------------------------------
def test_table_from_printer_columns() -> None:
    crd_version = CRDS["P2PGroup"]["spec"]["versions"][0]
    obj = {
        **_example("P2PGroup"),
        "metadata": {"name": "demo-p2p", "creationTimestamp": "2025-01-01T11:59:17Z"},
        "status": {
            "instancesDesired": 2,
            "tensorParallel": "1",
            "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady"}],
        },
    }
    table = tables.table(tables.crd_columns(crd_version), [obj], NOW)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Pool", "Instances", "TP", "Ready", "Age", "Reason"]
    assert table["rows"][0]["cells"] == ["demo-p2p", "demo", 2, "1", "True", "43s", "AllReady"]
    assert table["columnDefinitions"][-1]["priority"] == 1
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert tables.wants_table("application/json;as=Table;v=v1;g=meta.k8s.io,application/json")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (5, "5s"),
        (119, "119s"),
        (125, "2m5s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (50 * 3600, "2d2h"),
        (-5, "<invalid>"),
    ],
)
def test_human_duration_is_kubectls(seconds: int, text: str) -> None:
    assert tables.human_duration(seconds) == text


def test_pod_columns_show_ready_status_and_restarts() -> None:
    pod = {
        "metadata": {"name": "p", "creationTimestamp": "2025-01-01T11:00:00Z"},
        "spec": {"containers": [{"name": "c"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "ready": False,
                    "restartCount": 2,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                }
            ],
        },
    }
    row = tables.table(tables.builtin_columns("Pod"), [pod], NOW)["rows"][0]["cells"]
    assert row[:5] == ["p", "0/1", "CrashLoopBackOff", 2, "60m"]


# -- patches -----------------------------------------------------------------------------------
def test_strategic_merge_merges_containers_by_name_and_honours_directives() -> None:
    spec = {
        "properties": {
            "containers": {
                "type": "array",
                "x-kubernetes-patch-strategy": "merge",
                "x-kubernetes-patch-merge-key": "name",
                "items": {"properties": {"env": {"type": "array"}}},
            }
        }
    }
    old = {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "1"}]}
    patch = {
        "containers": [{"name": "b", "image": "2"}, {"name": "a", "$patch": "delete"}],
        "$setElementOrder/containers": [{"name": "b"}],
    }
    assert patches.strategic_merge(old, patch, spec) == {
        "containers": [{"name": "b", "image": "2"}]
    }
    assert patches.strategic_merge({"a": 1, "b": 2}, {"a": None}, {}) == {"b": 2}


def test_apply_merges_list_maps_and_json_patch_test_failure_is_an_error() -> None:
    schema = {
        "properties": {
            "conditions": {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
        }
    }
    old = {"conditions": [{"type": "A", "status": "1"}, {"type": "B", "status": "1"}]}
    out = patches.apply(old, {"conditions": [{"type": "B", "status": "2"}]}, schema)
    assert out["conditions"] == [{"type": "A", "status": "1"}, {"type": "B", "status": "2"}]
    with pytest.raises(patches.PatchError, match="test"):
        patches.json_patch({"a": 1}, [{"op": "test", "path": "/a", "value": 2}])
    assert patches.merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None}}) == {"a": {"c": 2}}


# -- RBAC --------------------------------------------------------------------------------------
def _binding(
    kind: str, name: str, role: str, subject: dict[str, str], ns: str | None = None
) -> Any:
    meta = {"name": name, **({"namespace": ns} if ns else {})}
    return {
        "kind": kind,
        "metadata": meta,
        "roleRef": {"kind": role.split("/")[0], "name": role.split("/")[1]},
        "subjects": [subject],
    }


def test_rbac_grants_what_the_bindings_say_and_nothing_else() -> None:
    sa = "system:serviceaccount:kvpool-system:op"
    role = {
        "metadata": {"name": "op"},
        "rules": [
            {
                "apiGroups": ["kvpool.io"],
                "resources": ["p2pgroups", "p2pgroups/status"],
                "verbs": ["list", "patch"],
            },
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "verbs": ["get"],
                "resourceNames": ["seed"],
            },
        ],
    }
    crb = _binding(
        "ClusterRoleBinding",
        "op",
        "ClusterRole/op",
        {"kind": "ServiceAccount", "name": "op", "namespace": "kvpool-system"},
    )

    def ok(
        verb: str,
        group: str,
        resource: str,
        ns: str | None = "default",
        name: str | None = None,
        user: str = sa,
        groups: tuple[str, ...] = (),
    ) -> bool:
        req = rbac.Request(user, groups, verb, group, resource, ns, name)
        return rbac.allowed(req, [], [role], [], [crb])

    assert ok("list", "kvpool.io", "p2pgroups")
    assert ok("patch", "kvpool.io", "p2pgroups/status", name="g")
    assert not ok("delete", "kvpool.io", "p2pgroups", name="g")
    assert not ok("patch", "kvpool.io", "pdpairs/status", name="g")
    assert ok("get", "", "configmaps", name="seed") and not ok("get", "", "configmaps", name="x")
    assert not ok("list", "kvpool.io", "p2pgroups", user="system:serviceaccount:other:op")
    assert ok("delete", "", "secrets", user="admin", groups=(rbac.MASTERS,))
    rb = _binding("RoleBinding", "r", "ClusterRole/op", {"kind": "User", "name": "u"}, "team")
    req = rbac.Request("u", (), "list", "kvpool.io", "p2pgroups", "team", None)
    assert rbac.allowed(req, [], [role], [rb], [])
    assert not rbac.allowed(
        rbac.Request("u", (), "list", "kvpool.io", "p2pgroups", "x", None), [], [role], [rb], []
    )
    assert rbac.verb_of("GET", False, True) == "watch" and rbac.verb_of("DELETE", False, False) == (
        "deletecollection"
    )
    message = rbac.forbidden_message(
        rbac.Request(
            sa,
            (),
            "create",
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            None,
            None,
        )
    )
    assert message == (
        f'mutatingwebhookconfigurations is forbidden: User "{sa}" cannot create resource '
        '"mutatingwebhookconfigurations" in API group "admissionregistration.k8s.io" at the '
        "cluster scope"
    )
