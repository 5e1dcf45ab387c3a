"""Port allocation, property-based: for any replicas/TP/base, lists have TP entries, no port is
used twice inside a member, and every port lies in the range the member reserves (which the
cross-member overlap check relies on)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from op_builders import p2p, pd, pool

from kvpool.operator.derive.platform import pd_sender_pull
from kvpool.operator.derive.ports import member_port_range, p2p_ports, pd_ports
from kvpool.operator.validation import validate_domain

SIZES = st.integers(min_value=1, max_value=8)
BASES = st.integers(min_value=1024, max_value=40000)


@settings(max_examples=60, deadline=None)
@given(replicas=SIZES, tp=SIZES, base=BASES)
def test_p2p_ports(replicas: int, tp: int, base: int) -> None:
    group = p2p(replicas=replicas, tensorParallelSize=tp, ports={"base": base})
    insts = p2p_ports(group)
    every = [port for inst in insts for port in inst.all_ports()]
    assert len(every) == len(set(every)) == replicas * (1 + 3 * tp)
    assert all(len(v) == tp for inst in insts for v in inst.lists.values())
    lo, hi = member_port_range(group)
    assert lo == base and all(lo <= port <= hi for port in every)
    assert not [p for p in validate_domain(pool(), [group]) if p.rule == 2]


@settings(max_examples=60, deadline=None)
@given(
    prefill=SIZES,
    decode=SIZES,
    tpp=SIZES,
    tpd=SIZES,
    base=BASES,
    mode=st.sampled_from(["push", "pull-eager", "pull-delay", "cpu-offload-pull-delay"]),
)
def test_pd_ports(prefill: int, decode: int, tpp: int, tpd: int, base: int, mode: str) -> None:
    pair = pd(
        prefill={"replicas": prefill, "tensorParallelSize": tpp},
        decode={"replicas": decode, "tensorParallelSize": tpd},
        transfer={"mode": mode},
        ports={"base": base},
    )
    insts = pd_ports(pair, sender_pull=pd_sender_pull(pair))
    every = [port for inst in insts for port in inst.all_ports()]
    assert len(every) == len(set(every))
    for inst in insts:
        tp = tpp if inst.role == "prefill" else tpd
        assert all(len(v) == tp for v in inst.lists.values())
        assert ("pd_pull_done_port" in inst.lists) == (inst.role == "prefill" and mode != "push")
    lo, hi = member_port_range(pair)
    assert all(lo <= port <= hi for port in every)
