"""OpenAPI v2 in gnostic's protobuf form (``openapi_v2.Document``), the only form kubectl reads:
pure.

Why: client-go's ``OpenAPISchema()`` asks ``/openapi/v2`` for
``application/com.github.proto-openapi.spec.v2@v1.0+protobuf`` and unmarshals the answer as
protobuf; a JSON answer is "failed to download openapi". The wire format is small enough to
write directly: this encodes the messages kubectl's model parser reads (Document, Info,
Definitions, NamedSchema, Schema and its items, properties, additionalProperties, type and
vendor extensions; field numbers from gnostic's ``openapiv2/OpenAPIv2.proto``). Extension and
``default``/``enum`` values are ``Any`` messages carrying YAML, as gnostic writes them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

_VARINT, _FIXED64, _BYTES = 0, 1, 2


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, _BYTES) + _varint(len(data)) + data


def _str(field: int, text: str) -> bytes:
    return _bytes(field, text.encode())


def _int(field: int, n: int) -> bytes:
    return _key(field, _VARINT) + _varint(int(n))


def _bool(field: int, flag: bool) -> bytes:
    return _key(field, _VARINT) + _varint(1 if flag else 0)


def _double(field: int, x: float) -> bytes:
    return _key(field, _FIXED64) + struct.pack("<d", float(x))


def _any(value: Any) -> bytes:
    """gnostic's ``Any``: field 2 holds the value as YAML (JSON is YAML)."""
    return _str(2, json.dumps(value))


def _named_any(field: int, name: str, value: Any) -> bytes:
    return _bytes(field, _str(1, name) + _bytes(2, _any(value)))


_SCHEMA_STRINGS = {"format": 2, "title": 3, "description": 4, "pattern": 13}
_SCHEMA_INTS = {
    "maxLength": 11,
    "minLength": 12,
    "maxItems": 14,
    "minItems": 15,
    "maxProperties": 17,
    "minProperties": 18,
}
_SCHEMA_DOUBLES = {"multipleOf": 6, "maximum": 7, "minimum": 9}
_SCHEMA_BOOLS = {"exclusiveMaximum": 8, "exclusiveMinimum": 10, "uniqueItems": 16, "readOnly": 27}


def schema(node: Mapping[str, Any]) -> bytes:
    """One ``openapi_v2.Schema`` message."""
    out = bytearray()
    if "$ref" in node:
        out += _str(1, str(node["$ref"]))
    for key, value in node.items():
        if key in _SCHEMA_STRINGS and isinstance(value, str):
            out += _str(_SCHEMA_STRINGS[key], value)
        elif key in _SCHEMA_INTS and isinstance(value, int):
            out += _int(_SCHEMA_INTS[key], value)
        elif key in _SCHEMA_DOUBLES and isinstance(value, int | float):
            out += _double(_SCHEMA_DOUBLES[key], value)
        elif key in _SCHEMA_BOOLS and isinstance(value, bool):
            out += _bool(_SCHEMA_BOOLS[key], value)
        elif key == "default":
            out += _bytes(5, _any(value))
        elif key == "required":
            for name in value:
                out += _str(19, name)
        elif key == "enum":
            for item in value:
                out += _bytes(20, _any(item))
        elif key == "additionalProperties":
            item = _bytes(1, schema(value)) if isinstance(value, dict) else _bool(2, bool(value))
            out += _bytes(21, item)
        elif key == "type":
            types = [value] if isinstance(value, str) else list(value)
            out += _bytes(22, b"".join(_str(1, t) for t in types))
        elif key == "items" and isinstance(value, dict):
            out += _bytes(23, _bytes(1, schema(value)))
        elif key == "allOf":
            for sub in value:
                out += _bytes(24, schema(sub))
        elif key == "properties":
            props = b"".join(
                _bytes(1, _str(1, name) + _bytes(2, schema(sub))) for name, sub in value.items()
            )
            out += _bytes(25, props)
        elif key == "example":
            out += _bytes(30, _any(value))
        elif key.startswith("x-"):
            out += _named_any(31, key, value)
    return bytes(out)


def document(doc: Mapping[str, Any]) -> bytes:
    """An ``openapi_v2.Document``: swagger, info and definitions (paths are not encoded; the
    documents served here have none)."""
    info = doc.get("info") or {}
    out = bytearray(_str(1, str(doc.get("swagger", "2.0"))))
    out += _bytes(2, _str(1, str(info.get("title", ""))) + _str(2, str(info.get("version", ""))))
    defs = b"".join(
        _bytes(1, _str(1, name) + _bytes(2, schema(s)))
        for name, s in (doc.get("definitions") or {}).items()
    )
    out += _bytes(9, defs)
    return bytes(out)


# -- Kubernetes' own protobuf (request bodies of client-go's typed clients) ------------------------
K8S_MAGIC = b"k8s\x00"


def _fields(data: bytes) -> list[tuple[int, Any]]:
    """The (field number, value) pairs of one message: ints for varints and fixed numbers,
    bytes for length-delimited fields (sub-messages, strings, bytes)."""
    out: list[tuple[int, Any]] = []
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == _VARINT:
            value, i = _read_varint(data, i)
        elif wire == _BYTES:
            size, i = _read_varint(data, i)
            value, i = data[i : i + size], i + size
        elif wire == _FIXED64:
            value, i = int.from_bytes(data[i : i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(data[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"protobuf wire type {wire} is not supported")
        out.append((field, value))
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7


def _map(entries: list[bytes], decode: Any = lambda b: b.decode()) -> dict[str, Any]:
    out = {}
    for entry in entries:
        kv = dict(_fields(entry))
        out[kv.get(1, b"").decode()] = decode(kv.get(2, b""))
    return out


def _time(data: bytes) -> str:
    import datetime  # noqa: PLC0415

    seconds = dict(_fields(data)).get(1, 0)
    stamp = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(data: bytes) -> dict[str, Any]:
    strings = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: dict[str, Any] = {}
    labels: list[bytes] = []
    annotations: list[bytes] = []
    for field, value in _fields(data):
        if field in strings and value:
            meta[strings[field]] = value.decode()
        elif field == 7:
            meta["generation"] = value
        elif field == 8:
            meta["creationTimestamp"] = _time(value)
        elif field == 11:
            labels.append(value)
        elif field == 12:
            annotations.append(value)
        elif field == 14:
            meta.setdefault("finalizers", []).append(value.decode())
    if labels:
        meta["labels"] = _map(labels)
    if annotations:
        meta["annotations"] = _map(annotations)
    return meta


def decode_k8s(body: bytes) -> dict[str, Any]:
    """A Secret or ConfigMap sent as Kubernetes protobuf (``application/vnd.kubernetes.protobuf``:
    Helm's release storage), as the JSON object it stands for; other kinds are refused."""
    import base64  # noqa: PLC0415

    if not body.startswith(K8S_MAGIC):
        raise ValueError("not a Kubernetes protobuf message (no k8s\\0 prefix)")
    envelope = dict(_fields(body[len(K8S_MAGIC) :]))
    type_meta = dict(_fields(envelope.get(1, b"")))
    api_version, kind = type_meta.get(1, b"").decode(), type_meta.get(2, b"").decode()
    fields = _fields(envelope.get(2, b""))
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind}
    maps: dict[int, list[bytes]] = {}
    for field, value in fields:
        if field == 1:
            obj["metadata"] = _meta(value)
        elif isinstance(value, bytes) and field in (2, 3, 4):
            maps.setdefault(field, []).append(value)
        elif kind in ("Secret", "ConfigMap") and field in (4, 5):
            obj["immutable"] = bool(value)
    if kind == "Secret":
        as_b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        if 2 in maps:
            obj["data"] = _map(maps[2], as_b64)
        if 3 in maps:
            obj["type"] = maps[3][0].decode()
        if 4 in maps:
            obj["stringData"] = _map(maps[4])
    elif kind == "ConfigMap":
        if 2 in maps:
            obj["data"] = _map(maps[2])
        if 3 in maps:
            obj["binaryData"] = _map(maps[3], lambda b: base64.b64encode(b).decode())
    else:
        raise ValueError(f"{kind} in Kubernetes protobuf is not decoded here: send JSON")
    return obj
