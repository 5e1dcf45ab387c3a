"""Ports and names (rules 2 and 3): per-rank lists of TP entries, no port bound twice where
pods share a node, and no two resources rendering objects (or instance ids) of one name.

Why: the seed manual's most frequent breakage is a port list whose length differs from the TP
size or two instances binding one port; LMCache then fails far from the cause.
"""

from __future__ import annotations

from collections import Counter

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.instances import member_instances
from kvpool.operator.derive.platform import pd_bypass_ratio
from kvpool.operator.derive.ports import member_port_range, pd_decoder_worker_ports
from kvpool.operator.validation.problems import (
    Patch,
    Problem,
    key,
    remove_field,
    set_field,
    where,
)

Members = list[P2PGroup | PDPair]

MIN_BASE, MAX_BASE, MAX_PORT = 1024, 65000, 65535


def _explicit(member: P2PGroup | PDPair) -> bool:
    return isinstance(member, P2PGroup) and member.spec.ports.instances is not None


def _free_base(span: int, taken: list[tuple[int, int]], current: int) -> int | None:
    """A base for a range of ``span`` ports overlapping none of ``taken`` (prefer >= current)."""
    candidates = sorted({MIN_BASE, current, *(hi + 1 for _, hi in taken)})
    candidates.sort(key=lambda c: (c < current, c))
    for base in candidates:
        end = base + span
        fits = MIN_BASE <= base <= MAX_BASE and end <= MAX_PORT
        if fits and all(end < lo or base > hi for lo, hi in taken):
            return base
    return None


def _explicit_lists(member: P2PGroup, out: list[Problem]) -> None:
    spec = member.spec
    explicit = spec.ports.instances or []
    drop = (remove_field(member, "spec.ports.instances"),)
    if len(explicit) != spec.replicas:
        out.append(
            Problem(
                where(member, "spec.ports.instances"),
                f"{len(explicit)} explicit port sets for {spec.replicas} replicas",
                "remove ports.instances and let kvpool allocate from ports.base, or give one "
                "entry per instance",
                rule=2,
                code="ports.explicit-count",
                patch=drop,
            )
        )
    for i, ports in enumerate(explicit):
        lists = [
            ("workerPorts", ports.worker_ports),
            ("initPorts", ports.init_ports),
            ("lookupPorts", ports.lookup_ports),
        ]
        if not spec.p2p:
            lists = lists[:1]
        for name, values in lists:
            if len(values) != spec.tensor_parallel_size:
                out.append(
                    Problem(
                        where(member, f"spec.ports.instances[{i}].{name}"),
                        f"has {len(values)} ports but tensorParallelSize is "
                        f"{spec.tensor_parallel_size}: LMCache indexes it by TP rank",
                        "remove ports.instances (kvpool allocates per rank), or list exactly "
                        f"{spec.tensor_parallel_size} ports",
                        rule=2,
                        code="ports.explicit-length",
                        patch=drop,
                    )
                )


def _unbound(member: P2PGroup, drop: set[str], message: str, fix: str, code: str) -> Problem:
    """Explicit ports nothing binds; the patch keeps ports.instances without ``drop``."""
    explicit = member.spec.ports.instances or []
    kept = [p.model_dump(by_alias=True, exclude=drop, exclude_none=True) for p in explicit]
    patch = (set_field(member, "spec.ports.instances", kept),)
    return Problem(
        where(member, "spec.ports.instances"), message, fix, rule=2, code=code, patch=patch
    )


def _unused_p2p_lists(member: P2PGroup, out: list[Problem]) -> None:
    """Explicit P2P port lists of a group with ``p2p: false``: bound by nothing."""
    explicit = member.spec.ports.instances or []
    if member.spec.p2p or not any(p.init_ports or p.lookup_ports for p in explicit):
        return
    out.append(
        _unbound(
            member,
            {"init_ports", "lookup_ports"},
            "lists initPorts/lookupPorts, but a group with p2p: false binds no P2P ports",
            "remove initPorts and lookupPorts from ports.instances, or set p2p: true",
            "ports.explicit-p2p",
        )
    )


def _explicit_kv_events(member: P2PGroup, out: list[Problem]) -> None:
    """Explicit ports and engine.kvEvents: every entry names both KV-event ports, or none does
    when the engine publishes no events."""
    explicit = member.spec.ports.instances or []
    if member.spec.engine.kv_events:
        missing = [
            i for i, p in enumerate(explicit) if p.kv_events is None or p.kv_events_replay is None
        ]
        if missing:
            out.append(
                Problem(
                    where(member, f"spec.ports.instances[{missing[0]}]"),
                    f"engine.kvEvents is on but ports.instances {missing} do not name both "
                    "kvEvents and kvEventsReplay: the instance would publish on no port",
                    "give every entry of ports.instances kvEvents and kvEventsReplay, or remove "
                    "ports.instances and let kvpool allocate them from ports.base",
                    rule=2,
                    code="ports.explicit-kv-events",
                    patch=(remove_field(member, "spec.ports.instances"),),
                )
            )
        return
    if not any(p.kv_events is not None or p.kv_events_replay is not None for p in explicit):
        return
    out.append(
        _unbound(
            member,
            {"kv_events", "kv_events_replay"},
            "lists kvEvents/kvEventsReplay, but the engine publishes no KV events "
            "(engine.kvEvents is false)",
            "remove kvEvents and kvEventsReplay from ports.instances, or set engine.kvEvents: true",
            "ports.explicit-kv-events-unused",
        )
    )


def rule2_ports(pool: KVCachePool, members: Members) -> list[Problem]:
    """Per-rank lists have exactly TP entries; no port is bound twice where pods share a node."""
    out: list[Problem] = []
    for member in members:
        if isinstance(member, P2PGroup) and _explicit(member):
            _explicit_lists(member, out)
            _unused_p2p_lists(member, out)
            _explicit_kv_events(member, out)
        every = [p for inst in member_instances(member) for p in inst.all_ports()]
        dupes = sorted(p for p, n in Counter(every).items() if n > 1)
        if dupes:
            out.append(
                Problem(
                    where(member, "spec.ports"),
                    f"ports {dupes} are used more than once",
                    "remove ports.instances and let kvpool allocate from ports.base, or give "
                    "every instance and rank distinct ports",
                    rule=2,
                    code="ports.duplicate",
                    patch=(remove_field(member, "spec.ports.instances"),),
                )
            )
        high = max(every, default=0)
        if high > MAX_PORT:
            patch: tuple[Patch, ...]
            if _explicit(member):
                fix, patch = "list ports of at most 65535", ()
            else:
                base = member.spec.ports.base - (high - MAX_PORT)
                ok = base >= MIN_BASE
                fix = f"set ports.base: {base}" if ok else "lower the number of replicas"
                patch = (set_field(member, "spec.ports.base", base),) if ok else ()
            out.append(
                Problem(
                    where(member, "spec.ports.base"),
                    f"the allocated range ends at {high}, beyond {MAX_PORT}",
                    fix,
                    rule=2,
                    code="ports.range",
                    patch=patch,
                )
            )
    out += _host_network_overlaps(members)
    out += _proxy_ports(pool, members)
    out += _bypass_decoders(pool, members)
    return out


BYPASS_FIELD = "spec.gateway.pd.bypassMinCachedRatio"


def _bypass_decoders(pool: KVCachePool, members: Members) -> list[Problem]:
    """With the gateway's PD bypass on, each decoder that keeps its requests registers with the
    controller on ports at the end of its block (``pd_decoder_worker_ports``): refused where the
    block has no room for one per TP rank. A pair whose decoders run vLLM keeps nothing and is
    never bypassed: a warning."""
    out: list[Problem] = []
    if not pool.spec.gateway.pd.bypass_min_cached_ratio:
        return out
    for pair in sorted(
        (m for m in members if isinstance(m, PDPair)), key=lambda m: m.metadata.name
    ):
        name = pair.metadata.name
        if pd_bypass_ratio(pool, pair) == 0:
            out.append(
                Problem(
                    where(pool, BYPASS_FIELD),
                    f"PDPair {name!r}'s decoders run vLLM (platform "
                    f"{pair.spec.decode.engine.platform}), whose PD consumer keeps no KV: its "
                    "requests always go through prefill",
                    "nothing to do if intended; the bypass needs decoders on kvpool's reference "
                    "engine (platform cpu)",
                    rule=2,
                    severity="warning",
                    code="pd.bypass_vllm",
                )
            )
            continue
        decoders = [i for i in member_instances(pair) if i.role == "decode"]
        if decoders and pd_decoder_worker_ports(pair, decoders[0]) is None:
            tp = pair.spec.decode.tensor_parallel_size
            out.append(
                Problem(
                    where(pool, BYPASS_FIELD),
                    f"PDPair {name!r}: a decoder of tensorParallelSize {tp} has no ports left "
                    "in its block for its controller registration (lmcache_worker_ports, one "
                    "per TP rank), which the bypass needs",
                    f"unset {BYPASS_FIELD}, or lower PDPair {name!r}'s "
                    "spec.decode.tensorParallelSize",
                    rule=2,
                    code="pd.bypass_ports",
                    patch=(remove_field(pool, BYPASS_FIELD),),
                )
            )
    return out


def _host_network_overlaps(members: Members) -> list[Problem]:
    out: list[Problem] = []
    shared = [m for m in members if m.spec.host_network and member_instances(m)]
    ranges = {key(m): member_port_range(m) for m in shared}
    for i, a in enumerate(shared):
        for b in shared[i + 1 :]:
            (a_lo, a_hi), (b_lo, b_hi) = ranges[key(a)], ranges[key(b)]
            if not (a_lo <= b_hi and b_lo <= a_hi):
                continue
            mover, other = (a, b) if _explicit(b) and not _explicit(a) else (b, a)
            lo, hi = ranges[key(mover)]
            o_lo, o_hi = ranges[key(other)]
            patch: tuple[Patch, ...]
            message = (
                f"port range {lo}-{hi} overlaps {key(other)}'s {o_lo}-{o_hi}; with hostNetwork "
                "both can land on one node"
            )
            if _explicit(mover):
                fix, patch = f"choose explicit ports outside {o_lo}-{o_hi}", ()
            else:
                taken = [r for k, r in ranges.items() if k != key(mover)]
                base = _free_base(hi - lo, taken, mover.spec.ports.base)
                fix = (
                    f"set ports.base: {base} (a range free of every hostNetwork member)"
                    if base is not None
                    else "run fewer hostNetwork members per pool, or fewer replicas"
                )
                patch = (set_field(mover, "spec.ports.base", base),) if base is not None else ()
            out.append(
                Problem(
                    where(mover, "spec.ports.base"),
                    message,
                    fix,
                    rule=2,
                    code=f"ports.overlap:{key(other)}",
                    patch=patch,
                )
            )
    return out


def _proxy_ports(pool: KVCachePool, members: Members) -> list[Problem]:
    """Every PD pair's proxy port is its own port on the gateway."""
    out: list[Problem] = []
    pairs = sorted((m for m in members if isinstance(m, PDPair)), key=lambda m: m.metadata.name)
    taken = {pool.spec.gateway.port}
    used = {pool.spec.gateway.port} | {p.spec.proxy.port for p in pairs}
    for pair in pairs:
        port = pair.spec.proxy.port
        if port in taken:
            free = next(p for p in range(7500, 65536) if p not in used)
            used.add(free)
            what = "the gateway's HTTP port" if port == pool.spec.gateway.port else "taken"
            out.append(
                Problem(
                    where(pair, "spec.proxy.port"),
                    f"PD proxy port {port} is {what} on the gateway "
                    "(every pair's proxy listens on the pool's gateway)",
                    f"set proxy.port: {free}",
                    rule=2,
                    code="ports.proxy",
                    patch=(set_field(pair, "spec.proxy.port", free),),
                )
            )
        taken.add(port)
    return out


def _rendered_names(member: P2PGroup | PDPair, name: str | None = None) -> list[tuple[str, str]]:
    if name is not None:
        member = member.model_copy(
            update={"metadata": member.metadata.model_copy(update={"name": name})}
        )
    out = [(inst.name, f"instance {inst.name!r}") for inst in member_instances(member)]
    out.append((member.metadata.name, f"its Service {member.metadata.name!r}"))
    out.append((names.lmcache_configmap_name(member), "its LMCache ConfigMap"))
    return out


def _fresh_name(member: P2PGroup | PDPair, owners: dict[str, str]) -> str:
    stem = member.metadata.name[:34]
    for n in range(2, 1000):
        candidate = f"{stem}-r{n}"
        if not any(name in owners for name, _ in _rendered_names(member, candidate)):
            return candidate
    return f"{stem}-renamed"  # pragma: no cover - 998 taken names


def rule3_instance_ids(pool: KVCachePool, members: Members) -> list[Problem]:
    """lmcache_instance_id (and the lmcache_rpc_port identifier) unique across the domain, and
    no two resources rendering objects of the same name (instance StatefulSets and Services,
    the member's Service and PDB, its LMCache ConfigMap, the pool's own objects)."""
    pool_owner = key(pool)
    owners: dict[str, str] = {
        name: pool_owner
        for name in (
            names.controller_name(pool),
            names.gateway_name(pool),
            names.domain_configmap_name(pool),
            *(names.mooncake_name(pool, part) for part in ("master", "metadata", "store")),
        )
    }
    ordered = sorted(members, key=lambda m: (m.kind, m.metadata.name))
    everything = dict(owners)
    for member in ordered:
        for name, _ in _rendered_names(member):
            everything.setdefault(name, key(member))
    out: list[Problem] = []
    for member in ordered:
        owner = key(member)
        for name, what in _rendered_names(member):
            if name in owners and owners[name] != owner:
                fresh = _fresh_name(member, everything)
                out.append(
                    Problem(
                        where(member, "metadata.name"),
                        f"{what} has the name {name!r}, also rendered for {owners[name]}; "
                        "objects (and lmcache_instance_id / lmcache_rpc_port) would collide",
                        f"rename {owner} (e.g. to {fresh})",
                        rule=3,
                        code="names.collide",
                        patch=(set_field(member, "metadata.name", fresh),),
                    )
                )
            owners.setdefault(name, owner)
    return out
