"""Pure validation of a cache domain: every rule of DESIGN.md plus general config checks.

``validate_domain(pool, members)`` returns structured problems (errors and warnings); the CLI,
the admission webhook and the status function all call it. No I/O. The rules live by family in
rules_domain (seed, fingerprint, model/chunk/block/TP relations, pool settings, which engines
publish KV events), rules_ports (rules 2-3), rules_transfer (4, 5, 6, 8), rules_sizing (7, 9,
10) and rules_sim (the simulated engine).
"""

from __future__ import annotations

from kvpool.operator.api.common import MemoryBudget
from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.sizing import member_memory_budget
from kvpool.operator.validation import (
    rules_domain,
    rules_ports,
    rules_sim,
    rules_sizing,
    rules_transfer,
)
from kvpool.operator.validation.problems import Patch, Problem, apply_patches, errors, warnings

RULES = (
    rules_domain.pool_checks,
    rules_domain.rule1_domain,
    rules_domain.model_relations,
    rules_domain.kv_events,
    rules_ports.rule2_ports,
    rules_ports.rule3_instance_ids,
    rules_transfer.rule4_p2p_disk,
    rules_transfer.rule5_transfer,
    rules_transfer.rule6_and_overrides,
    rules_sizing.rule7_buffers,
    rules_transfer.rule8_pd,
    rules_sizing.rule9_accelerators,
    rules_sizing.rule10_mla,
    rules_sim.rule_sim,
)


def memory_budgets(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> dict[str, MemoryBudget]:
    """Host memory per member (seed manual §5.5), keyed by ``Kind/name``."""
    return {
        f"{m.kind}/{m.metadata.name}": member_memory_budget(pool, m)
        for m in sorted(members, key=lambda m: (m.kind, m.metadata.name))
    }


def validate_domain(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[Problem]:
    """Every problem of the domain, errors and warnings, in rule order."""
    out: list[Problem] = []
    for rule in RULES:
        out.extend(rule(pool, members))
    return out


__all__ = [
    "Patch",
    "Problem",
    "apply_patches",
    "errors",
    "memory_budgets",
    "validate_domain",
    "warnings",
]
