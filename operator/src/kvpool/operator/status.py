"""Pure status: conditions and observed fields from validation results and observed readiness.

Why: status is what a person reads first (`kubectl get p2pg`): Ready, why not, and whether the
domain contract holds. Computing it purely (time passed in, previous status passed in) makes it
testable and keeps lastTransitionTime stable while nothing changes.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.operator.api.common import Condition, InstanceStatus
from kvpool.operator.api.members import MemberStatus, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool, KVCachePoolStatus
from kvpool.operator.derive import names
from kvpool.operator.derive.defaults import domain_defaults, member_defaults
from kvpool.operator.derive.instances import instance_url, member_instances
from kvpool.operator.derive.sizing import member_memory_budget
from kvpool.operator.render.fingerprint import pool_fingerprint, resolve_hash_seed
from kvpool.operator.validation.problems import Problem, errors, key, warnings
from kvpool.protocol.domain import instance_id

_SEED_RULES = {1}
_PORT_RULES = {2, 3}


def _condition(
    ctype: str,
    ok: bool,
    reason_ok: str,
    reason_bad: str,
    message: str,
    previous: Iterable[Condition],
    now: str,
    generation: int | None,
) -> Condition:
    status = "True" if ok else "False"
    last = now
    for prev in previous:
        if prev.type == ctype and prev.status == status:
            last = prev.last_transition_time
    return Condition.model_validate(
        {
            "type": ctype,
            "status": status,
            "reason": reason_ok if ok else reason_bad,
            "message": message,
            "lastTransitionTime": last,
            "observedGeneration": generation,
        }
    )


def _line(problem: Problem) -> str:
    return f"{problem.path}: {problem.message} (fix: {problem.fix})"


def _summary(problems: list[Problem]) -> str:
    return "; ".join(_line(p) for p in problems)[:4000]


def conditions(
    problems: list[Problem],
    ready: int,
    desired: int,
    previous: list[Condition],
    now: str,
    generation: int | None,
    blocked_by: list[Problem] | None = None,
) -> list[Condition]:
    """The six conditions from the problems of this resource and its observed readiness;
    ``blocked_by``: errors of other resources of the domain (while there are any, nothing of
    the domain is applied, so a valid resource is not ready and not rolling out either)."""
    errs = errors(problems)
    seed = [p for p in errs if p.rule in _SEED_RULES]
    ports = [p for p in errs if p.rule in _PORT_RULES]
    valid = not errs
    blocked = errors(blocked_by or []) if valid else []
    # A PD pair with one side scaled to zero runs instances but serves nothing.
    incomplete = [p for p in problems if p.code == "pd.half-scaled"]
    all_ready = valid and not blocked and not incomplete and ready >= desired
    progressing = valid and not blocked and ready < desired
    if not valid:
        ready_reason, ready_message = "InvalidSpec", _summary(errs)
    elif blocked:
        others = sorted({p.resource for p in blocked})
        ready_reason = "DomainInvalid"
        ready_message = (
            f"nothing of this domain is applied while {', '.join(others)} "
            f"{'is' if len(others) == 1 else 'are'} invalid (existing children are kept): "
            + _summary(blocked)
        )[:4000]
    elif incomplete:
        ready_reason, ready_message = "PairIncomplete", _summary(incomplete)
    else:
        ready_reason, ready_message = "InstancesNotReady", f"{ready}/{desired} instances ready"
    if desired == 0 and valid and not blocked:
        ready_message = "scaled to zero (replicas: 0): no instances run; raise replicas to serve"
    degraded = not valid or bool(blocked) or (0 < ready < desired)
    if not valid or blocked:
        degraded_reason, degraded_message = ready_reason, ready_message
    else:
        degraded_reason = "InstancesUnavailable"
        degraded_message = f"{ready}/{desired} ready" if degraded else ""

    def cond(ctype: str, ok: bool, good: str, bad: str, message: str) -> Condition:
        return _condition(ctype, ok, good, bad, message, previous, now, generation)

    return [
        cond(
            "Ready",
            all_ready,
            "ScaledToZero" if desired == 0 else "AllInstancesReady",
            ready_reason,
            ready_message,
        ),
        cond(
            "Progressing",
            progressing,
            "RollingOut",
            "Stable" if valid and not blocked else "Blocked",
            f"waiting for {desired - ready} instance(s)" if progressing else "",
        ),
        cond(
            "Degraded",
            degraded,
            degraded_reason,
            "AsExpected",
            degraded_message,
        ),
        cond("ConfigValid", valid, "Valid", "InvalidSpec", _summary(errs)),
        cond("HashSeedConsistent", not seed, "OneSeedPerDomain", "DomainMismatch", _summary(seed)),
        cond("PortsConsistent", not ports, "Allocated", "PortConflict", _summary(ports)),
    ]


def _tensor_parallel(member: P2PGroup | PDPair) -> str:
    if isinstance(member, P2PGroup):
        return str(member.spec.tensor_parallel_size)
    return f"{member.spec.prefill.tensor_parallel_size}/{member.spec.decode.tensor_parallel_size}"


def member_status(
    pool: KVCachePool,
    member: P2PGroup | PDPair,
    problems: list[Problem],
    ready_instances: set[str],
    now: str,
    previous: MemberStatus | None = None,
) -> MemberStatus:
    """Status of a P2PGroup / PDPair; ``problems`` are the domain's, filtered to this member."""
    mine = key(member)
    own = [p for p in problems if p.resource == mine]
    others = [p for p in problems if p.resource != mine]
    fp = pool_fingerprint(pool)
    ns = pool.metadata.namespace
    instances = [
        InstanceStatus(
            name=inst.name,
            role=inst.role,
            lmcache_instance_id=instance_id(inst.name, fp),
            ready=inst.name in ready_instances,
            http_port=inst.http,
            ports=inst.lists,
        )
        for inst in member_instances(member)
    ]
    ready = sum(1 for i in instances if i.ready)
    return MemberStatus(
        observed_generation=member.metadata.generation,
        pool=member.spec.pool_ref.name,
        tensor_parallel=_tensor_parallel(member),
        conditions=conditions(
            own,
            ready,
            len(instances),
            previous.conditions if previous else [],
            now,
            member.metadata.generation,
            blocked_by=others,
        ),
        domain_fingerprint=fp,
        instances_ready=ready,
        instances_desired=len(instances),
        instances=instances,
        endpoints=[instance_url(i.name, ns, i.http_port) for i in instances],
        memory_budget=member_memory_budget(pool, member),
        warnings=[_line(p) for p in warnings(own)],
        defaults=[str(d) for d in member_defaults(member)],
    )


def pool_status(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    problems: list[Problem],
    ready_instances: set[str],
    now: str,
    previous: KVCachePoolStatus | None = None,
) -> KVCachePoolStatus:
    """Status of a KVCachePool: the whole domain's conditions, seed, endpoints and budgets."""
    all_insts = [i.name for m in members for i in member_instances(m)]
    ready = sum(1 for name in all_insts if name in ready_instances)
    ordered = sorted(members, key=lambda m: (m.kind, m.metadata.name))
    return KVCachePoolStatus(
        observed_generation=pool.metadata.generation,
        conditions=conditions(
            problems,
            ready,
            len(all_insts),
            previous.conditions if previous else [],
            now,
            pool.metadata.generation,
        ),
        resolved_hash_seed=resolve_hash_seed(pool),
        domain_fingerprint=pool_fingerprint(pool),
        controller_endpoint=names.controller_url(pool),
        gateway_endpoint=names.gateway_url(pool),
        members=[f"{m.kind}/{m.metadata.name}" for m in ordered],
        member_count=len(ordered),
        instances_ready=ready,
        instances_desired=len(all_insts),
        memory_budget={
            f"{m.kind}/{m.metadata.name}": member_memory_budget(pool, m) for m in ordered
        },
        warnings=[_line(p) for p in warnings(problems)],
        defaults=[str(d) for d in domain_defaults(pool, members)],
    )


def set_condition(
    current: list[Condition],
    ctype: str,
    ok: bool,
    reasons: tuple[str, str],
    message: str,
    previous: list[Condition],
    now: str,
    generation: int | None,
) -> list[Condition]:
    """``current`` with condition ``ctype`` replaced (added when it has none) by an observation
    made outside validation (the operator's drift check, a missing pool, a blocked deletion,
    the live figures); ``reasons`` is (when ok, when not). lastTransitionTime is kept when the
    status did not change."""
    new = _condition(ctype, ok, reasons[0], reasons[1], message, previous, now, generation)
    if all(c.type != ctype for c in current):
        return [*current, new]
    return [new if c.type == ctype else c for c in current]


def summary(problems: list[Problem]) -> str:
    """The one-line form of ``problems`` that condition messages carry."""
    return _summary(problems)
