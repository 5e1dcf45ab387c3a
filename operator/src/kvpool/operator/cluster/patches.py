"""The four PATCH types of the Kubernetes API: JSON merge patch, JSON patch, strategic merge
patch and server-side apply: pure.

Why: each client picks its own. kopf and the operator send merge patches and JSON patches
(finalizers with a ``test`` op); ``kubectl apply`` of a built-in kind, ``kubectl patch`` and
Helm's three-way upgrade send strategic merge patches; Helm 4 installs with server-side apply.
Strategic merge follows the schema's ``x-kubernetes-patch-merge-key``/``-strategy`` (lists of
containers, env, ports merged by key; ``$patch`` and ``$setElementOrder`` directives); apply
merges by ``x-kubernetes-list-type: map`` keys. JSON patch is the jsonpatch library's.

Not reproduced (README): server-side apply's field ownership (managedFields, conflicts, and the
removal of fields a manager stopped applying): applied fields are merged into the object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import jsonpatch
import jsonpointer

Schema = Mapping[str, Any]
Resolve = Callable[[Any], Any]  # follows a schema node's $ref (and allOf of one ref)


class PatchError(ValueError):
    """A patch that cannot be applied (422), with the reason."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: null deletes, objects merge, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch) if isinstance(patch, list) else patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch; a failed ``test`` op or a bad path is a PatchError."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch is a list of operations")
    try:
        return jsonpatch.apply_patch(target, ops)
    except jsonpatch.JsonPatchTestFailed as exc:
        raise PatchError(f"the test operation failed: {exc}") from None
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise PatchError(str(exc)) from None


def no_refs(_node: Any) -> Any:
    return _node


def _sub(schema: Any, key: str, resolve: Resolve) -> Any:
    node = resolve(schema) if schema is not None else None
    if not isinstance(node, Mapping):
        return None
    props = node.get("properties") or {}
    if key in props:
        return resolve(props[key])
    extra = node.get("additionalProperties")
    return resolve(extra) if isinstance(extra, Mapping) else None


def _items(schema: Any, resolve: Resolve) -> Any:
    node = resolve(schema) if schema is not None else None
    items = node.get("items") if isinstance(node, Mapping) else None
    return resolve(items) if items is not None else None


def _merge_keys(schema: Any, strategic: bool) -> list[str] | None:
    """The keys a list is merged by; None: the list is replaced (atomic)."""
    if not isinstance(schema, Mapping):
        return None
    if strategic:
        if "merge" not in str(schema.get("x-kubernetes-patch-strategy", "")).split(","):
            return None
        key = schema.get("x-kubernetes-patch-merge-key")
        return [str(key)] if key else []
    if schema.get("x-kubernetes-list-type") == "map":
        return [str(k) for k in schema.get("x-kubernetes-list-map-keys") or []]
    if schema.get("x-kubernetes-list-type") == "set":
        return []
    return None


def _merge_list(
    target: list[Any], patch: list[Any], schema: Any, resolve: Resolve, strategic: bool
) -> list[Any]:
    keys = _merge_keys(schema, strategic)
    if keys is None:
        return [_clean(p) for p in patch]
    if not keys:  # a set of scalars: union, in order
        out = list(target)
        out += [p for p in patch if p not in out]
        return out
    item_schema = _items(schema, resolve)

    def ident(item: Any) -> tuple[Any, ...]:
        return tuple(item.get(k) for k in keys) if isinstance(item, dict) else (item,)

    out = [copy.deepcopy(t) for t in target]
    for p in patch:
        found = [i for i, t in enumerate(out) if ident(t) == ident(p)]
        if isinstance(p, dict) and p.get("$patch") == "delete":
            out = [t for i, t in enumerate(out) if i not in found]
        elif found:
            out[found[0]] = _merge(out[found[0]], p, item_schema, resolve, strategic)
        else:
            out.append(_clean(p))
    return out


def _clean(value: Any) -> Any:
    """A patch value without directive keys (what gets stored when nothing is merged)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _merge(target: Any, patch: Any, schema: Any, resolve: Resolve, strategic: bool) -> Any:
    if not isinstance(patch, dict):
        if isinstance(patch, list) and isinstance(target, list):
            return _merge_list(target, patch, schema, resolve, strategic)
        return _clean(patch)
    if patch.get("$patch") == "replace":
        return _clean({k: v for k, v in patch.items() if k != "$patch"})
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key.startswith("$retainKeys"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            out[field] = [v for v in out.get(field) or [] if v not in value]
            continue
        if key == "$patch":
            continue
        deleted = isinstance(value, dict) and value.get("$patch") == "delete"
        if (value is None and strategic) or deleted:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value, _sub(schema, key, resolve), resolve, strategic)
    return out


def strategic_merge(target: Any, patch: Any, schema: Any, resolve: Resolve = no_refs) -> Any:
    """A strategic merge patch of ``target`` under the kind's OpenAPI ``schema``."""
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch is an object")
    return _merge(target, patch, schema, resolve, True)


def apply(target: Any, applied: Any, schema: Any, resolve: Resolve = no_refs) -> Any:
    """Server-side apply without ownership: the applied configuration merged into ``target``,
    lists merged by their ``x-kubernetes-list-map-keys`` (others replaced)."""
    if not isinstance(applied, dict):
        raise PatchError("an applied configuration is an object")
    return _merge(target, applied, schema, resolve, False)
