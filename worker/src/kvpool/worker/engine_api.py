"""The contract between the worker's HTTP runtime and an inference engine.

Why this module exists: the OpenAI-compatible server, the agent memory API and the SIGTERM
drain (``kvpool.worker.server`` and friends) must not know how the engine computes. The
reference engine (``kvpool.worker.engine``) implements this protocol with real model math and
the real LMCache engine; tests may implement it with anything that honours the same contract.
Token ids in, token ids out: tokenization and chat templates belong to the runtime.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling for one request. ``temperature == 0`` is greedy (deterministic)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class KVTransferParams:
    """PD: where a prefill hands its prompt's KV (lmcache's ``disagg_spec``; worker/README.md,
    section "PD", has the HTTP contract)."""

    req_id: str
    receiver_host: str
    receiver_init_port: tuple[int, ...]
    receiver_alloc_port: tuple[int, ...]


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kv_transfer: KVTransferParams | None = None  # PD sender: hand the prompt's KV over


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. The first event of a request also carries its prefill facts."""

    request_id: str
    token_id: int
    index: int  # 0 for the first generated token
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from LMCache (any tier)
    ttft_s: float | None = None  # set on the first event only


class EngineError(Exception):
    """A request the engine refuses (too long, bad parameters): the runtime answers 400."""


class Engine(Protocol):
    """What ``kvpool-worker serve`` drives. All methods are called from one asyncio loop."""

    model_name: str
    max_model_len: int

    async def start(self) -> None:
        """Load the model and LMCache; return when ready to serve."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Stream tokens for one request; raises EngineError before the first token if refused.

        Several generate() streams run concurrently (continuous batching).
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request (client went away); its blocks are freed."""

    async def shutdown(self, deadline_s: float) -> None:
        """Stop admitting, finish or abort in-flight work, flush pending stores, close LMCache.

        Must return within ``deadline_s`` even if LMCache threads hang.
        """

    def metrics(self) -> dict[str, float]:
        """Counters and gauges for /metrics: ttft, tokens, prefix hit tokens, bytes per tier."""
        ...

    # --- agent memory API (the runtime maps sessions to token prefixes) -------------------
    async def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        """Remove the chunks of a prefix (or given chunk hashes) from the given tiers
        (all tiers when None). Returns the number of chunks removed; the controller sees
        evict events."""
        ...

    async def lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of the prefix this worker's cache holds now, in any tier (reads
        only: nothing is loaded, pinned or promoted)."""
        ...

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring the prefix's chunks from lower tiers (or a peer) into DDR. Returns tokens now
        resident in DDR."""
        ...

    async def pin(self, token_ids: Sequence[int]) -> int:
        """Pin the prefix's chunks so eviction skips them; returns tokens pinned."""
        ...

    async def unpin(self, token_ids: Sequence[int]) -> int:
        """Undo pin(); returns tokens unpinned."""
        ...

    def memory_stats(self) -> dict[str, object]:
        """Per tier: chunks, bytes used and capacity; pinned chunks; hit counters."""
        ...


# Special tokens of the generated reference tokenizer (kvpool.protocol REFERENCE_TOKENIZER_DIR).
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
REFERENCE_VOCAB_SIZE = 8192


@dataclass(frozen=True)
class ReferenceEngineOptions:
    """How ``kvpool-worker serve --engine reference`` builds the reference engine."""

    model_name: str = "kvpool/reference-tiny"
    model_dir: str | None = None  # a local HF model directory; None: random weights from seed
    weights_seed: int = 0
    vocab_size: int = REFERENCE_VOCAB_SIZE
    eos_token_id: int = EOS_TOKEN_ID
    max_model_len: int = 8704  # 8K prompts plus room to generate
    block_size: int = 16
    num_kv_blocks: int = 2048  # paged KV capacity in blocks, all requests together
    max_num_seqs: int = 8
    dtype: str = "float32"
    lmcache_config_file: str | None = None  # None: no LMCache (pure recompute)
    lmcache_instance_id: str = "reference-0"
