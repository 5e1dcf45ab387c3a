"""A custom resource checked against its CRD's structural schema: prune, default, validate and
CEL, in the API server's order: pure.

Why: a CR that reaches the operator has been through the API server's schema handling: unknown
fields are gone, defaults are filled in, types, bounds, enums and patterns hold and every
``x-kubernetes-validations`` rule is true. Without that, ``kubectl apply`` of a typo'd field or
a broken CEL rule would be accepted here and refused by a real cluster. The OpenAPI keywords
are checked by jsonschema (Draft 4, which OpenAPI v3.0 schemas follow) on the schema with
``nullable`` and ``x-kubernetes-int-or-string`` spelled as JSON Schema; the CEL rules by
cel-python; the messages follow the API server's ``field: Invalid value: ...: detail`` form.

Not reproduced (listed in the README): list-type ``set``/``map`` uniqueness, ``oldSelf``
transition rules with ``optionalOldSelf``, CEL cost limits, ``x-kubernetes-embedded-resource``
metadata checks and ratcheting of unchanged invalid fields.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from functools import cache
from typing import Any

import celpy
import jsonschema
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

Schema = Mapping[str, Any]
_ROOT_KEYS = ("apiVersion", "kind", "metadata")


# -- pruning and defaulting ----------------------------------------------------------------------
def prune(value: Any, schema: Schema, root: bool = True) -> Any:
    """``value`` without the fields its schema does not declare (kept under
    ``x-kubernetes-preserve-unknown-fields``)."""
    if isinstance(value, list):
        items = schema.get("items")
        return [prune(v, items, False) for v in value] if isinstance(items, dict) else value
    if not isinstance(value, dict):
        return value
    props: Mapping[str, Any] = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    keep_all = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    out: dict[str, Any] = {}
    for key, sub in value.items():
        if root and key in _ROOT_KEYS:
            out[key] = sub
        elif key in props:
            out[key] = prune(sub, props[key], False)
        elif isinstance(extra, dict):
            out[key] = prune(sub, extra, False)
        elif keep_all or extra is True:
            out[key] = sub
    return out


def default(value: Any, schema: Schema) -> Any:
    """``value`` with every absent property that has a ``default`` set to it (recursively,
    only inside objects that are present, as the API server defaults)."""
    if isinstance(value, list):
        items = schema.get("items")
        return [default(v, items) for v in value] if isinstance(items, dict) else value
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out and out[key] is not None:
            out[key] = default(out[key], sub)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        declared = set(schema.get("properties") or {})
        out = {k: (v if k in declared else default(v, extra)) for k, v in out.items()}
    return out


# -- OpenAPI keywords ------------------------------------------------------------------------
def as_jsonschema(node: Any) -> Any:
    """A structural schema as JSON Schema Draft 4: nullable and int-or-string spelled out,
    Kubernetes extensions dropped, ``metadata`` left to the API server's own checks."""
    if isinstance(node, list):
        return [as_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes") or key in ("nullable", "format", "default"):
            continue
        if key == "properties":
            out[key] = {k: as_jsonschema(v) for k, v in value.items() if k != "metadata"}
        else:
            out[key] = as_jsonschema(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _shown(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps("object" if isinstance(value, dict) else "array")
    return json.dumps(value)


def _message(error: jsonschema.ValidationError) -> str:
    where = _path(error.absolute_path)
    field = where or "<root>"
    if error.validator == "required":
        missing = str(error.message).split("'")[1]
        return f"{where + '.' if where else ''}{missing}: Required value"
    if error.validator == "enum":
        allowed = ", ".join(json.dumps(v) for v in error.validator_value)
        return f"{field}: Unsupported value: {_shown(error.instance)}: supported values: {allowed}"
    if error.validator == "type":
        want = error.validator_value
        want = want[0] if isinstance(want, list) else want
        return (
            f"{field}: Invalid value: {_shown(error.instance)}: {field} in body must be of "
            f"type {want}: {_shown(error.instance)}"
        )
    return f"{field}: Invalid value: {_shown(error.instance)}: {error.message}"


@cache
def _validator(schema_json: str) -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(as_jsonschema(json.loads(schema_json)))


def schema_errors(value: Any, schema: Schema) -> list[str]:
    """Every violation of the schema's OpenAPI keywords, one message each."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    found = sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [_message(e) for e in found]


# -- CEL ---------------------------------------------------------------------------------------
@cache
def _program(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _rules_at(value: Any, old: Any, schema: Schema, where: str, out: list[str]) -> None:
    if value is None:
        return
    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        if "oldSelf" in text and old is None:
            continue  # a transition rule: only on update, when the old value exists
        context = {"self": json_to_cel(value)}
        if old is not None:
            context["oldSelf"] = json_to_cel(old)
        field = where + str(rule.get("fieldPath", "")) if rule.get("fieldPath") else where
        try:
            ok = bool(_program(text).evaluate(context))
        except CELEvalError as exc:
            out.append(
                f"{field or '<root>'}: Invalid value: {_shown(value)}: {exc.args[0]} "
                f"evaluating rule: {text}"
            )
            continue
        if not ok:
            message = rule.get("message") or f"failed rule: {text}"
            out.append(f"{field or '<root>'}: Invalid value: {_shown(value)}: {message}")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub_schema is not None:
                sub_old = old.get(key) if isinstance(old, dict) else None
                _rules_at(sub, sub_old, sub_schema, f"{where}.{key}" if where else key, out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, sub in enumerate(value):
            _rules_at(sub, None, schema["items"], f"{where}[{i}]", out)


def cel_errors(value: Any, schema: Schema, old: Any = None) -> list[str]:
    """Every ``x-kubernetes-validations`` rule that is false (or fails) on ``value``."""
    out: list[str] = []
    _rules_at(value, old, schema, "", out)
    return out


# -- the whole sequence --------------------------------------------------------------------------
def admit(
    obj: Mapping[str, Any], schema: Schema, old: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The object as the API server stores it (pruned, defaulted) and every schema and CEL
    error (empty: valid). Status is checked the same way when present."""
    out: dict[str, Any] = default(prune(obj, schema), schema)
    errors = schema_errors(out, schema)
    if not errors:
        errors = cel_errors(out, schema, old)
    return out, errors


def invalid_message(qualified_kind: str, name: str, errors: list[str]) -> str:
    """The API server's 422 message (``P2PGroup.kvpool.io "x" is invalid: ...``)."""
    detail = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    return f'{qualified_kind} "{name}" is invalid: {detail}'
