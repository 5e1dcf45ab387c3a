"""Pure status: conditions from problems and readiness, stable lastTransitionTime, budgets."""

from __future__ import annotations

from op_builders import p2p, pd, pool

from kvpool.operator.status import member_status, pool_status
from kvpool.operator.validation import validate_domain

T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T00:05:00Z"


def _by_type(status: object) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in status.conditions}  # type: ignore[attr-defined]


def test_member_ready_when_all_instances_ready() -> None:
    the_pool, group = pool(), p2p()
    status = member_status(the_pool, group, [], {"grp-0", "grp-1"}, T0)
    conds = _by_type(status)
    assert conds["Ready"] == ("True", "AllInstancesReady")
    assert conds["ConfigValid"] == ("True", "Valid")
    assert conds["Degraded"] == ("False", "AsExpected")
    assert status.instances_ready == status.instances_desired == 2
    assert status.instances[0].lmcache_instance_id.startswith("grp-0~")
    assert status.instances[0].ports["p2p_init_ports"] == [20003, 20004]
    assert status.memory_budget is not None and status.memory_budget.total_bytes == 96 * 2**30


def test_member_progressing_then_transition_time_kept() -> None:
    the_pool, group = pool(), p2p()
    first = member_status(the_pool, group, [], {"grp-0"}, T0)
    assert _by_type(first)["Progressing"] == ("True", "RollingOut")
    assert _by_type(first)["Degraded"] == ("True", "InstancesUnavailable")
    again = member_status(the_pool, group, [], {"grp-0"}, T1, previous=first)
    ready = next(c for c in again.conditions if c.type == "Ready")
    assert ready.last_transition_time == T0
    done = member_status(the_pool, group, [], {"grp-0", "grp-1"}, T1, previous=again)
    assert next(c for c in done.conditions if c.type == "Ready").last_transition_time == T1


def test_invalid_spec_sets_config_ports_and_seed_conditions() -> None:
    the_pool = pool()
    group = p2p("pair-prefill", engine={"blockSize": 16})
    problems = validate_domain(the_pool, [group, pd()])
    status = member_status(the_pool, group, problems, set(), T0)
    conds = _by_type(status)
    assert conds["Ready"] == ("False", "InvalidSpec")
    assert conds["ConfigValid"] == ("False", "InvalidSpec")
    assert conds["HashSeedConsistent"] == ("False", "DomainMismatch")
    assert conds["PortsConsistent"] == ("True", "Allocated")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert "spec.engine.blockSize" in ready.message and "fix:" in ready.message
    # The instance-id collision (rule 3) is reported on the second resource, the PDPair.
    other = _by_type(member_status(the_pool, pd(), problems, set(), T0))
    assert other["PortsConsistent"] == ("False", "PortConflict")
    assert other["HashSeedConsistent"] == ("True", "OneSeedPerDomain")
    clean = member_status(the_pool, pd("x"), validate_domain(the_pool, [pd("x")]), set(), T0)
    assert _by_type(clean)["ConfigValid"] == ("True", "Valid")


def test_valid_member_of_a_domain_with_an_invalid_sibling_says_why_nothing_is_applied() -> None:
    """The operator applies nothing of a domain with an invalid resource: a valid member is
    not 'InstancesNotReady' and not rolling out; it names the resource that blocks it."""
    the_pool, group = pool(), p2p()
    bad = pd(prefill={"engine": {"blockSize": 16}})
    problems = validate_domain(the_pool, [group, bad])
    status = member_status(the_pool, group, problems, set(), T0)
    conds = _by_type(status)
    assert conds["Ready"] == ("False", "DomainInvalid")
    assert conds["Progressing"] == ("False", "Blocked")
    assert conds["Degraded"] == ("True", "DomainInvalid")
    assert conds["ConfigValid"] == ("True", "Valid")  # its own spec is fine
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.message.startswith("nothing of this domain is applied while PDPair/pair is")
    assert "spec.prefill.engine.blockSize" in ready.message and "fix:" in ready.message
    assert _by_type(member_status(the_pool, bad, problems, set(), T0))["Ready"] == (
        "False",
        "InvalidSpec",
    )
    fixed = member_status(the_pool, group, validate_domain(the_pool, [group, pd()]), set(), T1)
    assert _by_type(fixed)["Ready"] == ("False", "InstancesNotReady")
    assert _by_type(fixed)["Progressing"] == ("True", "RollingOut")


def test_pool_status_reports_seed_endpoints_and_budgets() -> None:
    the_pool = pool(hashSeed="auto")
    status = pool_status(the_pool, [pd(), p2p()], [], {"grp-0"}, T0)
    assert status.resolved_hash_seed is not None and status.resolved_hash_seed.isdigit()
    assert status.controller_endpoint == "http://pool-controller.ns.svc:9000"
    assert status.members == ["P2PGroup/grp", "PDPair/pair"]
    assert status.instances_desired == 4 and status.instances_ready == 1
    assert set(status.memory_budget) == {"P2PGroup/grp", "PDPair/pair"}
    dumped = status.model_dump(by_alias=True)
    assert "resolvedHashSeed" in dumped and "lastTransitionTime" in dumped["conditions"][0]
