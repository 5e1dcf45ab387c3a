"""The compute side of one engine step: offload lookups and loads, the forward, sampling.

Why this module exists: everything that touches tensors or the KV offload runs here, on the
engine's single compute thread, never on the asyncio loop. The order inside a step is what
keeps KV correct: stores deferred from the previous step are flushed first (their blocks may
have been freed since, but nothing writes the cache before this flush), then newly admitted
sequences look up their prefix in the offload and load the hit into their freshly allocated
blocks, then one varlen forward computes every scheduled chunk, then each sequence whose
tokens are all computed samples its next token. A prompt's KV is handed to the offload once
its prefill completes, deferred to the start of the next step so the store is not on the
time-to-first-token path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvpool.worker.engine.model import PagedModel, SeqChunk, slot_mapping
from kvpool.worker.engine.sampling import sample
from kvpool.worker.engine.scheduler import ScheduledSeq, Sequence
from kvpool.worker.offload_api import KVOffload

logger = logging.getLogger(__name__)

# Steps computing fewer tokens than this (decodes, short prefills) run on one intra-op
# thread: their matmuls are tiny, and on a busy box a second OpenMP thread waiting for a
# time slice made single-token steps 5-10x slower (measured on the 2-core dev box). Larger
# steps use ``prefill_threads``.
SMALL_STEP_TOKENS = 128
# torch's own default, read before any engine changes the (process-wide) setting.
DEFAULT_PREFILL_THREADS = torch.get_num_threads()


@dataclass
class StepOutput:
    seq: Sequence
    token_id: int
    sampled_at: float
    logits: torch.Tensor  # the float32 row the token was sampled from


@dataclass
class _PendingStore:
    request_id: str
    token_ids: list[int]
    slots: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model: PagedModel,
        kv_caches: list[torch.Tensor],
        block_size: int,
        offload: KVOffload | None,
        prefill_threads: int | None = None,
    ) -> None:
        self.model = model
        self.prefill_threads = prefill_threads or DEFAULT_PREFILL_THREADS
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.offload = offload
        self._pending: list[_PendingStore] = []
        self.busy_s = 0.0
        self.offload_errors = 0
        self.computed_tokens = 0

    @property
    def has_pending_stores(self) -> bool:
        return bool(self._pending)

    def execute(self, items: Seq[ScheduledSeq]) -> list[StepOutput]:
        started = time.perf_counter()
        try:
            self.flush_stores()
            for item in items:
                if item.admitted and item.seq.needs_lookup:
                    self._load_prefix(item.seq)
            chunks: list[SeqChunk] = []
            for item in items:
                seq = item.seq
                end = min(len(seq.tokens), seq.num_computed + item.budget)
                chunks.append(
                    SeqChunk(
                        token_ids=seq.tokens[seq.num_computed : end],
                        start_pos=seq.num_computed,
                        block_table=seq.block_table,
                        want_logits=end == len(seq.tokens),
                    )
                )
            step_tokens = sum(len(c.token_ids) for c in chunks)
            threads = 1 if step_tokens < SMALL_STEP_TOKENS else self.prefill_threads
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            logits = self.model.forward(chunks, self.kv_caches) if chunks else None
            outputs: list[StepOutput] = []
            row = 0
            for item, chunk in zip(items, chunks, strict=True):
                seq = item.seq
                seq.num_computed += len(chunk.token_ids)
                self.computed_tokens += len(chunk.token_ids)
                if chunk.want_logits:
                    assert logits is not None
                    token = sample(logits[row], seq.request.sampling, seq.generator)
                    row += 1
                    outputs.append(StepOutput(seq, token, time.monotonic(), logits[row - 1]))
                    if seq.num_output == 0 and self.offload is not None:
                        self._defer_store(seq)
            return outputs
        finally:
            self.busy_s += time.perf_counter() - started

    def _load_prefix(self, seq: Sequence) -> None:
        """Ask the offload for the longest cached prefix and load it into seq's blocks."""
        seq.needs_lookup = False
        if self.offload is None:
            return
        tokens = seq.tokens
        try:
            hit = min(self.offload.lookup(tokens), len(tokens))
            loaded = 0
            if hit > 0:
                slots = slot_mapping(seq.block_table, self.block_size, 0, hit)
                loaded = self.offload.retrieve(tokens, hit, self.kv_caches, slots)
        except Exception:
            self.offload_errors += 1
            logger.warning(
                "KV offload lookup/retrieve failed for request %s; recomputing its prompt",
                seq.request_id,
                exc_info=True,
            )
            return
        # Keep at least the last token to recompute: its logits give the first new token.
        usable = max(0, min(loaded, hit, len(tokens) - 1))
        seq.num_computed = usable
        if seq.num_output == 0:
            seq.num_cached = usable

    def _defer_store(self, seq: Sequence) -> None:
        n = seq.num_prompt
        self._pending.append(
            _PendingStore(
                request_id=seq.request_id,
                token_ids=list(seq.tokens[:n]),
                slots=slot_mapping(seq.block_table, self.block_size, 0, n),
            )
        )

    def flush_stores(self) -> None:
        """Hand completed prompts' KV to the offload (must run before the cache is written)."""
        pending, self._pending = self._pending, []
        if self.offload is None:
            return
        for item in pending:
            try:
                self.offload.store(item.token_ids, self.kv_caches, item.slots)
            except Exception:
                self.offload_errors += 1
                logger.warning(
                    "KV offload store failed for request %s; its prefix stays uncached",
                    item.request_id,
                    exc_info=True,
                )
