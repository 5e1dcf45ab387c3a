"""Deterministic port allocation per instance and per TP rank.

Why: the seed manual's most common breakage is a port list whose length differs from the TP
size, or two instances on one node binding the same port. Here each instance of a member
takes its own block of consecutive ports from the member's base; inside a block the HTTP port
comes first, then one port per TP rank for each LMCache list, then (engine.kvEvents) vLLM's
KV-event PUB and replay ROUTER ports. Blocks of different instances
never overlap, so instances sharing a node (hostNetwork) never collide; different members of a
domain are checked for disjoint ranges by validation (rule 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.operator.api.members import P2PGroup, PDPair


@dataclass(frozen=True)
class InstancePorts:
    """The ports of one instance: its HTTP API, its per-TP-rank LMCache lists and, when its
    engine publishes vLLM's KV events, their PUB and replay ROUTER ports."""

    name: str
    role: str
    index: int
    http: int
    lists: dict[str, list[int]] = field(default_factory=dict)
    kv_events: tuple[int, int] | None = None  # (events PUB, replay ROUTER)

    def all_ports(self) -> list[int]:
        """Every port this instance binds."""
        lists = (p for ports in self.lists.values() for p in ports)
        return [self.http, *lists, *(self.kv_events or ())]


def _block(ports_per_instance: int) -> int:
    return int(math.ceil(ports_per_instance / 10.0) * 10)


#: Ports of vLLM's KV-event publisher per instance (engine.kvEvents): events PUB, replay ROUTER.
KV_EVENT_PORTS = 2


def p2p_block_size(tp: int, *, p2p: bool = True, kv_events: bool = False) -> int:
    """Ports reserved per P2P-group instance: HTTP + 3 lists of TP ports (1 list, the
    controller's worker ports, when the group does not pull KV from peers) + the KV-event
    ports when the engine publishes them, rounded up to tens."""
    return _block(1 + (3 if p2p else 1) * tp + (KV_EVENT_PORTS if kv_events else 0))


def pd_block_size(prefill_tp: int, decode_tp: int, *, kv_events: bool = False) -> int:
    """Ports reserved per PD instance: HTTP + 2 lists of TP ports + the KV-event ports when
    either side publishes them, rounded up to tens."""
    return _block(1 + 2 * max(prefill_tp, decode_tp) + (KV_EVENT_PORTS if kv_events else 0))


def _events(at: int) -> tuple[int, int]:
    return (at, at + 1)


#: The per-rank lists of a P2P-group instance, in block order; a group with ``p2p: false``
#: binds only the first (the controller's worker ports).
P2P_LISTS = ("lmcache_worker_ports", "p2p_init_ports", "p2p_lookup_ports")


def _seq(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def p2p_ports(group: P2PGroup) -> list[InstancePorts]:
    """Ports of every instance of a P2P group (explicit lists win over allocation)."""
    spec = group.spec
    tp = spec.tensor_parallel_size
    name = group.metadata.name
    keys = P2P_LISTS if spec.p2p else P2P_LISTS[:1]
    events = spec.engine.kv_events
    result: list[InstancePorts] = []
    if spec.ports.instances is not None:
        for i, explicit in enumerate(spec.ports.instances):
            given = (explicit.worker_ports, explicit.init_ports, explicit.lookup_ports)
            lists = {k: list(ports) for k, ports in zip(keys, given, strict=False)}
            pub, replay = explicit.kv_events, explicit.kv_events_replay
            # Both or none: validation (rule 2) names an explicit entry that lacks one.
            kv = (pub, replay) if events and pub is not None and replay is not None else None
            result.append(InstancePorts(f"{name}-{i}", "p2p", i, explicit.http, lists, kv))
        return result
    block = p2p_block_size(tp, p2p=spec.p2p, kv_events=events)
    for i in range(spec.replicas):
        start = spec.ports.base + i * block
        lists = {k: _seq(start + 1 + j * tp, tp) for j, k in enumerate(keys)}
        kv = _events(start + 1 + len(keys) * tp) if events else None
        result.append(InstancePorts(f"{name}-{i}", "p2p", i, start, lists, kv))
    return result


def pd_kv_events(pair: PDPair) -> bool:
    """Whether either side of a PD pair publishes KV events (its blocks hold their ports)."""
    return pair.spec.prefill.engine.kv_events or pair.spec.decode.engine.kv_events


def pd_ports(pair: PDPair, *, sender_pull: bool) -> list[InstancePorts]:
    """Ports of every prefill then decode instance of a PD pair.

    Prefill instances get ``pd_pull_done_port`` only when the mode is a pull mode (the sender
    collects Done there); decode instances get ``pd_peer_init_port`` and ``pd_peer_alloc_port``.
    The KV-event ports of a side whose engine publishes them follow the longest lists.
    """
    spec = pair.spec
    name = pair.metadata.name
    tpp, tpd = spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size
    block = pd_block_size(tpp, tpd, kv_events=pd_kv_events(pair))
    events_at = 1 + 2 * max(tpp, tpd)
    result: list[InstancePorts] = []
    for i in range(spec.prefill.replicas):
        start = spec.ports.base + i * block
        lists = {"pd_pull_done_port": _seq(start + 1, tpp)} if sender_pull else {}
        kv = _events(start + events_at) if spec.prefill.engine.kv_events else None
        result.append(InstancePorts(f"{name}-prefill-{i}", "prefill", i, start, lists, kv))
    for j in range(spec.decode.replicas):
        start = spec.ports.base + (spec.prefill.replicas + j) * block
        lists = {
            "pd_peer_init_port": _seq(start + 1, tpd),
            "pd_peer_alloc_port": _seq(start + 1 + tpd, tpd),
        }
        kv = _events(start + events_at) if spec.decode.engine.kv_events else None
        result.append(InstancePorts(f"{name}-decode-{j}", "decode", j, start, lists, kv))
    return result


def pd_decoder_worker_ports(pair: PDPair, inst: InstancePorts) -> list[int] | None:
    """``lmcache_worker_ports`` of a decode instance that registers with the controller (the
    gateway's PD bypass): the last ports of its block, which nothing else binds, so turning
    the bypass on moves no other port; None when the block has no room for one per TP rank
    (validation refuses the bypass for that pair, naming the field)."""
    spec = pair.spec
    tpp, tpd = spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size
    kv = pd_kv_events(pair)
    block = pd_block_size(tpp, tpd, kv_events=kv)
    used = 1 + 2 * max(tpp, tpd) + (KV_EVENT_PORTS if kv else 0)
    return _seq(inst.http + block - tpd, tpd) if block - used >= tpd else None


def member_port_range(member: P2PGroup | PDPair) -> tuple[int, int]:
    """The [first, last] ports a member reserves (for cross-member overlap checks)."""
    if isinstance(member, P2PGroup):
        ports = p2p_ports(member)
        if member.spec.ports.instances is not None:
            every = [p for inst in ports for p in inst.all_ports()]
            return (min(every), max(every)) if every else (0, 0)
        spec = member.spec
        block = p2p_block_size(
            spec.tensor_parallel_size, p2p=spec.p2p, kv_events=spec.engine.kv_events
        )
        return spec.ports.base, spec.ports.base + len(ports) * block - 1
    pd = member.spec
    block = pd_block_size(
        pd.prefill.tensor_parallel_size,
        pd.decode.tensor_parallel_size,
        kv_events=pd_kv_events(member),
    )
    slots = pd.prefill.replicas + pd.decode.replicas
    return pd.ports.base, pd.ports.base + slots * block - 1
