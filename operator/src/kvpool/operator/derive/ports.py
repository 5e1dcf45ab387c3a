"""Deterministic port allocation per instance and per TP rank.

Why: the seed manual's most common breakage is a port list whose length differs from the TP
size, or two instances on one node binding the same port. Here each instance of a member
takes its own block of consecutive ports from the member's base; inside a block the HTTP port
comes first, then one port per TP rank for each LMCache list. Blocks of different instances
never overlap, so instances sharing a node (hostNetwork) never collide; different members of a
domain are checked for disjoint ranges by validation (rule 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpool.operator.api.members import P2PGroup, PDPair


@dataclass(frozen=True)
class InstancePorts:
    """The ports of one instance: its HTTP API and its per-TP-rank LMCache lists."""

    name: str
    role: str
    index: int
    http: int
    lists: dict[str, list[int]] = field(default_factory=dict)

    def all_ports(self) -> list[int]:
        """Every port this instance binds."""
        return [self.http, *(p for ports in self.lists.values() for p in ports)]


def _block(ports_per_instance: int) -> int:
    return int(math.ceil(ports_per_instance / 10.0) * 10)


def p2p_block_size(tp: int, *, p2p: bool = True) -> int:
    """Ports reserved per P2P-group instance: HTTP + 3 lists of TP ports (1 list, the
    controller's worker ports, when the group does not pull KV from peers), rounded up to tens."""
    return _block(1 + (3 if p2p else 1) * tp)


def pd_block_size(prefill_tp: int, decode_tp: int) -> int:
    """Ports reserved per PD instance: HTTP + 2 lists of TP ports, rounded up to tens."""
    return _block(1 + 2 * max(prefill_tp, decode_tp))


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
    result: list[InstancePorts] = []
    if spec.ports.instances is not None:
        for i, explicit in enumerate(spec.ports.instances):
            given = (explicit.worker_ports, explicit.init_ports, explicit.lookup_ports)
            lists = {k: list(ports) for k, ports in zip(keys, given, strict=False)}
            result.append(InstancePorts(f"{name}-{i}", "p2p", i, explicit.http, lists))
        return result
    block = p2p_block_size(tp, p2p=spec.p2p)
    for i in range(spec.replicas):
        start = spec.ports.base + i * block
        lists = {k: _seq(start + 1 + j * tp, tp) for j, k in enumerate(keys)}
        result.append(InstancePorts(f"{name}-{i}", "p2p", i, start, lists))
    return result


def pd_ports(pair: PDPair, *, sender_pull: bool) -> list[InstancePorts]:
    """Ports of every prefill then decode instance of a PD pair.

    Prefill instances get ``pd_pull_done_port`` only when the mode is a pull mode (the sender
    collects Done there); decode instances get ``pd_peer_init_port`` and ``pd_peer_alloc_port``.
    """
    spec = pair.spec
    name = pair.metadata.name
    tpp, tpd = spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size
    block = pd_block_size(tpp, tpd)
    result: list[InstancePorts] = []
    for i in range(spec.prefill.replicas):
        start = spec.ports.base + i * block
        lists = {"pd_pull_done_port": _seq(start + 1, tpp)} if sender_pull else {}
        result.append(InstancePorts(f"{name}-prefill-{i}", "prefill", i, start, lists))
    for j in range(spec.decode.replicas):
        start = spec.ports.base + (spec.prefill.replicas + j) * block
        lists = {
            "pd_peer_init_port": _seq(start + 1, tpd),
            "pd_peer_alloc_port": _seq(start + 1 + tpd, tpd),
        }
        result.append(InstancePorts(f"{name}-decode-{j}", "decode", j, start, lists))
    return result


def member_port_range(member: P2PGroup | PDPair) -> tuple[int, int]:
    """The [first, last] ports a member reserves (for cross-member overlap checks)."""
    if isinstance(member, P2PGroup):
        ports = p2p_ports(member)
        if member.spec.ports.instances is not None:
            every = [p for inst in ports for p in inst.all_ports()]
            return (min(every), max(every)) if every else (0, 0)
        block = p2p_block_size(member.spec.tensor_parallel_size, p2p=member.spec.p2p)
        return member.spec.ports.base, member.spec.ports.base + len(ports) * block - 1
    spec = member.spec
    block = pd_block_size(spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size)
    slots = spec.prefill.replicas + spec.decode.replicas
    return spec.ports.base, spec.ports.base + slots * block - 1
