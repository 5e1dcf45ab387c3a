"""Continuous batching: which sequences compute how many tokens in the next forward pass.

Why this module exists: several requests share one model and one paged KV cache. Each step
the scheduler gives every running sequence its next tokens (one for a decode, a chunk for a
prefill) within a token budget, admits waiting sequences while blocks and seats last, and
when a running sequence cannot grow its block table it preempts the youngest running one
(its blocks are freed and it is recomputed later, vLLM's recompute preemption). A sequence
is just its tokens and how many of them already have KV in the cache (``num_computed``), so
prefill, decode, chunked prefill and recompute after preemption are one mechanism. Pure
bookkeeping: no tensors, no I/O; the runner computes, the engine applies results.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from kvpool.worker.engine.blocks import BlockManager
from kvpool.worker.engine_api import FinishReason, GenerationRequest, TokenEvent


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's state. ``tokens`` is the prompt followed by the generated tokens."""

    request: GenerationRequest
    tokens: list[int]
    num_prompt: int
    arrival: float
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    needs_lookup: bool = True  # ask the offload for the prefix at (re)admission
    # Asynchronous offloads (LMCache with async loading, P2P): the lookup started for this
    # admission and its answer (None while LMCache is still looking up and prefetching).
    lookup_id: str | None = None
    lookup_hit: int | None = None
    lookup_round: int = 0
    num_cached: int = 0  # prompt tokens whose KV came from the offload
    num_output: int = 0
    first_token_at: float | None = None
    finish_reason: FinishReason | None = None
    abort_requested: bool = False
    events: asyncio.Queue[TokenEvent | BaseException] = field(default_factory=asyncio.Queue)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class ScheduledSeq:
    seq: Sequence
    budget: int  # at most this many tokens computed this step
    admitted: bool  # newly (re)admitted: consult the offload before computing


@dataclass
class StepPlan:
    items: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    out_of_blocks: list[Sequence] = field(default_factory=list)  # can never fit: finish them


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_batched_tokens: int,
        *,
        async_prefix: bool = False,
    ) -> None:
        """``async_prefix``: a waiting sequence is admitted only once its asynchronous prefix
        lookup answered (vLLM skips a request whose connector lookup returns None)."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be at least 1, got {max_batched_tokens}")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.async_prefix = async_prefix

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_batched_tokens
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            want = min(len(seq.tokens) - seq.num_computed, budget)
            grown = self.blocks.grow(seq.block_table, seq.num_computed + want)
            while not grown and self.running[-1] is not seq:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                grown = self.blocks.grow(seq.block_table, seq.num_computed + want)
            if not grown:
                if len(self.running) == 1:  # alone and still too big for the whole cache
                    plan.out_of_blocks.append(seq)
                else:
                    self._preempt(seq)
                    plan.preempted.append(seq)
                continue
            plan.items.append(ScheduledSeq(seq, want, admitted=False))
            budget -= want
        if plan.preempted:
            return plan  # no admissions in a step that had to preempt
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.lookup_pending(seq):
                continue  # its prefix (maybe a peer's) is still being looked up and pulled
            needed = self.blocks.blocks_for(len(seq.tokens))
            if needed > self.blocks.num_blocks:
                self.waiting.remove(seq)
                plan.out_of_blocks.append(seq)
                continue
            table = self.blocks.allocate(needed)
            if table is None:
                break
            self.waiting.remove(seq)
            seq.block_table = table
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            want = min(len(seq.tokens), budget)
            plan.items.append(ScheduledSeq(seq, want, admitted=True))
            budget -= want
        return plan

    def lookup_pending(self, seq: Sequence) -> bool:
        """An asynchronous prefix lookup was not answered yet (or not even started)."""
        return self.async_prefix and seq.needs_lookup and seq.lookup_hit is None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Remove ``seq`` from the queues and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.blocks.free(seq.block_table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        seq.needs_lookup = True
        seq.lookup_id = None  # consumed at admission; a new lookup starts for the readmission
        seq.lookup_hit = None
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
