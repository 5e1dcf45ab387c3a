"""``kubectl get`` for the emulator: a table from the CRDs' additionalPrinterColumns.

Why: the README shows what ``kubectl get kvcachepools,p2pgroups,pdpairs`` prints; that output
is produced from the generated CRDs and objects the operator really reconciled (the emulator
tests), formatted the way kubectl formats it (a NAME column, then the columns of priority 0,
three spaces apart, AGE as kubectl's short duration), not typed by hand.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
_FILTER = re.compile(r"^\[\?\(@\.(\w+)==\"([^\"]*)\"\)\]$")


def crd(plural: str) -> dict[str, Any]:
    text = (ROOT / "crds" / f"kvpool.io_{plural}.yaml").read_text(encoding="utf-8")
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def jsonpath(obj: Any, path: str) -> Any:
    """The subset of kubectl's JSONPath the generated columns use: .a.b and [?(@.k=="v")]."""
    for part in re.findall(r"\.[A-Za-z0-9_]+|\[[^\]]*\]", path):
        if part.startswith("."):
            obj = obj.get(part[1:]) if isinstance(obj, dict) else None
        else:
            match = _FILTER.match(part)
            if match is None or not isinstance(obj, list):
                return None
            key, value = match.groups()
            found = [o for o in obj if isinstance(o, dict) and str(o.get(key)) == value]
            obj = found[0] if found else None
    return obj


def age(created: str, now: datetime.datetime) -> str:
    """kubectl's HumanDuration, for the ranges a test run spans."""
    then = datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 600:
        return f"{seconds // 60}m{seconds % 60}s" if seconds % 60 else f"{seconds // 60}m"
    if seconds < 3 * 3600:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def table(plural: str, objects: list[dict[str, Any]], now: datetime.datetime, prefix: bool) -> str:
    spec = crd(plural)["spec"]
    columns = [c for c in spec["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    kind = spec["names"]["singular"]
    rows = [["NAME", *(c["name"].upper() for c in columns)]]
    for obj in sorted(objects, key=lambda o: str(o["metadata"]["name"])):
        name = obj["metadata"]["name"]
        row = [f"{kind}.{spec['group']}/{name}" if prefix else name]
        for column in columns:
            if column["type"] == "date":
                row.append(age(obj["metadata"]["creationTimestamp"], now))
            else:
                value = jsonpath(obj, column["jsonPath"])
                row.append("" if value is None else str(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def kubectl_get(server: Any, plurals: list[str], now: datetime.datetime | None = None) -> str:
    """What ``kubectl get <plurals joined by ,>`` prints for the emulator's objects."""
    now = now or datetime.datetime.now(tz=datetime.UTC)
    prefix = len(plurals) > 1
    parts = [
        table(p, server.live(f"kvpool.io/v1alpha1/{p}"), now, prefix)
        for p in plurals
        if server.live(f"kvpool.io/v1alpha1/{p}")
    ]
    return "\n\n".join(parts)
