"""ReferenceEngine: the asyncio face of the reference engine (``engine_api.Engine``).

Why this module exists: the HTTP runtime drives one engine object from one asyncio loop.
This module owns the request lifecycle around the scheduler and the runner: validating a
request before its first token, the step loop (schedule on the loop, compute on the compute
thread, apply results on the loop), streaming TokenEvents per request, abort, a bounded
shutdown, metrics, and delegating the agent memory API to the KV offload (LMCache).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch

from kvpool.worker.engine.blocks import BlockManager
from kvpool.worker.engine.compute import ComputeThread
from kvpool.worker.engine.factory import build
from kvpool.worker.engine.model import PagedModel
from kvpool.worker.engine.runner import ModelRunner, StepOutput
from kvpool.worker.engine.sampling import make_generator, validate_sampling
from kvpool.worker.engine.scheduler import Scheduler
from kvpool.worker.engine.scheduler import Sequence as Seq
from kvpool.worker.engine_api import (
    EngineError,
    FinishReason,
    GenerationRequest,
    ReferenceEngineOptions,
    TokenEvent,
)
from kvpool.worker.offload_api import KVOffload

logger = logging.getLogger(__name__)

ABORT_TOKEN_ID = -1  # token_id of a final event that carries no token (abort, out of KV)

# Called on the event loop with (request_id, token index, float32 logits row) for every
# generated token: the hook for logprobs and for the hit/miss logits invariant tests.
LogitsObserver = Callable[[str, int, torch.Tensor], None]


class ReferenceEngine:
    """Real prefill/decode of a small transformer on CPU with paged KV and a KV offload.

    Streams: every generated token is one TokenEvent; the last has ``finished=True``. With
    ``finish_reason == "stop"`` its ``token_id`` is the stop or EOS token that ended the
    request (the runtime does not render it). An aborted request (``abort()``, the consumer
    closing the stream, or shutdown) ends with an event whose ``token_id`` is
    ``ABORT_TOKEN_ID`` (-1, not a token) and ``finish_reason == "abort"``. A lone request
    that outgrows the whole KV cache ends with the same no-token marker and
    ``finish_reason == "length"``: its last real token was already streamed.
    """

    def __init__(
        self,
        options: ReferenceEngineOptions,
        offload: KVOffload | None = None,
        *,
        max_batched_tokens: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        logits_observer: LogitsObserver | None = None,
        num_threads: int | None = None,
    ) -> None:
        """``max_batched_tokens``: a step's token budget (default max_model_len: one-step
        prefills); ``model_overrides``: the random-weight model's config (smaller in tests);
        ``num_threads``: prefill intra-op threads (default torch's; small steps use one)."""
        self.options = options
        self.offload = offload
        self.model_name = options.model_name
        self.max_model_len = options.max_model_len
        if options.max_model_len < 2:
            raise EngineError(f"max_model_len must be at least 2, got {options.max_model_len}")
        self._max_batched_tokens = max_batched_tokens or options.max_model_len
        self._model_overrides = dict(model_overrides or {})
        self._logits_observer = logits_observer
        self._num_threads = num_threads
        self._blocks = BlockManager(options.num_kv_blocks, options.block_size)
        self._scheduler = Scheduler(self._blocks, options.max_num_seqs, self._max_batched_tokens)
        self._compute = ComputeThread(f"kvpool-engine-{options.model_name}")
        self._runner: ModelRunner | None = None
        self._model: PagedModel | None = None
        self._eos_ids: frozenset[int] = frozenset({options.eos_token_id})
        self._vocab_size = options.vocab_size
        self._seqs: dict[str, Seq] = {}
        self._accepting = False
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()
        self._step_in_flight = False
        self._closed = False
        self._counters: dict[str, float] = {
            "requests_total": 0,
            "requests_finished_total": 0,
            "requests_aborted_total": 0,
            "prompt_tokens_total": 0,
            "cached_prompt_tokens_total": 0,
            "generated_tokens_total": 0,
            "ttft_seconds_sum": 0.0,
            "ttft_seconds_count": 0,
            "ttft_seconds_last": 0.0,
        }

    # --- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        if self._runner is not None:
            return
        try:
            self._runner = await self._compute.run(self._build)
        except BaseException:
            self._compute.stop()  # nothing to serve: let the compute thread go
            raise
        self._accepting = True
        self._scheduler.async_prefix = self._runner.async_offload is not None
        loop = asyncio.get_running_loop()

        def wake() -> None:  # on LMCache's thread when an asynchronous lookup is answered
            loop.call_soon_threadsafe(self._wakeup.set)

        self._runner.set_lookup_listener(wake)
        self._loop_task = asyncio.create_task(self._step_loop(), name="kvpool-engine-steps")
        logger.info(
            "reference engine %s ready: %d KV blocks of %d tokens, max_model_len %d",
            self.model_name,
            self.options.num_kv_blocks,
            self.options.block_size,
            self.max_model_len,
        )

    def _build(self) -> ModelRunner:
        built = build(self.options, self.offload, self._model_overrides, self._num_threads)
        self._model = built.model
        self._vocab_size = built.model.shape.vocab_size
        self._eos_ids = built.eos_ids
        self.offload = built.runner.offload
        return built.runner

    @property
    def model(self) -> PagedModel:
        if self._model is None:
            raise EngineError("the engine is not started; call start() first")
        return self._model

    @property
    def kv_caches(self) -> list[Any]:
        return self._require_runner().kv_caches

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def busy_s(self) -> float:  # seconds the compute thread's current job has run (0.0: idle)
        return self._compute.busy_s

    def _require_runner(self) -> ModelRunner:
        if self._runner is None:
            raise EngineError("the engine is not started; call start() first")
        return self._runner

    async def shutdown(self, deadline_s: float) -> None:
        """Drain, then abort what is left, flush stores and close the offload, all within
        ``deadline_s`` (a step or an offload close that overruns is left behind)."""
        end = time.monotonic() + max(deadline_s, 0.0)
        self._accepting = False
        reserve = min(max(deadline_s * 0.25, 0.2), 10.0)  # time kept for flush and close
        while self._scheduler.has_work() and time.monotonic() < end - reserve:
            await asyncio.sleep(0.01)
        for seq in list(self._seqs.values()):
            seq.abort_requested = True
        self._stopping = True
        self._wakeup.set()
        if self._loop_task is not None:
            try:
                await asyncio.wait_for(
                    asyncio.shield(self._loop_task), max(end - reserve - time.monotonic(), 0.01)
                )
            except TimeoutError:
                logger.warning("engine step still running at shutdown; abandoning it")
                self._loop_task.cancel()
            except Exception:
                logger.exception("engine step loop failed during shutdown")
        for seq in list(self._seqs.values()):  # the loop did not get to them
            self._emit_abort(seq)
        self._seqs.clear()
        if not self._closed:
            self._closed = True
            runner = self._runner
            offload = self.offload

            def close() -> None:
                if runner is not None:
                    runner.flush_stores()
                if offload is not None:
                    offload.close(max(end - time.monotonic(), 0.0))

            try:
                await asyncio.wait_for(self._compute.run(close), max(end - time.monotonic(), 0.0))
            except TimeoutError:
                logger.warning("KV offload close overran the %.1fs shutdown deadline", deadline_s)
            except Exception:
                logger.exception("KV offload close failed")
            self._compute.stop()
            if not await self._compute.join(max(end - time.monotonic(), 0.0)):
                logger.warning("engine compute thread still busy at the shutdown deadline")

    # --- requests ----------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        seq = self._admit(request)
        try:
            while True:
                item = await seq.events.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not seq.finished:
                seq.abort_requested = True
                self._reap_if_idle()

    def _admit(self, request: GenerationRequest) -> Seq:
        if self._runner is None:
            raise EngineError("the engine is not started")
        if not self._accepting:
            raise EngineError("the engine is shutting down and admits no new requests")
        if request.request_id in self._seqs:
            raise EngineError(f"request_id {request.request_id!r} is already in flight")
        prompt = list(request.prompt_token_ids)
        n = len(prompt)
        if n == 0:
            raise EngineError("prompt_token_ids is empty; send at least one token")
        for i, token in enumerate(prompt):
            if not 0 <= token < self._vocab_size:
                raise EngineError(
                    f"prompt_token_ids[{i}] = {token} is outside the vocabulary "
                    f"[0, {self._vocab_size})"
                )
        if n >= self.max_model_len:
            raise EngineError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len} "
                f"(at most {self.max_model_len - 1} prompt tokens plus one generated); "
                "shorten the prompt"
            )
        needed = self._blocks.blocks_for(n)
        if needed > self._blocks.num_blocks:
            raise EngineError(
                f"the prompt has {n} tokens and needs {needed} KV blocks of "
                f"{self._blocks.block_size} tokens, but the cache has only "
                f"{self._blocks.num_blocks} (num_kv_blocks); shorten the prompt"
            )
        validate_sampling(request.sampling, self._vocab_size)
        seq = Seq(
            request=request,
            tokens=prompt,
            num_prompt=n,
            arrival=time.monotonic(),
            generator=make_generator(request.sampling),
        )
        self._seqs[request.request_id] = seq
        self._scheduler.add(seq)
        self._counters["requests_total"] += 1
        self._counters["prompt_tokens_total"] += n
        self._wakeup.set()
        return seq

    async def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return
        seq.abort_requested = True
        self._wakeup.set()
        self._reap_if_idle()
        await seq.done.wait()

    # --- the step loop -----------------------------------------------------------------
    async def _step_loop(self) -> None:
        runner = self._require_runner()
        while True:
            try:
                if await self._iteration(runner):
                    return
            except Exception as exc:  # a bookkeeping bug must not hang every stream
                logger.exception("engine step loop failed; failing all in-flight requests")
                for seq in list(self._seqs.values()):
                    self._fail(seq, exc)

    async def _iteration(self, runner: ModelRunner) -> bool:
        """One schedule → compute → apply round; True when the loop should end."""
        self._reap_aborted()
        if self._stopping and not self._scheduler.has_work():
            return True
        if not self._scheduler.has_work():
            if runner.has_pending_stores:
                await self._compute.run(runner.flush_stores)
                return False
            self._wakeup.clear()
            await self._wakeup.wait()
            return False
        waiting = [s for s in self._scheduler.waiting if self._scheduler.lookup_pending(s)]
        if waiting:  # asynchronous lookups (P2P): start them, collect answers
            await self._compute.run(functools.partial(runner.poll_lookups, waiting))
        plan = self._scheduler.schedule()
        for seq in plan.out_of_blocks:
            self._finish(seq, "length")
        if plan.preempted:
            logger.info(
                "out of KV blocks: preempted %s (recomputed later)",
                ", ".join(s.request_id for s in plan.preempted),
            )
        if not plan.items:
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), 0.05)
            return False
        self._step_in_flight = True
        try:
            outputs = await self._compute.run(functools.partial(runner.execute, plan.items))
        except Exception as exc:
            logger.exception("engine step failed; failing its %d requests", len(plan.items))
            for item in plan.items:
                self._fail(item.seq, exc)
            return False
        finally:
            self._step_in_flight = False
        for out in outputs:
            self._apply(out)
        return False

    def _apply(self, out: StepOutput) -> None:
        seq = out.seq
        if seq.finished:
            return
        seq.tokens.append(out.token_id)
        index = seq.num_output
        seq.num_output += 1
        if self._logits_observer is not None:
            self._logits_observer(seq.request_id, index, out.logits)
        self._counters["generated_tokens_total"] += 1
        ttft: float | None = None
        if seq.first_token_at is None:
            seq.first_token_at = out.sampled_at
            ttft = out.sampled_at - seq.arrival
            self._counters["ttft_seconds_sum"] += ttft
            self._counters["ttft_seconds_count"] += 1
            self._counters["ttft_seconds_last"] = ttft
            self._counters["cached_prompt_tokens_total"] += seq.num_cached
        reason = self._finish_reason(seq, out.token_id)
        seq.events.put_nowait(
            TokenEvent(
                request_id=seq.request_id,
                token_id=out.token_id,
                index=index,
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=seq.num_prompt,
                num_cached_tokens=seq.num_cached,
                ttft_s=ttft,
            )
        )
        if reason is not None:
            self._finish(seq, reason, emit=False)

    def _finish_reason(self, seq: Seq, token: int) -> FinishReason | None:
        params = seq.request.sampling
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self._eos_ids:
            return "stop"
        if seq.num_output >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Seq, reason: FinishReason, *, emit: bool = True) -> None:
        if seq.finished:
            return
        runner = self._require_runner()
        runner.cancel_lookup(seq)
        if reason != "abort":
            runner.defer_finished_store(seq)  # the answer's KV too, for the next turn
        self._scheduler.finish(seq, reason)
        self._seqs.pop(seq.request_id, None)
        if reason == "abort":
            self._counters["requests_aborted_total"] += 1
        else:
            self._counters["requests_finished_total"] += 1
        if emit:
            # An event emitted here ends the stream without a new token (the last generated
            # one was already streamed by _apply): it carries the no-token marker.
            seq.events.put_nowait(self._final_event(seq, ABORT_TOKEN_ID, reason))
        seq.done.set()

    def _final_event(self, seq: Seq, token: int, reason: FinishReason) -> TokenEvent:
        return TokenEvent(
            request_id=seq.request_id,
            token_id=token,
            index=seq.num_output,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
        )

    def _emit_abort(self, seq: Seq) -> None:
        if seq.finished:
            return
        seq.status = seq.status.FINISHED
        seq.finish_reason = "abort"
        self._counters["requests_aborted_total"] += 1
        seq.events.put_nowait(self._final_event(seq, ABORT_TOKEN_ID, "abort"))
        seq.done.set()

    def _fail(self, seq: Seq, exc: BaseException) -> None:
        if seq.finished:
            return
        self._require_runner().cancel_lookup(seq)
        try:
            self._scheduler.finish(seq, "abort")
        except Exception:
            logger.exception("could not free the blocks of request %s", seq.request_id)
            seq.status = seq.status.FINISHED
        self._seqs.pop(seq.request_id, None)
        seq.events.put_nowait(RuntimeError(f"engine step failed: {exc}"))
        seq.done.set()

    def _reap_aborted(self) -> None:
        for seq in list(self._seqs.values()):
            if seq.abort_requested and not seq.finished:
                self._finish(seq, "abort")

    def _reap_if_idle(self) -> None:
        """Free aborted requests now unless a step is using their blocks."""
        if not self._step_in_flight:
            self._reap_aborted()

    async def flush(self) -> None:
        """Hand every completed prompt's KV to the offload now (after the running step; else
        deferred to the next step or idle moment), and wait (bounded) for its async writes."""
        runner = self._require_runner()
        await self._compute.run(runner.flush_stores)
        offload_flush = getattr(runner.offload, "flush", None)
        if callable(offload_flush):
            await self._compute.run(offload_flush)

    # --- metrics and the memory API ----------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = dict(self._counters)
        runner = self._runner
        busy = runner.busy_s if runner is not None else 0.0
        out["engine_busy_seconds_total"] = busy
        out["generation_tokens_per_s"] = out["generated_tokens_total"] / busy if busy else 0.0
        out["computed_tokens_total"] = float(runner.computed_tokens) if runner else 0.0
        out["offload_errors_total"] = float(runner.offload_errors) if runner else 0.0
        out["requests_running"] = float(len(self._scheduler.running))
        out["requests_waiting"] = float(len(self._scheduler.waiting))
        out["preemptions_total"] = float(self._scheduler.num_preemptions)
        out["kv_blocks_total"] = float(self._blocks.num_blocks)
        out["kv_blocks_free"] = float(self._blocks.num_free)
        out["kv_cache_usage"] = 1.0 - self._blocks.num_free / self._blocks.num_blocks
        if self.offload is not None:
            out.update(self.offload.metrics())
        return out

    async def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        return await self._on_offload(
            lambda o: o.evict(token_ids=token_ids, chunk_hashes=chunk_hashes, locations=locations)
        )

    async def _on_offload(self, fn: Callable[[KVOffload], int]) -> int:
        """Run ``fn(offload)`` on the compute thread; 0 without an offload."""
        offload = self.offload
        return 0 if offload is None else await self._compute.run(lambda: fn(offload))

    async def lookup(self, token_ids: Sequence[int]) -> int:
        return await self._on_offload(lambda o: o.lookup(token_ids))

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        return await self._on_offload(lambda o: o.prefetch(token_ids))

    async def pin(self, token_ids: Sequence[int]) -> int:
        return await self._on_offload(lambda o: o.pin(token_ids))

    async def unpin(self, token_ids: Sequence[int]) -> int:
        return await self._on_offload(lambda o: o.unpin(token_ids))

    def memory_stats(self) -> dict[str, object]:
        if self.offload is None:
            return {}
        return self.offload.memory_stats()
