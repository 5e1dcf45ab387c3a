"""Read KVCachePool / P2PGroup / PDPair documents from YAML text into API models.

Why: a person running the CLI (or the webhook receiving a request) must get "file, document,
field: what is wrong" — never a traceback — for bad YAML, an unknown kind or a bad field.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, cast

import yaml
from pydantic import BaseModel, ValidationError

from kvpool.operator.api.common import API_VERSION
from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool

KINDS: dict[str, type[BaseModel]] = {
    "KVCachePool": KVCachePool,
    "P2PGroup": P2PGroup,
    "PDPair": PDPair,
}


@dataclass(frozen=True)
class LoadError:
    """One document that could not be read: where, what, and the fix."""

    source: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"ERROR {self.source}: {self.message}\n    fix: {self.fix}"


@dataclass
class Domain:
    """A pool and the members that name it."""

    pool: KVCachePool
    members: list[P2PGroup | PDPair] = field(default_factory=list)


@dataclass
class Loaded:
    """Everything read from the input files."""

    pools: list[KVCachePool] = field(default_factory=list)
    members: list[P2PGroup | PDPair] = field(default_factory=list)
    errors: list[LoadError] = field(default_factory=list)

    def domains(self) -> list[Domain]:
        """Group members under their pool; a member without its pool is a load error."""
        by_key = {(p.metadata.namespace, p.metadata.name): Domain(p) for p in self.pools}
        for member in self.members:
            key = (member.metadata.namespace, member.spec.pool_ref.name)
            if key in by_key:
                by_key[key].members.append(member)
                continue
            elsewhere = sorted(ns for ns, name in by_key if name == key[1])
            where = f"{member.kind}/{member.metadata.name}: spec.poolRef.name"
            if elsewhere:
                error = LoadError(
                    where,
                    f"names KVCachePool {key[1]!r}, which is in namespace "
                    f"{', '.join(map(repr, elsewhere))}, but this {member.kind} is in "
                    f"namespace {key[0]!r}: a member joins a pool of its own namespace only",
                    f"set metadata.namespace: {elsewhere[0]} on the {member.kind}, or create "
                    f"the KVCachePool in namespace {key[0]}",
                )
            else:
                error = LoadError(
                    where,
                    f"names KVCachePool {key[1]!r} in namespace {key[0]!r}, which is not "
                    "among the given files",
                    "pass the pool's file too (-f pool.yaml -f member.yaml)",
                )
            if error not in self.errors:
                self.errors.append(error)
        return [by_key[k] for k in sorted(by_key)]


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(document)"


def parse_document(doc: Any, source: str) -> KVCachePool | P2PGroup | PDPair | LoadError:
    """Validate one YAML document into its model, or say precisely what is wrong."""
    if not isinstance(doc, dict):
        return LoadError(source, "is not a mapping", "each document must be a Kubernetes object")
    kind = doc.get("kind")
    if kind not in KINDS:
        return LoadError(
            f"{source}: kind",
            f"unknown kind {kind!r}",
            f"use one of {', '.join(KINDS)} with apiVersion {API_VERSION}",
        )
    if doc.get("apiVersion") != API_VERSION:
        return LoadError(
            f"{source}: apiVersion",
            f"is {doc.get('apiVersion')!r}",
            f"write apiVersion: {API_VERSION}",
        )
    name = (doc.get("metadata") or {}).get("name", "?")
    try:
        model = KINDS[kind].model_validate(doc)
    except ValidationError as exc:
        details = "; ".join(f"{_loc(e['loc'])}: {e['msg']}" for e in exc.errors())
        first = exc.errors()[0]
        fix = (
            f"remove or rename {_loc(first['loc'])} (see the {kind} schema in crds/)"
            if first["type"] == "extra_forbidden"
            else f"correct {_loc(first['loc'])}"
        )
        return LoadError(f"{source} ({kind}/{name})", details, fix)
    return cast(KVCachePool | P2PGroup | PDPair, model)


def load_text(text: str, source: str, into: Loaded | None = None) -> Loaded:
    """Parse every YAML document of ``text`` (``source`` names it in messages)."""
    loaded = into if into is not None else Loaded()
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        loaded.errors.append(
            LoadError(where, f"invalid YAML ({getattr(exc, 'problem', exc)})", "fix the syntax")
        )
        return loaded
    for i, doc in enumerate(_unwrap_lists(docs)):
        result = parse_document(doc, f"{source}#{i + 1}")
        if isinstance(result, LoadError):
            loaded.errors.append(result)
        elif isinstance(result, KVCachePool):
            loaded.pools.append(result)
        else:
            loaded.members.append(result)
    return loaded


def _unwrap_lists(docs: list[Any]) -> list[Any]:
    """Documents with ``kind: List`` (``kubectl get -o yaml``, ``render -o json``) unwrapped."""
    out: list[Any] = []
    for doc in docs:
        if (
            isinstance(doc, dict)
            and doc.get("kind") == "List"
            and isinstance(doc.get("items"), list)
        ):
            out.extend(doc["items"])
        else:
            out.append(doc)
    return out


MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def _expand(name: str, recursive: bool) -> list[Path] | None:
    path = Path(name)
    if not path.is_dir():
        return None
    found = path.rglob("*") if recursive else path.iterdir()
    return sorted(p for p in found if p.is_file() and p.suffix in MANIFEST_SUFFIXES)


def load_files(
    names: Sequence[str], *, recursive: bool = False, stdin: TextIO | None = None
) -> Loaded:
    """Read every ``-f`` argument the way kubectl does: a file, ``-`` for stdin, or a directory
    (its .yaml/.yml/.json files; with ``recursive`` its subdirectories too)."""
    loaded = Loaded()
    for name in names:
        if name == "-":
            load_text((stdin or sys.stdin).read(), "<stdin>", loaded)
            continue
        files = _expand(name, recursive)
        if files is not None and not files:
            loaded.errors.append(
                LoadError(
                    name,
                    "is a directory without .yaml, .yml or .json files"
                    + ("" if recursive else " (subdirectories are not read)"),
                    "name a directory holding manifests, or add -R to read subdirectories",
                )
            )
        for path in files if files is not None else [Path(name)]:
            try:
                text = path.read_text(encoding="utf-8")
            except OSError as exc:
                loaded.errors.append(
                    LoadError(str(path), f"cannot read ({exc.strerror})", "check the path")
                )
                continue
            load_text(text, str(path), loaded)
    return loaded
