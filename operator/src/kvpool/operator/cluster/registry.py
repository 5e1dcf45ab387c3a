"""What the API server knows about each resource: discovery, schemas, columns, OpenAPI.

Why: a real API server learns custom resources from the CRDs installed in it (``helm install``
creates them from the chart's ``crds/``) and the built-in kinds from its own types. Here the
built-ins' discovery comes from kmock's bundled resource list and their schemas from
kubernetes-validate's Kubernetes 1.32 definitions; each installed CRD adds its versions
(discovery with short names and categories, the status and scale subresources, its structural
schema, its printer columns) and is reported Established, as Helm waits for. The OpenAPI
documents (built by the pure ``openapi`` module) are cached until the next CRD change.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources as pkg_resources
from typing import Any

import kmock

from kvpool.operator.cluster import openapi, protobuf, tables
from kvpool.operator.cluster.store import Res

VERBS = {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
#: kubernetes-validate's schema set matching the kubectl on these machines (1.32).
SCHEMA_VERSION = "v1.32.0-local"


_SUBRESOURCE_KINDS = {
    "scale": "Scale",
    "eviction": "Eviction",
    "token": "TokenRequest",
    "binding": "Binding",
}
SERVER_VERSION = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-kvpool",
    "gitCommit": "",
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "",
    "compiler": "kvpool",
    "platform": "linux/amd64",
}


def version_priority(version: str) -> tuple[int, int, int]:
    """How the API server orders versions: GA over beta over alpha, then by number."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if m is None:
        return (0, 0, 0)
    stage = {"alpha": 1, "beta": 2, None: 3}[m.group(2)]
    return (stage, int(m.group(1)), int(m.group(3) or 0))


@functools.cache
def builtin_definitions() -> dict[str, openapi.Schema]:
    """The built-in kinds' OpenAPI definitions (read once from kubernetes-validate's data)."""
    base = pkg_resources.files("kubernetes_validate") / "kubernetes-json-schema" / SCHEMA_VERSION
    data = json.loads((base / "_definitions.json").read_text(encoding="utf-8"))
    return openapi.builtin_definitions(data["$defs"])


def res_of(resource: Any) -> Res:
    """A kmock resource (or any object with group, version, plural) as the store's key."""
    return Res(str(resource.group or ""), str(resource.version), str(resource.plural))


@dataclass
class Kind:
    """One served resource."""

    res: Res
    kind: str
    namespaced: bool
    crd: Mapping[str, Any] | None = None  # the CRD's version entry, for custom resources
    validated: bool = True  # False: served without its schema (the operator's emulator tests)

    @property
    def api_version(self) -> str:
        return f"{self.res[0]}/{self.res[1]}" if self.res[0] else self.res[1]

    @property
    def schema(self) -> Mapping[str, Any] | None:
        """The structural schema of a custom resource (None for built-ins and for kinds
        declared without a CRD)."""
        if self.crd is None or not self.validated:
            return None
        schema: Mapping[str, Any] | None = (self.crd.get("schema") or {}).get("openAPIV3Schema")
        return schema

    @property
    def scale(self) -> Mapping[str, Any] | None:
        if self.crd is not None:
            scale: Mapping[str, Any] | None = (self.crd.get("subresources") or {}).get("scale")
            return scale
        if self.res[:2] == ("apps", "v1") and self.res[2] in ("deployments", "statefulsets"):
            return {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            }
        return None

    def qualified(self) -> str:
        """``Kind.group`` as API errors name it (``P2PGroup.kvpool.io``)."""
        return f"{self.kind}.{self.res[0]}" if self.res[0] else self.kind


@dataclass
class Registry:
    """Every served resource; ``discovery`` is the API server's kmock resource array."""

    discovery: Any  # kmock's ResourcesArray
    crds: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    _kinds: dict[Res, Kind] = field(default_factory=dict)
    _v2: bytes | None = None
    _v3: dict[str, openapi.Schema] = field(default_factory=dict)

    def kind(self, res: Res) -> Kind:
        """The resource's kind (a resource kmock knows but that has no kind: its plural)."""
        found = self._kinds.get(res)
        if found is not None:
            return found
        info = self.discovery[f"{res[0]}/{res[1]}/{res[2]}" if res[0] else f"{res[1]}/{res[2]}"]
        kind = Kind(res, str(info.kind or res[2].capitalize()), bool(info.namespaced))
        self._kinds[res] = kind
        return kind

    def served(self) -> list[Kind]:
        return [self.kind(res_of(r)) for r in self.discovery]

    def by_kind(self, api_version: str, kind: str) -> Kind | None:
        for k in self.served():
            if k.api_version == api_version and k.kind == kind:
                return k
        return None

    def has_status(self, res: Res) -> bool:
        key = f"{res[0]}/{res[1]}/{res[2]}" if res[0] else f"{res[1]}/{res[2]}"
        return "status" in self.discovery[key].subresources

    # -- CRDs --------------------------------------------------------------------------------
    def declare(self, crd: Mapping[str, Any], *, with_schema: bool = True) -> list[Res]:
        """Serve every version of ``crd`` (with its schema unless ``with_schema`` is off: the
        operator's emulator tests declare the kinds only, like the stock emulator)."""
        spec, names = crd["spec"], crd["spec"]["names"]
        out = []
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            res = Res(spec["group"], version["name"], names["plural"])
            subresources = set((version.get("subresources") or {}).keys())
            self.discovery[f"{res[0]}/{res[1]}/{res[2]}"] = kmock.ResourceInfo(
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                kind=names["kind"],
                singular=names.get("singular") or names["kind"].lower(),
                verbs=VERBS,
                shortnames=set(names.get("shortNames") or []),
                categories=set(names.get("categories") or []),
                subresources=subresources,
            )
            self._kinds[res] = Kind(
                res,
                names["kind"],
                spec.get("scope", "Namespaced") == "Namespaced",
                version,
                with_schema,
            )
            out.append(res)
        if with_schema:
            self.crds[crd["metadata"]["name"]] = crd
        self._v2, self._v3 = None, {}
        return out

    def forget(self, crd: Mapping[str, Any]) -> list[Res]:
        """Stop serving the CRD's resources (its objects are deleted by the caller)."""
        spec = crd["spec"]
        gone = []
        for version in spec.get("versions", []):
            res = Res(spec["group"], version["name"], spec["names"]["plural"])
            self._kinds.pop(res, None)
            key = f"{res[0]}/{res[1]}/{res[2]}"
            if key in self.discovery:
                del self.discovery[key]
            gone.append(res)
        self.crds.pop(crd["metadata"]["name"], None)
        self._v2, self._v3 = None, {}
        return gone

    @staticmethod
    def established(crd: Mapping[str, Any], now: str) -> dict[str, Any]:
        """The status a CRD gets once its names are accepted and it is served."""
        names = crd["spec"]["names"]
        return {
            "acceptedNames": dict(names),
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now}
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
        }

    # -- OpenAPI -------------------------------------------------------------------------------
    def definitions(self) -> dict[str, openapi.Schema]:
        defs = dict(builtin_definitions())
        for crd in self.crds.values():
            for name, schema in openapi.crd_definitions(crd).values():
                defs[name] = schema
        return defs

    @staticmethod
    def definition_of(kind: Kind, defs: Mapping[str, openapi.Schema]) -> str | None:
        if kind.crd is not None:
            return f"{openapi.reversed_group(kind.res[0])}.{kind.res[1]}.{kind.kind}"
        return openapi.definition_for(defs, kind.res[0], kind.res[1], kind.kind)

    def v2(self) -> bytes:
        """``/openapi/v2`` as gnostic protobuf."""
        if self._v2 is None:
            self._v2 = protobuf.document(openapi.v2_document(self.definitions()))
        return self._v2

    def _served_by_gv(self) -> dict[str, list[openapi.Served]]:
        defs = self.definitions()
        out: dict[str, list[openapi.Served]] = {}
        for k in self.served():
            served = openapi.Served(
                k.res[0], k.res[1], k.res[2], k.kind, k.namespaced, self.definition_of(k, defs)
            )
            out.setdefault(served.gv_path, []).append(served)
        return out

    def v3_documents(self) -> dict[str, openapi.Schema]:
        if not self._v3:
            defs = self.definitions()
            self._v3 = {
                gv: openapi.v3_document(defs, served)
                for gv, served in sorted(self._served_by_gv().items())
            }
        return self._v3

    def v3_index(self) -> openapi.Schema:
        docs = self.v3_documents()
        return openapi.v3_index({gv: openapi.content_hash(doc) for gv, doc in docs.items()})

    def patch_schema(self, kind: Kind) -> tuple[Any, Any]:
        """The kind's schema and a resolver of its ``$ref``s, for strategic merge and apply."""
        if kind.schema is not None:
            return kind.schema, lambda node: node
        defs = builtin_definitions()
        name = openapi.definition_for(defs, kind.res[0], kind.res[1], kind.kind)

        def resolve(node: Any) -> Any:
            while isinstance(node, Mapping) and isinstance(node.get("$ref"), str):
                node = defs.get(node["$ref"].rsplit("/", 1)[-1])
            return node

        return (defs.get(name) if name else None), resolve

    # -- discovery -------------------------------------------------------------------------------
    def _info(self, kind: Kind) -> Any:
        res = kind.res
        return self.discovery[f"{res[0]}/{res[1]}/{res[2]}" if res[0] else f"{res[1]}/{res[2]}"]

    def group_versions(self) -> dict[str, list[str]]:
        """Every API group (not the core one) and its versions, preferred first."""
        groups: dict[str, set[str]] = {}
        for kind in self.served():
            if kind.res.group:
                groups.setdefault(kind.res.group, set()).add(kind.res.version)
        return {g: sorted(v, key=version_priority, reverse=True) for g, v in sorted(groups.items())}

    @staticmethod
    def api_group(name: str, versions: list[str]) -> dict[str, Any]:
        listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": name,
            "versions": listed,
            "preferredVersion": listed[0],
        }

    def api_group_list(self) -> dict[str, Any]:
        groups = [self.api_group(g, v) for g, v in self.group_versions().items()]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def api_resource_list(self, group: str, version: str) -> dict[str, Any] | None:
        """Each resource of a group-version, then each of its subresources (None: not served)."""
        out: list[dict[str, Any]] = []
        for kind in self.served():
            if (kind.res.group, kind.res.version) != (group, version):
                continue
            info = self._info(kind)
            out.append(
                {
                    "name": kind.res.plural,
                    "singularName": info.singular or kind.kind.lower(),
                    "namespaced": kind.namespaced,
                    "kind": kind.kind,
                    "verbs": sorted(info.verbs),
                    "shortNames": sorted(info.shortnames),
                    "categories": sorted(info.categories),
                }
            )
            for sub in sorted(info.subresources):
                entry: dict[str, Any] = {
                    "name": f"{kind.res.plural}/{sub}",
                    "singularName": "",
                    "namespaced": kind.namespaced,
                    "kind": _SUBRESOURCE_KINDS.get(sub, kind.kind),
                    "verbs": ["get", "patch", "update"],
                }
                if sub == "scale":
                    entry.update(group="autoscaling", version="v1")
                out.append(entry)
        if not out and group:
            return None
        return {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version,
            "resources": out,
        }

    # -- tables --------------------------------------------------------------------------------
    def columns(self, kind: Kind) -> list[tables.Column]:
        if kind.crd is not None:
            return tables.crd_columns(kind.crd)
        return tables.builtin_columns(kind.kind)
