"""Pure admission decisions: which problems a create, update or delete would introduce.

Why: ``kubectl apply`` of a bad CR must be refused with the same messages ``kvpool-operator
validate`` prints. A member is checked together with its pool and the pool's other members
(rules 2-4 span resources), and only the errors the change *introduces* refuse it — a domain
that is already broken elsewhere must still accept the edit that fixes it. No I/O, no kopf:
the kopf handler (handlers.py) passes in what the operator's indexes hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.operator.api import kinds
from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.loader import LoadError
from kvpool.operator.runtime.plan import parse_body
from kvpool.operator.validation import errors, validate_domain
from kvpool.operator.validation.problems import Problem

Obj = dict[str, Any]
Member = P2PGroup | PDPair


@dataclass
class Verdict:
    """Refused when ``problems`` is not empty; ``warnings`` go back to kubectl either way."""

    problems: list[Problem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.problems

    def message(self) -> str:
        return "\n".join(str(p) for p in self.problems)


def _parse(body: Obj) -> KVCachePool | Member | LoadError:
    return parse_body(body, kinds.stored_seed(body))


def _load_problem(err: LoadError) -> Problem:
    return Problem(err.source, err.message, err.fix)


def _members(bodies: list[Obj], skip: tuple[str, str] | None) -> list[Member]:
    out: list[Member] = []
    for body in bodies:
        if skip == (body.get("kind"), body["metadata"]["name"]):
            continue
        parsed = _parse(body)
        if isinstance(parsed, P2PGroup | PDPair):
            out.append(parsed)
    return out


def _introduced(before: list[Problem], after: list[Problem]) -> list[Problem]:
    seen = {str(p) for p in before}
    return [p for p in errors(after) if str(p) not in seen]


def review(
    operation: str,
    new: Obj | None,
    old: Obj | None,
    pool: Obj | None,
    members: list[Obj],
) -> Verdict:
    """Decide one AdmissionReview.

    ``new``/``old``: the object after/before the operation; ``pool``: the pool the object
    names (for a member) or the stored pool (for a pool); ``members``: the pool's members as
    stored (the one under review included or not — it is replaced either way).
    """
    subject = new if new is not None else old
    if subject is None:
        return Verdict()
    kind = subject.get("kind")
    if operation == "DELETE":
        if kind == "KVCachePool" and members:
            names = ", ".join(sorted(f"{m['kind']}/{m['metadata']['name']}" for m in members))
            name = subject["metadata"]["name"]
            return Verdict(
                [
                    Problem(
                        f"KVCachePool/{name}: metadata",
                        f"the pool still has members ({names}); deleting it would stop their "
                        "controller and gateway under them",
                        "delete the members first (kubectl delete p2pgroup,pdpair -l ... or by "
                        "name), then the pool",
                    )
                ]
            )
        return Verdict()
    assert new is not None
    parsed = _parse(new)
    if isinstance(parsed, LoadError):
        return Verdict([_load_problem(parsed)])
    if isinstance(parsed, KVCachePool):
        others = _members(members, None)
        after = validate_domain(parsed, others)
        before: list[Problem] = []
        if old is not None and isinstance(old_pool := _parse(old), KVCachePool):
            before = validate_domain(old_pool, others)
        return Verdict(_introduced(before, after))
    if pool is None:
        ref = parsed.spec.pool_ref.name
        return Verdict(
            warnings=[
                f"KVCachePool {ref!r} does not exist in namespace {parsed.metadata.namespace!r} "
                "yet: this resource stays PoolNotFound (no workers) until it does"
            ]
        )
    pool_model = _parse(pool)
    if not isinstance(pool_model, KVCachePool):
        return Verdict(warnings=[f"the pool {pool['metadata']['name']} is itself invalid"])
    others = _members(members, (parsed.kind, parsed.metadata.name))
    after = validate_domain(pool_model, [*others, parsed])
    before = validate_domain(pool_model, others)
    if old is not None and isinstance(old_member := _parse(old), P2PGroup | PDPair):
        before = validate_domain(pool_model, [*others, old_member])
    return Verdict(_introduced(before, after))
