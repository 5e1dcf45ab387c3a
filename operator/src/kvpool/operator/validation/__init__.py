"""Pure validation of a cache domain: every rule of DESIGN.md plus general config checks.

``validate_domain(pool, members)`` returns structured problems (errors and warnings); the CLI,
the admission webhook and the status function all call it. No I/O.
"""

from __future__ import annotations

from kvpool.operator.api.common import MemoryBudget
from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.sizing import member_memory_budget
from kvpool.operator.quantity import format_bytes
from kvpool.operator.validation import rules
from kvpool.operator.validation.problems import Problem, errors, warnings

RULES = (
    rules.rule1_domain,
    rules.rule2_ports,
    rules.rule3_instance_ids,
    rules.rule4_p2p_disk,
    rules.rule5_transfer,
    rules.rule6_and_overrides,
    rules.rule7_buffers,
    rules.rule8_pd,
    rules.rule9_accelerators,
    rules.rule10_mla,
)


def memory_budgets(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> dict[str, MemoryBudget]:
    """Host memory per member (seed manual §5.5), keyed by ``Kind/name``."""
    return {
        f"{m.kind}/{m.metadata.name}": member_memory_budget(pool, m)
        for m in sorted(members, key=lambda m: (m.kind, m.metadata.name))
    }


def _pool_checks(pool: KVCachePool) -> list[Problem]:
    out: list[Problem] = []
    remote = pool.spec.tiers.remote
    if remote is not None and (remote.mooncake is None) == (remote.redis is None):
        out.append(
            Problem(
                rules.where(pool, "spec.tiers.remote"),
                "set exactly one remote tier (mooncake or redis)",
                "keep one of tiers.remote.mooncake and tiers.remote.redis",
            )
        )
    persistence = pool.spec.controller.persistence
    if persistence.mode == "redis" and not persistence.redis_url:
        out.append(
            Problem(
                rules.where(pool, "spec.controller.persistence.redisUrl"),
                "persistence mode redis needs a Redis URL",
                "set redisUrl (e.g. redis://kv-redis:6379/0) or use mode: full-sync",
            )
        )
    if persistence.mode != "redis" and persistence.redis_url:
        out.append(
            Problem(
                rules.where(pool, "spec.controller.persistence.redisUrl"),
                f"a Redis URL is set but persistence mode is {persistence.mode}: the controller "
                "would refuse to start (it writes to Redis only in mode redis)",
                "set mode: redis to persist the index in Redis, or remove redisUrl",
            )
        )
    return out


def _budget_warnings(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[Problem]:
    allocatable = pool.spec.node_allocatable_memory
    if allocatable is None:
        return []
    out: list[Problem] = []
    for member in members:
        budget = member_memory_budget(pool, member)
        if budget.per_instance_bytes > allocatable:
            out.append(
                Problem(
                    rules.where(member, "spec"),
                    f"one instance needs {format_bytes(budget.per_instance_bytes)} of host "
                    f"memory for LMCache alone, more than the node's allocatable "
                    f"{format_bytes(allocatable)} ({budget.formula})",
                    "lower tiers.cpu.size or hostStaging.bytes, or use larger nodes",
                    rule=7,
                    severity="warning",
                )
            )
    return out


def validate_domain(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[Problem]:
    """Every problem of the domain, errors and warnings, in rule order."""
    out = _pool_checks(pool)
    for rule in RULES:
        out.extend(rule(pool, members))
    out.extend(_budget_warnings(pool, members))
    return out


__all__ = ["Problem", "errors", "memory_budgets", "validate_domain", "warnings"]
