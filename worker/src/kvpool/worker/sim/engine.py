"""``SimEngine``: the simulated engine behind the worker's HTTP runtime (``engine_api.Engine``).

Why this module exists: :class:`~kvpool.protocol.simcore.instance.SimInstance` schedules,
hits, stores and times requests in caller-given *model* time; this module is the asyncio
driver that gives it wall time and turns its results into what the runtime consumes:

- model time is wall time scaled by ``speedup`` (model seconds per wall second, Dynamo's
  mocker ``--speedup-ratio``; below 1 is slow motion): the step that ends at model time ``t``
  is completed at wall time ``t0 + t / speedup``. No timing of its own: every duration comes
  from simcore's performance model. A step the process completes late starts the next one
  late (``complete_step(now=...)``), so a lagging process shows up as latency; the lag is
  exported (``sim_lag_seconds_*``);
- one ``TokenEvent`` per generated token: pseudo-random ids of the tokenizer's vocabulary
  (never a special or stop token), deterministic per prompt and seed, exactly ``max_tokens``
  of them (the sim does not model EOS: finish reason ``length``), the first carrying the
  prompt's cached tokens and TTFT;
- a P2P lookup at a request's arrival when the rendered config enables P2P (its answer is
  ``SimRequest.peer_end``; simcore models the pull), abort when the client goes away, a
  bounded shutdown that deregisters from the controller; before the client registers, a
  bounded wait for a controller that answers (:mod:`kvpool.worker.controller_wait`);
- every admit and evict simcore reports goes to the controller client (LMCache locations)
  or vLLM's KV-event publisher (device, :mod:`.kv_events`), and is counted for ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvpool.protocol.hashing import HashConfig, chunk_hashes
from kvpool.protocol.simcore.instance import (
    InstanceConfig,
    SimInstance,
    SimRequest,
    StepResult,
    SubmitError,
)
from kvpool.protocol.simcore.kvcache import DEVICE, KvEvent
from kvpool.worker.controller_wait import await_controller
from kvpool.worker.engine_api import EngineError, GenerationRequest, TokenEvent
from kvpool.worker.sim.kv_events import DeviceEventPublisher
from kvpool.worker.sim.lmcache_client import ControllerClient
from kvpool.worker.sim.memory import TIER_OF_LOCATION, SimMemory

logger = logging.getLogger(__name__)

ABORT_TOKEN_ID = -1  # token_id of a final event that carries no token
_HIT_TIERS = (("device", "device"), ("ddr", "local_cpu"), ("disk", "local_disk"), ("p2p", "p2p"))


@dataclass(eq=False)
class _Stream:
    """One request's token stream."""

    req: SimRequest
    prompt_hash: int
    seed: int | None
    stop_ids: frozenset[int]
    arrival: float  # loop time
    full: int = 0  # full chunks of the prompt (their tokens go to the KV-event publisher)
    queue: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)
    rng: random.Random | None = None
    done: bool = False
    submitted: bool = False


class SimEngine:
    """One simulated instance; see the module docstring."""

    def __init__(
        self,
        name: str,
        config: InstanceConfig,
        *,
        model_name: str,
        hashing: HashConfig,
        vocab: Sequence[int],
        vocab_size: int,
        speedup: float = 1.0,
        client: ControllerClient | None = None,
        kv_events: DeviceEventPublisher | None = None,
        p2p: bool = False,
        cpu_bytes: int = 0,
        disk_bytes: int = 0,
        worker_port: int = 0,
        controller_wait_s: float = 0.0,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        if not vocab:
            raise ValueError("the vocabulary has no ordinary token to generate")
        self.name = name
        self.model_name = model_name
        self.max_model_len = config.max_model_len
        self.instance = SimInstance(name, config)
        self.hashing = hashing
        self.speedup = speedup
        self.client = client
        #: Seconds to wait for a controller that answers before the client registers
        #: (:mod:`kvpool.worker.controller_wait`; 0: register at once, as LMCache does).
        self.controller_wait_s = controller_wait_s
        #: The controller's URL while that wait runs (``/readyz`` says so).
        self.waiting_for_controller: str | None = None
        self.kv_events = kv_events
        self.p2p = p2p
        self.memory = SimMemory(
            self.instance,
            hashing,
            self._emit,
            cpu_bytes=cpu_bytes,
            disk_bytes=disk_bytes,
            worker_port=worker_port,
            p2p=p2p,
        )
        self._vocab = list(vocab)
        self._vocab_size = vocab_size
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._started = False
        self._accepting = False
        self._counters: dict[str, float] = {}
        self._lag_max = 0.0

    # --- clock ---------------------------------------------------------------------------------
    def model_now(self) -> float:
        """Model seconds since the engine started."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speedup

    @property
    def block_size(self) -> int:
        """The domain's KV block size (``GET /get_server_info``)."""
        return self.instance.config.block_size

    def kv_event_sources(self) -> dict[str, dict[str, object]]:
        """``GET /kv_event_sources``: where vLLM's KV events of this engine are published."""
        return self.kv_events.sources() if self.kv_events is not None else {}

    @property
    def controller_refusal(self) -> str | None:
        """Why the controller refused this worker (the runtime's ``/readyz`` says refused)."""
        return self.client.refusal if self.client is not None else None

    @property
    def lmcache_frozen(self) -> bool:
        """In LMCache's full-sync freeze (its stores are dropped and counted)."""
        return bool(self.instance.frozen)

    def set_frozen(self, frozen: bool) -> None:
        """LMCache's freeze during a full sync: stores are dropped and counted."""
        self.instance.frozen = frozen

    def ddr_keys(self) -> list[int]:
        """The CPU tier's chunks, least recently used first (what a full sync sends)."""
        return self.instance.ddr.keys()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        self._t0 = asyncio.get_running_loop().time()
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.client is not None:
            self.waiting_for_controller = self.client.link.reply_url
            try:
                await await_controller(
                    self.client.link.reply_url,
                    self.client.instance_id,
                    timeout_s=self.controller_wait_s,
                )
            finally:
                self.waiting_for_controller = None
            await self.client.start()
        self._driver = asyncio.create_task(self._drive(), name=f"sim-{self.name}-steps")
        self._started = self._accepting = True
        cfg = self.instance.config
        logger.info(
            "sim engine %s ready: profile %s, speedup %g, %d device blocks, %d DDR chunks, "
            "%d disk chunks, %d KV bytes/token",
            self.name,
            cfg.profile.name,
            self.speedup,
            cfg.device_blocks,
            cfg.ddr_chunks if cfg.lmcache else 0,
            cfg.disk_chunks if cfg.lmcache else 0,
            cfg.kv_bytes_per_token,
        )

    async def shutdown(self, deadline_s: float) -> None:
        """Let running work finish within 3/4 of the deadline, abort the rest, deregister."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(deadline_s, 0.0)
        self._accepting = False
        reserve = min(max(deadline_s * 0.25, 0.2), 5.0)
        while (self.instance.running or self.instance.waiting) and loop.time() < end - reserve:
            await asyncio.sleep(0.01)
        for rid in list(self._streams):
            self._abort_now(rid)
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._driver
        if self.client is not None:
            await self.client.close(min(1.0, max(end - loop.time(), 0.1)))
        if self.kv_events is not None:
            await self.kv_events.close()

    # --- requests --------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        stream = self._admit(request)
        try:
            if self.p2p and self.client is not None and not self.instance.frozen:
                stream.req.peer_end = await self._peer_end(stream.req.keys)
            self._submit(stream)
            while True:
                event = await stream.queue.get()
                yield event
                if event.finished:
                    return
        finally:
            if not stream.done:
                self._abort_now(request.request_id)

    def _admit(self, request: GenerationRequest) -> _Stream:
        if not self._started:
            raise EngineError("the engine is not started")
        if not self._accepting:
            raise EngineError("the engine is shutting down and admits no new requests")
        rid = request.request_id
        if rid in self._streams:
            raise EngineError(f"request_id {rid!r} is already in flight")
        prompt = [int(t) for t in request.prompt_token_ids]
        if not prompt:
            raise EngineError("prompt_token_ids is empty; send at least one token")
        for i, token in enumerate(prompt):
            if not 0 <= token < self._vocab_size:
                raise EngineError(
                    f"prompt_token_ids[{i}] = {token} is outside the vocabulary "
                    f"[0, {self._vocab_size})"
                )
        if request.kv_transfer is not None:
            raise EngineError("PD is not simulated: this worker hands no KV to a decoder")
        sampling = request.sampling
        req = SimRequest(rid, tuple(chunk_hashes(prompt, self.hashing)), len(prompt), 0, 0.0)
        req.max_tokens = sampling.max_tokens
        stream = _Stream(
            req=req,
            prompt_hash=hash(tuple(prompt)),
            seed=sampling.seed,
            stop_ids=frozenset(sampling.stop_token_ids),
            arrival=asyncio.get_running_loop().time(),
        )
        if self.kv_events is not None:
            stream.full = min(len(req.keys), len(prompt) // self.instance.config.chunk_size)
            self.kv_events.register(req.keys, prompt, stream.full)
        self._streams[rid] = stream
        return stream

    async def _peer_end(self, keys: tuple[int, ...]) -> int:
        """LMCache's async lookup: the hashes from the CPU tier's first miss go to the
        controller's P2P lookup; a peer's hit extends the prefix from there."""
        assert self.client is not None
        ddr = self.instance.ddr
        start = 0
        while start < len(keys) and keys[start] in ddr:
            start += 1
        if start >= len(keys):
            return 0
        hit = await self.client.p2p_lookup(list(keys[start:]))
        return start + hit if hit else 0

    def _submit(self, stream: _Stream) -> None:
        req = stream.req
        try:
            self.instance.submit(req, self.model_now())
        except SubmitError as exc:
            self._streams.pop(req.rid, None)
            self._ended(stream)
            raise EngineError(str(exc)) from exc
        stream.submitted = True
        self._count("requests_total")
        self._count("prompt_tokens_total", req.prompt_tokens)
        self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None or stream.done:
            return
        if stream.submitted:
            self.instance.abort(rid)
        self._ended(stream)
        self._count("requests_aborted_total")
        stream.queue.put_nowait(
            TokenEvent(rid, ABORT_TOKEN_ID, stream.req.generated, True, "abort")
        )

    # --- the step loop ---------------------------------------------------------------------------
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        inst = self.instance
        while True:
            end = inst.next_time
            if end is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = self._t0 + end / self.speedup - loop.time()
            await asyncio.sleep(max(delay, 0.0))  # 0: still yield to the HTTP side
            if inst.next_time != end:
                continue
            now = self.model_now()
            lag = max(0.0, now - end) / self.speedup
            self._count("sim_lag_seconds_total", lag)
            self._lag_max = max(self._lag_max, lag)
            try:
                result = inst.complete_step(now=now)
            except Exception as exc:  # a bookkeeping bug must not hang every stream
                logger.exception("sim engine %s: step failed; failing its requests", self.name)
                self._fail_all(exc)
                continue
            self._deliver(result)

    def _deliver(self, result: StepResult) -> None:
        loop_now = asyncio.get_running_loop().time()
        finished = {r.rid for r in result.finished}
        for r in result.tokens:
            stream = self._streams.get(r.rid)
            if stream is None:
                continue
            last = r.rid in finished
            first = r.generated == 1
            event = TokenEvent(
                r.rid,
                self._token(stream),
                r.generated - 1,
                finished=last,
                finish_reason="length" if last else None,
                num_prompt_tokens=r.prompt_tokens if first else 0,
                num_cached_tokens=r.cached_tokens,
                ttft_s=loop_now - stream.arrival if first else None,
            )
            self._count("generated_tokens_total")
            if first:
                self._first_token(r, event.ttft_s or 0.0)
            if last:
                self._ended(stream)
                self._streams.pop(r.rid, None)
                self._count("requests_finished_total")
            stream.queue.put_nowait(event)
        self._emit(result.events)

    def _ended(self, stream: _Stream) -> None:
        stream.done = True
        if self.kv_events is not None:
            self.kv_events.release(stream.req.keys, stream.full)

    def _token(self, stream: _Stream) -> int:
        if stream.rng is None:
            stream.rng = random.Random(f"{stream.seed}:{stream.prompt_hash}")
        while True:
            token = stream.rng.choice(self._vocab)
            if token not in stream.stop_ids:
                return token

    def _first_token(self, r: SimRequest, ttft: float) -> None:
        self._count("ttft_seconds_sum", ttft)
        self._count("ttft_seconds_count")
        self._counters["ttft_seconds_last"] = ttft
        self._count("cached_prompt_tokens_total", r.cached_tokens)
        if r.cached_tokens == 0:
            self._count("miss_requests_total")
        left, chunk = r.cached_tokens, self.instance.config.chunk_size
        for hit_tier, name in _HIT_TIERS:
            tokens = min(r.hit_chunks.get(hit_tier, 0) * chunk, left)
            left -= tokens
            if tokens:
                self._count(f"cached_tokens_total.{name}", tokens)
                if hit_tier != "device":
                    kv = self.instance.config.kv_bytes_per_token
                    self._count(f"loaded_bytes_total.{name}", tokens * kv)

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self._streams):
            self._abort_now(rid)
        logger.error("sim engine %s: every in-flight request aborted after %r", self.name, exc)

    def _emit(self, events: list[KvEvent]) -> None:
        """Count admits and evicts per tier; LMCache's go to the controller, device ones to
        vLLM's KV-event publisher (one batch per call: per step)."""
        if not events:
            return
        device: list[KvEvent] = []
        for ev in events:
            tier = TIER_OF_LOCATION.get(ev.location, ev.location)
            self._count(f"{'stored' if ev.op == 'admit' else 'evicted'}_chunks_total.{tier}")
            if ev.location == DEVICE:
                device.append(ev)
            elif self.client is not None:
                self.client.kv_op(ev.location, ev.op, ev.key)
        if device and self.kv_events is not None:
            self.kv_events.publish(device)

    def _count(self, name: str, value: float = 1.0) -> None:
        self._counters[name] = self._counters.get(name, 0.0) + value

    # --- metrics and the memory API --------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        inst = self.instance
        cfg = inst.config
        stats = inst.stats()
        out = dict(self._counters)
        out.update(self.memory.counters)
        out["sim_speedup"] = self.speedup
        out["sim_lag_seconds_max"] = self._lag_max
        out["engine_busy_seconds_total"] = stats["busy_s"]
        out["steps_total"] = stats["steps"]
        out["requests_running"] = stats["running"]
        out["requests_waiting"] = stats["waiting"]
        out["queued_prefill_tokens"] = float(inst.queued_prefill_tokens())
        out["kv_blocks_total"] = float(cfg.device_blocks)
        out["kv_blocks_free"] = float(cfg.device_blocks - inst.device.used_blocks)
        out["kv_cache_usage"] = inst.device.used_blocks / cfg.device_blocks
        out["tier_chunks.device"] = float(len(inst.device))
        if cfg.lmcache:
            for name, tier in (("local_cpu", inst.ddr), ("local_disk", inst.disk)):
                if name == "local_cpu" or tier.capacity:
                    out[f"tier_chunks.{name}"] = float(len(tier))
                    out[f"tier_capacity_chunks.{name}"] = float(tier.capacity)
                    out[f"tier_used_bytes.{name}"] = float(len(tier) * cfg.chunk_bytes)
            out["stored_bytes.local_cpu"] = (
                self._counters.get("stored_chunks_total.local_cpu", 0.0) * cfg.chunk_bytes
            )
            out["store_skipped_frozen_tokens"] = stats["store_skipped_frozen_tokens"]
            out["lmcache_frozen"] = 1.0 if inst.frozen else 0.0
        if self.kv_events is not None:
            out.update({f"{k}_total": v for k, v in self.kv_events.counters.items()})
        if self.client is not None:
            out.update(self.client.metrics())
            for loc, batcher in self.client.batchers.items():
                out[f"lmcache_kv_ops_sent_total.{TIER_OF_LOCATION[loc]}"] = batcher.sent_ops
        return out

    async def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        return self.memory.evict(
            token_ids=token_ids, chunk_hashes=chunk_hashes, locations=locations
        )

    async def lookup(self, token_ids: Sequence[int]) -> int:
        return self.memory.lookup(token_ids)

    async def prefetch(self, token_ids: Sequence[int]) -> int:
        return self.memory.prefetch(token_ids)

    async def pin(self, token_ids: Sequence[int]) -> int:
        return self.memory.pin(token_ids)

    async def unpin(self, token_ids: Sequence[int]) -> int:
        return self.memory.unpin(token_ids)

    def memory_stats(self) -> dict[str, object]:
        return self.memory.stats(
            self._counters.get("cached_prompt_tokens_total", 0.0),
            self._counters.get("miss_requests_total", 0.0),
        )
