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
import threading
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvpool.worker.engine.model import PagedModel, SeqChunk, slot_mapping
from kvpool.worker.engine.sampling import sample
from kvpool.worker.engine.scheduler import ScheduledSeq, Sequence
from kvpool.worker.engine_api import KVTransferParams
from kvpool.worker.offload_api import AsyncKVOffload, KVOffload

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
    kv_transfer: KVTransferParams | None = None


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
        self._pending_lock = threading.Lock()  # finished requests defer stores from the loop
        self._cancelled_lookups: deque[str] = deque()  # appended by the loop thread
        self.async_offload: AsyncKVOffload | None = (
            offload if isinstance(offload, AsyncKVOffload) and offload.async_loading else None
        )
        self._skip_last = offload.skip_last_n_tokens if isinstance(offload, AsyncKVOffload) else 0
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
                        self._defer_store(seq, seq.num_prompt, seq.request.kv_transfer)
            if any(p.kv_transfer is not None for p in self._pending):
                self.flush_stores()  # PD: start the hand-over before the first token returns
            return outputs
        finally:
            self.busy_s += time.perf_counter() - started

    def _lookup_tokens(self, seq: Sequence) -> list[int]:
        """What the offload looks up: a PD decoder skips the prefill's token at the end."""
        n = len(seq.tokens) - self._skip_last
        return seq.tokens[: max(n, 0)]

    def poll_lookups(self, waiting: Seq[Sequence]) -> None:
        """Asynchronous offloads: start the lookup of each waiting sequence that has none and
        collect the answers (the scheduler admits a sequence once answered)."""
        off = self.async_offload
        if off is None:
            return
        self._cancel_lookups()
        for seq in waiting:
            if not seq.needs_lookup or seq.lookup_hit is not None:
                continue
            try:
                if seq.lookup_id is None:
                    seq.lookup_round += 1
                    seq.lookup_id = off.start_lookup(
                        self._lookup_tokens(seq), f"{seq.request_id}#{seq.lookup_round}"
                    )
                seq.lookup_hit = off.lookup_result(seq.lookup_id)
            except Exception:
                self.offload_errors += 1
                logger.warning(
                    "async KV lookup failed for request %s; recomputing its prompt",
                    seq.request_id,
                    exc_info=True,
                )
                seq.lookup_hit = 0

    def cancel_lookup(self, seq: Sequence) -> None:
        """The sequence went away before loading: release its prefetch (thread-safe)."""
        if seq.lookup_id is not None and self.async_offload is not None:
            self._cancelled_lookups.append(seq.lookup_id)
            seq.lookup_id = None

    def _cancel_lookups(self) -> None:
        off = self.async_offload
        while self._cancelled_lookups and off is not None:
            off.cancel_lookup(self._cancelled_lookups.popleft())

    def set_lookup_listener(self, on_answer: Callable[[], None] | None) -> None:
        if self.async_offload is not None:
            self.async_offload.set_lookup_listener(on_answer)

    def _load_prefix(self, seq: Sequence) -> None:
        """Ask the offload for the longest cached prefix and load it into seq's blocks."""
        seq.needs_lookup = False
        if self.offload is None:
            return
        tokens = self._lookup_tokens(seq)  # the chunk keys end where the lookup ended
        lookup_id, seq.lookup_id = seq.lookup_id, None
        try:
            if self.async_offload is not None and lookup_id is not None:
                hit = min(seq.lookup_hit or 0, len(tokens))
            else:
                hit = min(self.offload.lookup(tokens), len(tokens))
            loaded = 0
            if hit > 0:
                slots = slot_mapping(seq.block_table, self.block_size, 0, hit)
                if self.async_offload is not None and lookup_id is not None:
                    loaded = self.async_offload.retrieve(
                        tokens, hit, self.kv_caches, slots, lookup_id=lookup_id
                    )
                else:
                    loaded = self.offload.retrieve(tokens, hit, self.kv_caches, slots)
            elif self.async_offload is not None and lookup_id is not None:
                self.async_offload.cancel_lookup(lookup_id)
        except Exception:
            self.offload_errors += 1
            logger.warning(
                "KV offload lookup/retrieve failed for request %s; recomputing its prompt",
                seq.request_id,
                exc_info=True,
            )
            return
        # Keep at least the last token to recompute: its logits give the first new token.
        usable = max(0, min(loaded, hit, len(seq.tokens) - 1))
        seq.num_computed = usable
        if seq.num_output == 0:
            seq.num_cached = usable

    def _defer_store(
        self, seq: Sequence, n: int, kv_transfer: KVTransferParams | None = None
    ) -> None:
        item = _PendingStore(
            request_id=seq.request_id,
            token_ids=list(seq.tokens[:n]),
            slots=slot_mapping(seq.block_table, self.block_size, 0, n),
            kv_transfer=kv_transfer,
        )
        with self._pending_lock:
            self._pending.append(item)

    def defer_finished_store(self, seq: Sequence) -> None:
        """A finished request: store its prompt and generated tokens (all whose KV is in the
        cache), so the next turn of a conversation also hits the previous answer. Called on
        the loop before the blocks are freed; the store runs before anything rewrites them."""
        if self.offload is not None and seq.num_computed > seq.num_prompt and seq.block_table:
            self._defer_store(seq, seq.num_computed)

    def flush_stores(self) -> None:
        """Hand completed prompts' KV to the offload (must run before the cache is written)."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        self._cancel_lookups()
        if self.offload is None:
            return
        for item in pending:
            try:
                if item.kv_transfer is not None and isinstance(self.offload, AsyncKVOffload):
                    self.offload.store(
                        item.token_ids, self.kv_caches, item.slots, kv_transfer=item.kv_transfer
                    )
                else:
                    self.offload.store(item.token_ids, self.kv_caches, item.slots)
            except Exception:
                self.offload_errors += 1
                logger.warning(
                    "KV offload store failed for request %s; its prefix stays uncached",
                    item.request_id,
                    exc_info=True,
                )
