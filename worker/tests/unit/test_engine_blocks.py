"""Block manager, scheduler and sampling of the reference engine (pure bookkeeping)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.worker.engine.blocks import BlockManager
from kvpool.worker.engine.sampling import make_generator, sample, validate_sampling
from kvpool.worker.engine.scheduler import Scheduler, SeqStatus, Sequence
from kvpool.worker.engine_api import EngineError, GenerationRequest, SamplingParams


def seq(rid: str, n: int) -> Sequence:
    return Sequence(
        request=GenerationRequest(rid, list(range(3, 3 + n))),
        tokens=list(range(3, 3 + n)),
        num_prompt=n,
        arrival=0.0,
        generator=None,
    )


def test_blocks_allocate_free_and_report_exhaustion() -> None:
    bm = BlockManager(4, 16)
    a = bm.allocate(3)
    assert a is not None
    assert len(set(a)) == 3
    assert bm.num_free == 1
    assert bm.allocate(2) is None
    assert bm.num_free == 1  # a failed allocation takes nothing
    table = list(a)
    assert not bm.grow(table, 16 * 5)
    assert bm.grow(table, 16 * 4)
    assert len(table) == 4
    bm.free(table)
    assert table == []
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        bm.free([a[0]])


def test_scheduler_admits_within_blocks_seats_and_budget() -> None:
    sched = Scheduler(BlockManager(10, 16), max_num_seqs=2, max_batched_tokens=100)
    for s in (seq("a", 40), seq("b", 70), seq("c", 10)):
        sched.add(s)
    plan = sched.schedule()
    assert [(i.seq.request_id, i.budget, i.admitted) for i in plan.items] == [
        ("a", 40, True),
        ("b", 60, True),  # chunked by the token budget
    ]
    assert [s.request_id for s in sched.waiting] == ["c"]  # no seat left


def test_scheduler_preempts_youngest_when_out_of_blocks() -> None:
    bm = BlockManager(4, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_batched_tokens=1000)
    old, young = seq("old", 32), seq("young", 32)
    sched.add(old)
    sched.add(young)
    sched.schedule()
    for s in (old, young):  # both prefilled and sampled one token: each needs a new block
        s.num_computed = 32
        s.tokens.append(5)
    plan = sched.schedule()
    assert plan.preempted == [young]
    assert [i.seq for i in plan.items] == [old]
    assert young.status is SeqStatus.WAITING
    assert young.num_computed == 0
    assert young.needs_lookup
    assert bm.num_free == 1
    sched.finish(old, "stop")
    assert bm.num_free == 4
    plan = sched.schedule()
    assert [i.seq for i in plan.items] == [young]
    assert plan.items[0].budget == 33  # recomputes prompt and generated token


def test_scheduler_finishes_a_sequence_that_outgrows_the_whole_cache() -> None:
    sched = Scheduler(BlockManager(2, 16), max_num_seqs=4, max_batched_tokens=1000)
    s = seq("a", 32)
    sched.add(s)
    sched.schedule()
    s.num_computed = 32
    s.tokens.append(9)
    plan = sched.schedule()
    assert plan.out_of_blocks == [s]


def test_greedy_takes_the_argmax_and_seeded_sampling_repeats() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(), None) == int(torch.argmax(logits))
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample(logits, params, g) for g in [make_generator(params)] for _ in range(20)]
    again = [sample(logits, params, g) for g in [make_generator(params)] for _ in range(20)]
    assert first == again
    assert len(set(first)) > 1


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.tensor([5.0, 4.9, -5.0, -5.0, -6.0])
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1)
    gen = make_generator(params)
    assert {sample(logits, params, gen) for _ in range(200)} == {0, 1}
    tiny = SamplingParams(temperature=1.0, top_p=1e-6, seed=1)
    assert {sample(logits, tiny, make_generator(tiny)) for _ in range(20)} == {0}


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(stop_token_ids=(9000,)), "stop_token_ids"),
    ],
)
def test_out_of_range_sampling_names_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(EngineError, match=field):
        validate_sampling(params, 8192)


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(2, 12),
    budget=st.integers(1, 80),
    max_seqs=st.integers(1, 4),
    prompts=st.lists(st.integers(1, 60), min_size=1, max_size=6),
)
def test_scheduler_never_leaks_or_shares_blocks_and_finishes_everything(
    num_blocks: int, budget: int, max_seqs: int, prompts: list[int]
) -> None:
    """Random workloads run through schedule → compute → finish: every block is free or
    owned by exactly one running sequence, each scheduled chunk fits its blocks, and every
    request finishes (preemption never livelocks)."""
    bm = BlockManager(num_blocks, 8)
    sched = Scheduler(bm, max_num_seqs=max_seqs, max_batched_tokens=budget)
    for i, n in enumerate(prompts):
        sched.add(seq(f"s{i}", n))
    for _ in range(5000):
        plan = sched.schedule()
        for s in plan.out_of_blocks:
            sched.finish(s, "length")
        for item in plan.items:
            s = item.seq
            end = min(len(s.tokens), s.num_computed + item.budget)
            assert len(s.block_table) * 8 >= end
            s.num_computed = end
            if end == len(s.tokens):
                s.tokens.append(7)
                if len(s.tokens) - s.num_prompt >= 5:
                    sched.finish(s, "length")
        owned = [b for s in sched.running for b in s.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + bm.num_free == num_blocks
        assert all(not s.block_table for s in sched.waiting)
        if not sched.has_work():
            break
    assert not sched.has_work()
    assert bm.num_free == num_blocks
