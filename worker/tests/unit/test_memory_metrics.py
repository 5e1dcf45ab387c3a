"""The worker's memory next to its budget: process_resident_memory_bytes from the process
collector, kvpool_worker_memory_budget_bytes from the pod's memory request the operator renders
(KVPOOL_WORKER_MEMORY_BUDGET_BYTES -> WorkerSettings.memory_budget_bytes), none without one."""

from __future__ import annotations

import re

from kvpool.worker.metrics import RuntimeMetrics
from kvpool.worker.settings import WorkerSettings


def _value(text: str, name: str) -> float | None:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def test_the_budget_is_read_from_the_rendered_env() -> None:
    env = {"KVPOOL_WORKER_MEMORY_BUDGET_BYTES": "4294967296"}
    assert WorkerSettings.from_env(env).memory_budget_bytes == 4 * 2**30
    assert WorkerSettings.from_env({}).memory_budget_bytes is None


def test_resident_memory_and_budget_are_exported_side_by_side() -> None:
    text = RuntimeMetrics(dict, memory_budget_bytes=4 * 2**30).render().decode()
    assert _value(text, "kvpool_worker_memory_budget_bytes") == 4 * 2**30
    resident = _value(text, "process_resident_memory_bytes")
    assert resident is not None and resident > 10 * 2**20  # this Python process, at least


def test_no_budget_no_series() -> None:
    text = RuntimeMetrics(dict).render().decode()
    assert _value(text, "kvpool_worker_memory_budget_bytes") is None
    assert _value(text, "process_resident_memory_bytes") is not None
