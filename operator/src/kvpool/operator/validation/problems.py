"""The structured problem every validation rule yields: where, what is wrong, how to fix it.

Why: the same problems are printed by the CLI, returned by the admission webhook and written
into status conditions; one shape keeps the three identical and testable. A problem may carry
the fix as a patch (the first alternative its ``fix`` text names, as data), so a test can apply
it and check that the problem is gone: a fix that does not fix is a bug like any other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool

Severity = Literal["error", "warning"]
Resource = KVCachePool | P2PGroup | PDPair


@dataclass(frozen=True)
class Patch:
    """Set (or, with ``remove``, delete) one field of one resource's document.

    ``resource`` is ``Kind/name``; ``field`` the camelCase path from the document root, e.g.
    ``("spec", "transfer", "useNPU")``.
    """

    resource: str
    field: tuple[str, ...]
    value: Any = None
    remove: bool = False


@dataclass(frozen=True)
class Problem:
    """One problem: ``path`` names the resource and field (``P2PGroup/demo: spec.replicas``);
    ``code`` names the check, so (path, code) identifies the problem across edits."""

    path: str
    message: str
    fix: str
    rule: int | None = None
    severity: Severity = "error"
    code: str = ""
    patch: tuple[Patch, ...] = ()

    @property
    def resource(self) -> str:
        """``Kind/name`` of the resource the problem is on (the part of ``path`` before ':')."""
        return self.path.split(":", 1)[0]

    def __str__(self) -> str:
        tag = f"rule {self.rule}" if self.rule is not None else "config"
        return f"{self.severity.upper()} [{tag}] {self.path}: {self.message}\n    fix: {self.fix}"


def key(resource: Resource) -> str:
    """``Kind/name`` of a resource."""
    return f"{resource.kind}/{resource.metadata.name}"


def where(resource: Resource, field: str) -> str:
    """``Kind/name: field``."""
    return f"{key(resource)}: {field}"


def set_field(resource: Resource, field: str, value: Any) -> Patch:
    """A patch setting ``field`` (dotted camelCase below the document root)."""
    return Patch(key(resource), tuple(field.split(".")), value)


def remove_field(resource: Resource, field: str) -> Patch:
    """A patch deleting ``field`` (dotted camelCase below the document root)."""
    return Patch(key(resource), tuple(field.split(".")), remove=True)


def apply_patches(doc: dict[str, Any], patches: tuple[Patch, ...]) -> dict[str, Any]:
    """A copy of the document ``doc`` (``Kind/name`` matched) with the patches applied."""
    out = copy.deepcopy(doc)
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    for patch in patches:
        if patch.resource != name:
            continue
        node = out
        for part in patch.field[:-1]:
            node = node.setdefault(part, {})
        if patch.remove:
            node.pop(patch.field[-1], None)
        else:
            node[patch.field[-1]] = copy.deepcopy(patch.value)
    return out


def errors(problems: list[Problem]) -> list[Problem]:
    """Only the errors (warnings never fail validation)."""
    return [p for p in problems if p.severity == "error"]


def warnings(problems: list[Problem]) -> list[Problem]:
    """Only the warnings."""
    return [p for p in problems if p.severity == "warning"]
