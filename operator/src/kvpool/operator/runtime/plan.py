"""Pure planning of one domain reconcile: observed cluster objects in, writes and statuses out.

Why: everything the operator decides — which children to create, patch or prune, each
resource's status, which Events to post — is a function of what it read. Keeping that function
free of I/O (and of kopf) lets the unit tests drive every branch, and leaves the reconcile loop
(reconcile.py) with nothing but reads, this call and writes. It reuses the loader, validation,
render and status code; it never re-derives what those compute.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvpool.operator import status as status_code
from kvpool.operator.api import kinds
from kvpool.operator.api.common import Condition
from kvpool.operator.api.members import MemberStatus, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool, KVCachePoolStatus
from kvpool.operator.derive import names
from kvpool.operator.derive.instances import member_instances
from kvpool.operator.figures import Health
from kvpool.operator.loader import LoadError, parse_document
from kvpool.operator.render import render_domain
from kvpool.operator.render.pool_objects import instance_ids
from kvpool.operator.runtime.drift import Drift, observe
from kvpool.operator.validation import errors, validate_domain
from kvpool.operator.validation.problems import Problem
from kvpool.protocol.http_api import CONTROLLER_TOKEN_KEY

Obj = dict[str, Any]
Member = P2PGroup | PDPair
#: kopf.adopt in production: sets ownerReferences (and namespace) of children to their owner
#: (called once per owner with all of its children: building the reference is the costly part).
Adopt = Callable[[list[Obj], Obj], None]


def domain_selector(pool_name: str) -> dict[str, str]:
    """Labels every child of one domain carries (what the reconcile lists and prunes)."""
    return {**names.MANAGED_BY, names.LABEL_POOL: pool_name}


@dataclass
class Observed:
    """What the reconcile read for one domain (namespace + pool name)."""

    namespace: str
    pool_name: str
    pool: Obj | None
    members: list[Obj]
    children: list[Obj] = field(default_factory=list)
    pods: list[Obj] = field(default_factory=list)
    #: FiguresCurrent as the live-figures poller last found it (None: not polled yet).
    figures: Health | None = None
    #: A random token the glue drew for this pass: the domain's controller API token if its
    #: Secret does not exist yet (never used once the Secret holds one).
    fresh_token: str | None = None
    #: The operator's own namespace (its pods are a NetworkPolicy peer); None: unknown.
    operator_namespace: str | None = None


@dataclass(frozen=True)
class ControllerTarget:
    """Where the operator calls a domain's controller, and with which token."""

    service: str
    port: int
    token: str | None


@dataclass(frozen=True)
class AllowlistPush:
    """The instance ids the domain's running controller must allow before the pass creates
    the pods that carry new ones."""

    target: ControllerTarget
    instance_ids: tuple[str, ...]


@dataclass
class Plan:
    """The writes of one reconcile and what each resource's handler should report."""

    create: list[Obj] = field(default_factory=list)
    patch: list[tuple[Obj, Obj]] = field(default_factory=list)  # (current, merge patch)
    delete: list[Obj] = field(default_factory=list)
    statuses: list[tuple[Obj, Obj]] = field(default_factory=list)  # (resource, status patch)
    events: list[tuple[Obj, str, str, str]] = field(default_factory=list)
    #: "Kind/name" -> that resource's own errors (its handler raises PermanentError on them).
    invalid: dict[str, list[Problem]] = field(default_factory=dict)
    seed: str | None = None
    #: Set when the controller is ready: what it must allow (sent before the writes that
    #: create worker pods).
    allowlist: AllowlistPush | None = None


def json_copy(value: Any) -> Any:
    """A deep copy of JSON data (dicts, lists, scalars), several times cheaper than deepcopy."""
    if isinstance(value, dict):
        return {k: json_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_copy(v) for v in value]
    return value


def ref(body: Obj) -> str:
    return f"{body['kind']}/{body['metadata']['name']}"


def parse_body(body: Obj, seed: str | None) -> KVCachePool | Member | LoadError:
    """A CR as the cluster holds it, into its model (status dropped but for the kept seed)."""
    doc: Obj = {k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body}
    if body.get("kind") == kinds.POOL.kind and seed:
        doc["status"] = kinds.seed_status(seed)
    name = (body.get("metadata") or {}).get("name", "?")
    return parse_document(doc, f"{body.get('kind')}/{name}")


def _parse(body: Obj, seed: str | None) -> KVCachePool | Member | Problem:
    parsed = parse_body(body, seed)
    if isinstance(parsed, LoadError):
        return Problem(f"{ref(body)}: spec", parsed.message, parsed.fix)
    return parsed


def _component_child(children: list[Obj], kind: str, component: str) -> list[Obj]:
    return [
        c
        for c in children
        if c.get("kind") == kind
        and c["metadata"].get("labels", {}).get(names.LABEL_COMPONENT) == component
    ]


def stored_seed(pool: Obj, children: list[Obj]) -> str | None:
    """The seed already in use: status first, then the domain ConfigMap (status can be lost)."""
    from_status = kinds.stored_seed(pool)
    if from_status:
        return from_status
    for child in _component_child(children, "ConfigMap", "domain"):
        seed = (child.get("data") or {}).get("PYTHONHASHSEED")
        if seed:
            return str(seed)
    return None


def stored_token(children: list[Obj]) -> str | None:
    """The domain's controller API token as its Secret holds it (generated once, kept)."""
    for secret in _component_child(children, "Secret", "controller"):
        value = (secret.get("data") or {}).get(CONTROLLER_TOKEN_KEY)
        if value:
            try:
                return base64.b64decode(value, validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                return None  # not ours to read: the render writes a new token over it
    return None


def controller_ready(children: list[Obj]) -> bool:
    """Whether the domain's controller Deployment reports a ready replica."""
    return any(
        int((d.get("status") or {}).get("readyReplicas") or 0) > 0
        for d in _component_child(children, "Deployment", "controller")
    )


def previous_conditions(body: Obj) -> list[Condition]:
    out = []
    for raw in (body.get("status") or {}).get("conditions") or []:
        try:
            out.append(Condition.model_validate(raw))
        except ValidationError:
            continue
    return out


def subset(want: Any, have: Any) -> bool:
    """Whether ``have`` already holds ``want`` (the server may add defaults around it).

    Equality first: it is decided in C, at once where nothing was added (a dict with added
    keys differs in length); only subtrees that differ are walked."""
    if want == have:
        return True
    if isinstance(want, dict):
        return isinstance(have, dict) and all(subset(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return False


def _key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _stale_data(obj: Obj, current: Obj) -> dict[str, None]:
    """Keys of a rendered ConfigMap's ``data`` the live object still has but the render no
    longer does (an instance scaled away): a merge patch removes them only when named null."""
    if obj.get("kind") != "ConfigMap":
        return {}
    return {k: None for k in (current.get("data") or {}) if k not in (obj.get("data") or {})}


def diff_children(desired: list[Obj], existing: list[Obj], plan: Plan) -> None:
    """Create what is missing, patch what differs (a ConfigMap's data to exactly the render),
    prune what carries our labels but is gone."""
    have = {_key(o): o for o in existing}
    want = {_key(o) for o in desired}
    for obj in desired:
        current = have.get(_key(obj))
        body = {k: v for k, v in obj.items() if k != "status"}
        if current is None:
            plan.create.append(obj)
            continue
        stale = _stale_data(obj, current)
        if stale:
            body["data"] = {**(body.get("data") or {}), **stale}
        if stale or not subset(body, current):
            plan.patch.append((current, body))
    for key, obj in sorted(have.items()):
        if key not in want and not obj["metadata"].get("deletionTimestamp"):
            plan.delete.append(obj)


def ready_instances(children: list[Obj]) -> set[str]:
    """Instances whose StatefulSet reports its pod ready for the current template."""
    out = set()
    for obj in children:
        if obj.get("kind") != "StatefulSet":
            continue
        st = obj.get("status") or {}
        gen = obj["metadata"].get("generation")
        current = gen is None or st.get("observedGeneration", gen) >= gen
        if current and int(st.get("readyReplicas") or 0) >= int(obj["spec"].get("replicas", 1)):
            out.add(obj["metadata"]["name"])
    return out


def ready_pd_pairs(members: list[Member], ready: set[str]) -> frozenset[str]:
    """PDPairs whose every prefill and decode instance is ready (announced to the gateway)."""
    return frozenset(
        m.metadata.name
        for m in members
        if isinstance(m, PDPair) and all(i.name in ready for i in member_instances(m))
    )


def _status_patch(body: Obj, new: KVCachePoolStatus | MemberStatus, plan: Plan) -> None:
    dumped = new.model_dump(by_alias=True, exclude_none=True, mode="json")
    if not subset(dumped, body.get("status") or {}):
        plan.statuses.append((body, dumped))


def _invalid_event(body: Obj, problems: list[Problem], reason: str, plan: Plan) -> None:
    """One Warning Event per new set of problems (not one per reconcile)."""
    message = "\n".join(str(p) for p in problems)
    old = {c.type: c for c in previous_conditions(body)}.get("ConfigValid")
    if old is None or old.status != "False" or old.message != status_code.summary(problems):
        plan.events.append((body, "Warning", reason, message))


def _adjust(
    conds: list[Condition],
    drift: Drift,
    previous: list[Condition],
    now: str,
    generation: int | None,
) -> list[Condition]:
    """Overlay what the operator observed on running pods onto the validation conditions."""
    stale = f"{len(drift.stale)} pod(s) not yet on the current domain rollout: " + ", ".join(
        drift.stale[:10]
    )
    overlays = [
        (drift.seed, "HashSeedConsistent", False, ("OneSeedPerDomain", "PodSeedMismatch")),
        (drift.ports, "PortsConsistent", False, ("Allocated", "PodPortsMismatch")),
        (drift.stale, "Progressing", True, ("RollingOut", "Stable")),
    ]
    for found, ctype, ok, reasons in overlays:
        if found:
            message = stale if ctype == "Progressing" else "; ".join(found)
            conds = status_code.set_condition(
                conds, ctype, ok, reasons, message, previous, now, generation
            )
    return conds


def _not_found_status(body: Obj, observed: Observed, now: str, plan: Plan) -> None:
    problem = Problem(
        f"{ref(body)}: spec.poolRef.name",
        f"KVCachePool {observed.pool_name!r} does not exist in namespace {observed.namespace!r}",
        f"create KVCachePool {observed.pool_name} in {observed.namespace}, or point "
        "spec.poolRef.name at an existing pool (a pool in another namespace cannot be used)",
    )
    previous = previous_conditions(body)
    gen = body["metadata"].get("generation")
    conds = status_code.conditions([problem], 0, 0, previous, now, gen)
    for ctype in ("Ready", "ConfigValid"):
        conds = status_code.set_condition(
            conds, ctype, False, ("Valid", "PoolNotFound"), problem.message, previous, now, gen
        )
    new = MemberStatus(observed_generation=gen, conditions=conds, pool=observed.pool_name)
    _status_patch(body, new, plan)
    old = {c.type: c for c in previous}.get("Ready")
    if old is None or old.reason != "PoolNotFound":
        plan.events.append((body, "Warning", "PoolNotFound", f"{problem}"))


def plan_domain(observed: Observed, now: str, adopt: Adopt) -> Plan:
    """Everything one reconcile of a domain writes (see the module docstring)."""
    plan = Plan()
    live = [m for m in observed.members if not m["metadata"].get("deletionTimestamp")]
    if observed.pool is None:
        for body in live:
            _not_found_status(body, observed, now, plan)
        return plan
    pool_body = observed.pool
    plan.seed = stored_seed(pool_body, observed.children)
    pool = _parse(pool_body, plan.seed)
    parsed: list[tuple[Obj, Member]] = []
    problems: list[Problem] = []
    for body in live:
        result = _parse(body, None)
        if isinstance(result, Problem):
            problems.append(result)
        elif isinstance(result, P2PGroup | PDPair):
            parsed.append((body, result))
    if isinstance(pool, Problem):
        problems.append(pool)
        plan.invalid = _by_resource(errors(problems))
        for body in [pool_body, *live]:
            own = plan.invalid.get(ref(body), [])
            _invalid_status(body, own, pool_body, now, plan)
        return plan
    assert isinstance(pool, KVCachePool)
    members = [m for _, m in parsed]
    problems += validate_domain(pool, members)
    plan.invalid = _by_resource(errors(problems))
    ready = ready_instances(observed.children)
    owners = {body["metadata"]["name"]: body for body, _ in parsed}
    token = stored_token(observed.children) or observed.fresh_token
    desired = render_domain(
        pool,
        members,
        ready_pd_pairs(members, ready),
        api_token=token,
        operator_namespace=observed.operator_namespace,
    )
    if controller_ready(observed.children):
        target = ControllerTarget(
            names.controller_name(pool), pool.spec.controller.ports.http, token
        )
        plan.allowlist = AllowlistPush(target, tuple(instance_ids(pool, members)))
    by_owner: dict[str, list[Obj]] = {}
    for obj in desired:
        member = obj["metadata"].get("labels", {}).get(names.LABEL_MEMBER)
        by_owner.setdefault(member if member in owners else "", []).append(obj)
    for owner, children in by_owner.items():
        adopt(children, owners[owner] if owner else pool_body)
    if not plan.invalid:
        diff_children(desired, observed.children, plan)
    drift = observe(observed.pods, desired)
    for body in [pool_body, *live]:
        own = plan.invalid.get(ref(body), [])
        if own:
            _invalid_event(body, own, "InvalidSpec", plan)
    previous = KVCachePoolStatus(conditions=previous_conditions(pool_body))
    pool_st = status_code.pool_status(pool, members, problems, ready, now, previous)
    pool_st.conditions = _adjust(
        pool_st.conditions, drift, previous_conditions(pool_body), now, pool.metadata.generation
    )
    if observed.figures is not None:
        h = observed.figures
        pool_st.conditions = status_code.set_condition(
            pool_st.conditions,
            "FiguresCurrent",
            h.ok,
            (h.reason, h.reason),
            h.message,
            previous_conditions(pool_body),
            now,
            pool.metadata.generation,
        )
    plan.seed = pool_st.resolved_hash_seed
    _status_patch(pool_body, pool_st, plan)
    for body, member in parsed:
        prev = previous_conditions(body)
        st = status_code.member_status(
            pool, member, problems, ready, now, MemberStatus(conditions=prev)
        )
        st.conditions = _adjust(
            st.conditions, drift.only(member.metadata.name), prev, now, member.metadata.generation
        )
        _status_patch(body, st, plan)
    return plan


def _by_resource(problems: list[Problem]) -> dict[str, list[Problem]]:
    out: dict[str, list[Problem]] = {}
    for p in problems:
        out.setdefault(p.resource, []).append(p)
    return out


def _invalid_status(body: Obj, own: list[Problem], pool_body: Obj, now: str, plan: Plan) -> None:
    """Status of a resource in a domain whose pool spec cannot even be read."""
    problems = own or [
        Problem(
            f"{ref(body)}: spec.poolRef.name",
            f"the spec of {ref(pool_body)} is invalid, so this domain is not reconciled",
            f"fix {ref(pool_body)} (kubectl describe kvcachepool {pool_body['metadata']['name']})",
        )
    ]
    gen = body["metadata"].get("generation")
    conds = status_code.conditions(problems, 0, 0, previous_conditions(body), now, gen)
    new: KVCachePoolStatus | MemberStatus = (
        KVCachePoolStatus(observed_generation=gen, conditions=conds)
        if body["kind"] == "KVCachePool"
        else MemberStatus(observed_generation=gen, conditions=conds)
    )
    _status_patch(body, new, plan)
    if own:
        _invalid_event(body, own, "InvalidSpec", plan)


def deletion_blocked(pool_body: Obj, members: list[Obj], now: str) -> tuple[Obj, str]:
    """Status patch and Event message of a pool whose deletion waits for its members."""
    names_ = ", ".join(sorted(ref(m) for m in members))
    message = (
        f"deletion waits until the pool has no members; still here: {names_} "
        "(delete them first: their workers need the controller and gateway)"
    )
    previous = previous_conditions(pool_body)
    gen = pool_body["metadata"].get("generation")
    base = list(previous) or status_code.conditions([], 0, 0, [], now, gen)
    conds = status_code.set_condition(
        base, "Ready", False, ("AllInstancesReady", "DeletionBlocked"), message, previous, now, gen
    )
    status = KVCachePoolStatus(conditions=conds)
    return status.model_dump(by_alias=True, exclude_none=True, include={"conditions"}), message


@dataclass(frozen=True)
class Deregistration:
    """What a member's finalizer tells the pool's controller."""

    target: ControllerTarget
    instance_ids: list[str]


def deregistration(pool_body: Obj, member_body: Obj, children: list[Obj]) -> Deregistration | None:
    """The controller Service, its token (``children``: the domain's, with its Secret) and the
    LMCache instance ids of a member being deleted."""
    pool = _parse(pool_body, kinds.stored_seed(pool_body))
    member = _parse(member_body, None)
    if not isinstance(pool, KVCachePool) or not isinstance(member, P2PGroup | PDPair):
        return None
    target = ControllerTarget(
        names.controller_name(pool), pool.spec.controller.ports.http, stored_token(children)
    )
    return Deregistration(target, instance_ids(pool, [member]))
