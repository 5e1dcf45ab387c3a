"""Ask the Prometheus of ``kvpool-operator up --monitoring`` whether the dashboards and alerts
have something to show: every panel query and every catalogued metric, with series.

Why a module: the simulated domain (``test_monitoring.py``) checks what any domain exports, the
cpu-demo domain (``test_local_stack.py``) what only the real LMCache engine with P2P and PD
exports; both ask the same questions of the same definitions (kvpool.operator.monitoring).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from kvpool.operator.monitoring import catalog, panels
from kvpool.operator.monitoring.panels import Needs

#: The rate window the checks give ``$__rate_interval`` (the local scrape runs every 2 s).
WINDOW = "1m"


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector (raises on a query Prometheus refuses)."""
    resp = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10)
    body = resp.json()
    assert body.get("status") == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def empty_panels(prometheus: str, needs: Needs) -> list[str]:
    """``dashboard / panel: query`` for every query of a panel of ``needs`` with no series."""
    out = []
    for d in panels.DASHBOARDS:
        for p in d.panels:
            if p.needs is not needs:
                continue
            for q in p.queries:
                if not query(prometheus, panels.instantiate(q.expr, WINDOW)):
                    out.append(f"{d.title} / {p.title}: {q.expr}")
    return out


def absent_metrics(prometheus: str, needs: Needs) -> list[str]:
    """Catalogued metrics of ``needs`` with no series (a histogram: its ``_count``)."""
    out = []
    for m in catalog.METRICS:
        if m.needs is not needs:
            continue
        names = [m.name, f"{m.name}_count"]
        selector = "|".join(names)
        if not query(prometheus, f'count({{__name__=~"{selector}", job=~"kvpool-.*"}})'):
            out.append(m.name)
    return out


def wait_for_series(prometheus: str, needs: Needs, timeout_s: float = 90.0) -> None:
    """Until every panel query and catalogued metric of ``needs`` has series (an
    AssertionError listing what has none at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = empty_panels(prometheus, needs) + absent_metrics(prometheus, needs)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise AssertionError("no series for:\n" + "\n".join(missing))
        time.sleep(2.0)


def firing(prometheus: str) -> list[dict[str, str]]:
    """The labels of every alert firing now."""
    return [r["metric"] for r in query(prometheus, 'ALERTS{alertstate="firing"}')]


def rule_health(prometheus: str) -> dict[str, str]:
    """Alert name -> its last evaluation's health (``ok``, ``err``, ``unknown``)."""
    body = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()
    return {r["name"]: r["health"] for g in body["data"]["groups"] for r in g["rules"]}
