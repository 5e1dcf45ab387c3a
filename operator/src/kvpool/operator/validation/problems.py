"""The structured problem every validation rule yields: where, what is wrong, how to fix it.

Why: the same problems are printed by the CLI, returned by the admission webhook and written
into status conditions; one shape keeps the three identical and testable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One problem: ``path`` names the resource and field (``P2PGroup/demo: spec.replicas``)."""

    path: str
    message: str
    fix: str
    rule: int | None = None
    severity: Severity = "error"

    def __str__(self) -> str:
        tag = f"rule {self.rule}" if self.rule is not None else "config"
        return f"{self.severity.upper()} [{tag}] {self.path}: {self.message}\n    fix: {self.fix}"


def errors(problems: list[Problem]) -> list[Problem]:
    """Only the errors (warnings never fail validation)."""
    return [p for p in problems if p.severity == "error"]


def warnings(problems: list[Problem]) -> list[Problem]:
    """Only the warnings."""
    return [p for p in problems if p.severity == "warning"]
