"""OpenAPI v2 and v3 documents from the installed CRDs and the built-in kinds: pure.

Why: kubectl and Helm download the API server's OpenAPI before they send anything. kubectl
validates a manifest client-side against OpenAPI v2 (``kubectl apply`` fails with "failed to
download openapi" without it), checks in OpenAPI v3 whether the server validates fields itself
(it looks for a ``fieldValidation`` parameter on the kind's PATCH path: none here, so kubectl
validates on its side), computes strategic merge patches from the patch metadata, and
``kubectl explain`` walks the v3 schema of a kind. The built-in kinds' schemas come from
kubernetes-validate's bundled Kubernetes 1.32 definitions (JSON Schema with ``$defs``; turned
back into OpenAPI here), each CRD's from its ``openAPIV3Schema`` published the way the real
API server publishes it: ``metadata`` as ObjectMeta, the group-version-kind extension, and for
v2 the structural schema stripped of what v2 cannot say (nullable, anyOf, the int-or-string and
preserve-unknown-fields nodes left untyped).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]
V2_REF = "#/definitions/"
V3_REF = "#/components/schemas/"
_JSONSCHEMA_REF = "#/$defs/"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
KUBE_VERSION = "v1.32.0"


@dataclass(frozen=True)
class Served:
    """One served resource: what discovery says about it, and its definition's name."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    definition: str | None  # None: no schema known (served, not described)

    @property
    def group_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def gv_path(self) -> str:
        return f"apis/{self.group}/{self.version}" if self.group else f"api/{self.version}"


# -- the built-in definitions ------------------------------------------------------------------
def _type_of(node: Mapping[str, Any]) -> list[str]:
    t = node.get("type")
    return [t] if isinstance(t, str) else list(t or [])


def from_jsonschema(node: Any) -> Any:
    """kubernetes-validate's JSON Schema form of a definition back to OpenAPI: ``$defs`` refs
    to ``#/definitions/``, ``["string", "null"]`` to ``string``, IntOrString and Quantity's
    ``oneOf`` to the string types the real API server publishes."""
    if isinstance(node, list):
        return [from_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: Schema = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith(_JSONSCHEMA_REF):
            out[key] = V2_REF + value[len(_JSONSCHEMA_REF) :]
        elif key == "type":
            types = [t for t in _type_of(node) if t != "null"]
            if types:
                out["type"] = types[0]
        elif key == "oneOf" and all(isinstance(o, dict) for o in value):
            kinds = {t for o in value for t in _type_of(o) if t != "null"}
            out["type"] = "string"
            if kinds == {"string", "integer"}:
                out["format"] = "int-or-string"
        elif key in ("properties", "patternProperties"):
            out[key] = {k: from_jsonschema(v) for k, v in value.items()}
        else:
            out[key] = from_jsonschema(value)
    return out


def builtin_definitions(defs: Mapping[str, Any]) -> dict[str, Schema]:
    """Every definition of kubernetes-validate's ``_definitions.json`` ``$defs``, as OpenAPI."""
    return {name: from_jsonschema(schema) for name, schema in defs.items()}


def definition_for(
    definitions: Mapping[str, Schema], group: str, version: str, kind: str
) -> str | None:
    """The name of the definition whose group-version-kind extension names this kind."""
    for name, schema in definitions.items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            if (gvk.get("group", ""), gvk.get("version"), gvk.get("kind")) == (
                group,
                version,
                kind,
            ):
                return name
    return None


# -- CRDs ------------------------------------------------------------------------------------
def reversed_group(group: str) -> str:
    return ".".join(reversed(group.split(".")))


def crd_definitions(crd: Mapping[str, Any]) -> dict[str, tuple[str, Schema]]:
    """Per served version of a CRD: (definition name, OpenAPI schema of the kind)."""
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    out: dict[str, tuple[str, Schema]] = {}
    for version in spec.get("versions", []):
        if not version.get("served", True):
            continue
        schema = copy.deepcopy((version.get("schema") or {}).get("openAPIV3Schema") or {})
        schema.setdefault("type", "object")
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {
            "type": "string",
            "description": "APIVersion defines the versioned schema of this representation "
            "of an object.",
        }
        props["kind"] = {
            "type": "string",
            "description": "Kind is a string value representing the REST resource this "
            "object represents.",
        }
        props["metadata"] = {
            "$ref": V2_REF + OBJECT_META,
            "description": "Standard object's metadata.",
        }
        schema["x-kubernetes-group-version-kind"] = [
            {"group": group, "version": version["name"], "kind": kind}
        ]
        name = f"{reversed_group(group)}.{version['name']}.{kind}"
        out[version["name"]] = (name, schema)
    return out


def to_v2(node: Any) -> Any:
    """A structural (v3) schema as OpenAPI v2 can state it: what v2 lacks is dropped, and a node
    that accepts any value (int-or-string, preserve-unknown-fields) is left untyped, so that
    kubectl's client-side validation accepts what the server accepts."""
    if isinstance(node, list):
        return [to_v2(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields"):
        return {k: v for k, v in node.items() if k == "description" or k.startswith("x-")}
    out: Schema = {}
    for key, value in node.items():
        if key in ("nullable", "anyOf", "oneOf", "not", "x-kubernetes-validations"):
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {k: to_v2(v) for k, v in value.items()}
        else:
            out[key] = to_v2(value)
    return out


# -- documents -------------------------------------------------------------------------------
def _refs(node: Any, prefix: str) -> Iterable[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(prefix):
            yield ref[len(prefix) :]
        for value in node.values():
            yield from _refs(value, prefix)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value, prefix)


def closure(definitions: Mapping[str, Schema], roots: Iterable[str]) -> list[str]:
    """The named definitions and every definition they reference, transitively (sorted)."""
    seen: set[str] = set()
    todo = [r for r in roots if r in definitions]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [r for r in _refs(definitions[name], V2_REF) if r in definitions and r not in seen]
    return sorted(seen)


def _rewrite_refs(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {
            k: (
                new + v[len(old) :]
                if k == "$ref" and isinstance(v, str) and v.startswith(old)
                else _rewrite_refs(v, old, new)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewrite_refs(v, old, new) for v in node]
    return node


def v2_document(definitions: Mapping[str, Schema]) -> Schema:
    """The ``/openapi/v2`` document: every definition (v2 form), no paths (kubectl reads the
    field-validation support from v3)."""
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": KUBE_VERSION},
        "paths": {},
        "definitions": {name: to_v2(s) for name, s in sorted(definitions.items())},
    }


_PATCH_PARAMS = ("dryRun", "fieldManager", "force", "pretty")


def _operation(action: str, res: Served, op_id: str, ref: str | None) -> Schema:
    params = [
        {"name": n, "in": "query", "schema": {"type": "string"}, "uniqueItems": True}
        for n in (_PATCH_PARAMS if action == "patch" else ("pretty",))
    ]
    content = {"application/json": {"schema": {"$ref": V3_REF + ref}}} if ref else {}
    return {
        "operationId": op_id,
        "parameters": params,
        "responses": {"200": {"description": "OK", "content": content}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {
            "group": res.group,
            "version": res.version,
            "kind": res.kind,
        },
    }


def v3_document(definitions: Mapping[str, Schema], served: Iterable[Served]) -> Schema:
    """One ``/openapi/v3/<group-version>`` document: a GET and a PATCH path per resource (no
    ``fieldValidation`` parameter: kubectl then validates on its side) and the schemas they
    reference, transitively."""
    paths: Schema = {}
    roots: list[str] = []
    for res in served:
        ns = "namespaces/{namespace}/" if res.namespaced else ""
        path = f"/{res.gv_path}/{ns}{res.plural}/{{name}}"
        op = f"{res.kind}{res.version}"
        paths[path] = {
            "get": _operation("get", res, f"read{op}", res.definition),
            "patch": _operation("patch", res, f"patch{op}", res.definition),
        }
        if res.definition:
            roots.append(res.definition)
    schemas = {n: definitions[n] for n in closure(definitions, roots)}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": KUBE_VERSION},
        "paths": paths,
        "components": {"schemas": _rewrite_refs(schemas, V2_REF, V3_REF)},
    }


def v3_index(gv_hashes: Mapping[str, str]) -> Schema:
    """``/openapi/v3``: each group-version's document path with its content hash."""
    return {
        "paths": {
            gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
            for gv, digest in sorted(gv_hashes.items())
        }
    }


def content_hash(doc: Any) -> str:
    """A stable hash of a document (the index's ``?hash=``, clients cache by it)."""
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:64].upper()
