"""Port allocation, property-based: for any replicas/TP/base, with or without vLLM's KV-event
ports, lists have TP entries, no port is used twice inside a member, and every port lies in the
range the member reserves (which the cross-member overlap check relies on)."""

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
@given(replicas=SIZES, tp=SIZES, base=BASES, events=st.booleans())
def test_p2p_ports(replicas: int, tp: int, base: int, events: bool) -> None:
    group = p2p(
        replicas=replicas, tensorParallelSize=tp, ports={"base": base}, engine={"kvEvents": events}
    )
    insts = p2p_ports(group)
    every = [port for inst in insts for port in inst.all_ports()]
    assert len(every) == len(set(every)) == replicas * (1 + 3 * tp + (2 if events else 0))
    assert all(len(v) == tp for inst in insts for v in inst.lists.values())
    assert all((inst.kv_events is not None) == events for inst in insts)
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
    events=st.tuples(st.booleans(), st.booleans()),
)
def test_pd_ports(
    prefill: int, decode: int, tpp: int, tpd: int, base: int, mode: str, events: tuple[bool, bool]
) -> None:
    pair = pd(
        prefill={"replicas": prefill, "tensorParallelSize": tpp, "engine": {"kvEvents": events[0]}},
        decode={"replicas": decode, "tensorParallelSize": tpd, "engine": {"kvEvents": events[1]}},
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
        assert (inst.kv_events is not None) == events[inst.role == "decode"]
    lo, hi = member_port_range(pair)
    assert all(lo <= port <= hi for port in every)
