"""One simulated engine instance: a request queue, continuous batching, prefix hits, KV stores.

Why this module exists: the simulated worker and the fleet simulator must schedule, hit, store
and time requests identically (see the package docstring). The scheduling follows vLLM v1 with
chunked prefill, LMCache under it:

- each step first gives every decoding request one token, then continues partial prefills,
  then admits waiting requests first come first served while fewer than ``max_num_seqs`` run,
  the step's token budget (``max_num_batched_tokens``) lasts and the device has room for the
  request's whole lifetime (prompt and every token it may generate: never preempted);
- an admitted request reuses the leading chunks already in device memory (vLLM's prefix
  cache; free), then LMCache's contiguous hit in DDR then disk from there (each tier
  continues where the previous stopped), then what a peer holds (P2P); loading those costs
  the profile's bandwidth of the tier, once, in the request's first step. At most
  ``prompt - 1`` tokens are reused (the engine recomputes at least the last one);
- a chunk whose tokens have all been computed is stored to LMCache (DDR, and disk when
  configured: write-through) at the end of that step, unless it was loaded from LMCache or a
  peer (vLLM's connector skips the tokens it loaded); the step pays the store's copy. A chunk
  already held is not admitted again. While ``frozen`` (LMCache's full-sync freeze) stores are
  skipped and counted;
- the step that computes a prompt's last token also samples its first output token; each
  later step one more, until ``max_tokens``.

The caller owns the clock: :meth:`SimInstance.submit` at the arrival time,
:meth:`SimInstance.complete_step` at :attr:`SimInstance.next_time`. A caller in real time that
ends a step late passes ``now``: the next step then starts at ``now`` instead of when the step
ended, so a lagging process shows up as latency instead of being caught up. A step in
progress is not changed by an arrival; the request waits for the next step, as in vLLM. For a
fleet in virtual time, ``complete_step(fast=True)`` plans a stretch of identical decode-only
steps as one (closed form of the same per-step model); an arrival during a stretch cuts it after
the step in progress at that moment, so the result equals stepping one by one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.protocol.simcore.kvcache import DEVICE, DeviceCache, KvEvent, LRUTier
from kvpool.protocol.simcore.profile import PerfProfile
from kvpool.protocol.tiers import BACKENDS, LOCAL_CPU, LOCAL_DISK

__all__ = [
    "CPU_BACKEND",
    "DISK_BACKEND",
    "InstanceConfig",
    "SimInstance",
    "SimRequest",
    "StepResult",
    "SubmitError",
]

CPU_BACKEND = next(b.name for b in BACKENDS if b.local_name == LOCAL_CPU)
DISK_BACKEND = next(b.name for b in BACKENDS if b.local_name == LOCAL_DISK)


class SubmitError(ValueError):
    """A request this instance can never run (longer than the model or the device)."""


@dataclass(frozen=True)
class InstanceConfig:
    """Sizes and limits of one instance (what the operator renders for it)."""

    profile: PerfProfile
    chunk_size: int
    block_size: int
    kv_bytes_per_token: int  # the pool's model, every TP rank together
    device_blocks: int
    ddr_chunks: int  # LocalCPUBackend capacity; 0 with no LMCache
    disk_chunks: int = 0  # LocalDiskBackend capacity; 0 without a disk tier
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    lmcache: bool = True
    touch_on_hit: bool = True  # a synchronous retrieve refreshes recency; async loading does not

    def __post_init__(self) -> None:
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"chunk_size {self.chunk_size} must be a multiple of block_size {self.block_size}"
            )

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_size * self.kv_bytes_per_token


@dataclass(eq=False)
class SimRequest:
    """One request. ``keys``: LMCache chunk hashes of the prompt (its full chunks, then at most
    one partial chunk when the domain saves unfull chunks); ``peer_end``: how many leading keys
    some peer can serve (the P2P lookup's answer at arrival; 0 without P2P)."""

    rid: str
    keys: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int
    arrival: float
    peer_end: int = 0
    # --- filled in by the instance
    ready_at: float = 0.0  # arrival + the profile's per-request API time
    phase: str = "waiting"  # waiting, prefill, decode, done, aborted
    scheduled_at: float | None = None
    computed: int = 0  # prompt tokens whose KV is on the device
    generated: int = 0
    cached_tokens: int = 0
    hit_chunks: dict[str, int] = field(default_factory=dict)  # tier class -> chunks reused
    first_token_at: float | None = None
    finished_at: float | None = None
    full: int = 0  # full chunks of the prompt
    reused: int = 0  # leading keys loaded from a cache (not stored again)
    ready: int = 0  # leading full chunks whose KV is on the device
    anon_blocks: int = 0


@dataclass
class StepResult:
    """What happened when a step (or a stretch of ``steps`` decode-only steps) ended."""

    time: float
    steps: int = 1
    first_tokens: list[SimRequest] = field(default_factory=list)
    tokens: list[SimRequest] = field(default_factory=list)  # every request that got a token
    finished: list[SimRequest] = field(default_factory=list)
    events: list[KvEvent] = field(default_factory=list)


@dataclass
class _Plan:
    """The step in progress."""

    start: float
    end: float
    decodes: list[SimRequest]
    prefills: list[tuple[SimRequest, int]]  # request, tokens computed this step
    events: list[KvEvent]  # of planning it (device reclaims), reported when it ends
    steps: int = 1
    ctx0: int = 0  # decode context of the first step of a stretch
    per_step: float = 0.0  # the part of a decode-only step that does not grow with context


class SimInstance:
    """One engine; see the module docstring."""

    def __init__(self, name: str, config: InstanceConfig) -> None:
        self.name = name
        self.config = config
        self.profile = config.profile
        self.device = DeviceCache(config.device_blocks, config.chunk_size // config.block_size)
        self.ddr = LRUTier(CPU_BACKEND, config.ddr_chunks if config.lmcache else 0)
        self.disk = LRUTier(DISK_BACKEND, config.disk_chunks if config.lmcache else 0)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.frozen = False
        self._plan: _Plan | None = None
        self.counters: dict[str, float] = dict.fromkeys(
            (
                "requests",
                "prompt_tokens",
                "cached_tokens",
                "stored_chunks",
                "store_skipped_frozen_chunks",
                "store_skipped_frozen_tokens",
                "generated_tokens",
                "steps",
                "busy_s",
            ),
            0,
        )

    # ------------------------------------------------------------------ queries
    @property
    def next_time(self) -> float | None:
        """When the step in progress ends (None: idle)."""
        return self._plan.end if self._plan is not None else None

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, of every request waiting or prefilling."""
        return sum(r.prompt_tokens - r.computed for r in self.waiting) + sum(
            r.prompt_tokens - r.computed for r in self.running if r.phase == "prefill"
        )

    def lookup(self, keys: Sequence[int]) -> dict[str, int]:
        """Leading chunks each tier would serve now: device, then DDR from where it stopped,
        then disk from where DDR stopped."""
        dev = self.device.match(keys)
        ddr = _run(self.ddr, keys, dev)
        disk = _run(self.disk, keys, dev + ddr)
        return {"device": dev, "ddr": ddr, "disk": disk}

    # ------------------------------------------------------------------ requests
    def submit(self, req: SimRequest, now: float) -> None:
        """Queue a request that arrived at ``now``; start a step if the engine was idle."""
        cfg = self.config
        total = req.prompt_tokens + req.max_tokens
        if req.prompt_tokens < 1 or req.max_tokens < 1:
            raise SubmitError("a request needs at least one prompt token and one to generate")
        if total > cfg.max_model_len:
            raise SubmitError(
                f"{req.prompt_tokens} prompt + {req.max_tokens} max tokens > max_model_len "
                f"{cfg.max_model_len}"
            )
        if -(-total // cfg.block_size) > cfg.device_blocks:
            raise SubmitError(
                f"{total} tokens need more KV blocks than the device holds ({cfg.device_blocks})"
            )
        req.full = min(len(req.keys), req.prompt_tokens // cfg.chunk_size)
        req.ready_at = now + self.profile.request_s
        self.waiting.append(req)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += req.prompt_tokens
        if self._plan is None:
            self._start(now, fast=False)
        elif self._plan.steps > 1:
            self._cut(req.ready_at)

    def abort(self, rid: str) -> SimRequest | None:
        """Stop a request (client gone); its device blocks are released at once."""
        for r in self.waiting:
            if r.rid == rid:
                self.waiting.remove(r)
                r.phase = "aborted"
                return r
        for r in self.running:
            if r.rid == rid:
                self._retire(r, "aborted")
                return r
        return None

    def _retire(self, r: SimRequest, phase: str) -> None:
        self.running.remove(r)
        r.phase = phase
        self.device.release(r.keys[: r.full], r.anon_blocks)

    # ------------------------------------------------------------------ stepping
    def complete_step(self, *, fast: bool = False, now: float | None = None) -> StepResult:
        """End the step in progress (at :attr:`next_time`) and start the next one, if any.

        ``fast``: plan the next step as a stretch of identical decode-only steps when it is
        one (no per-token results; same times as stepping one by one). ``now``: when the
        caller really ends the step (real time, possibly later than :attr:`next_time`); the
        next step starts then, never before the step ended.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError(f"{self.name}: no step in progress")
        out = StepResult(plan.end, plan.steps, events=plan.events)
        if plan.decodes or plan.prefills:
            self.counters["steps"] += plan.steps
            self.counters["busy_s"] += plan.end - plan.start
        for r in plan.decodes:
            if r.phase != "decode":
                continue  # aborted during the step
            r.generated += plan.steps
            self.counters["generated_tokens"] += plan.steps
            out.tokens.append(r)
            if r.generated >= r.max_tokens:
                r.finished_at = plan.end
                self._retire(r, "done")
                out.finished.append(r)
        for r, n in plan.prefills:
            if r.phase != "prefill":
                continue
            before = r.computed
            r.computed += n
            self._computed(r, before, out.events)
            if r.computed >= r.prompt_tokens:
                r.generated = 1
                r.first_token_at = plan.end
                self.counters["generated_tokens"] += 1
                out.first_tokens.append(r)
                out.tokens.append(r)
                if r.max_tokens <= 1:
                    r.finished_at = plan.end
                    self._retire(r, "done")
                    out.finished.append(r)
                else:
                    r.phase = "decode"
        self._plan = None
        if self.waiting or self.running:
            self._start(plan.end if now is None else max(plan.end, now), fast=fast)
        return out

    def _stored_span(self, r: SimRequest, before: int, after: int) -> tuple[int, int]:
        """Indices ``[first, last)`` of the keys completed by computing prompt tokens
        ``before..after`` that LMCache stores."""
        c = self.config.chunk_size
        first = max(before // c, r.reused)
        last = len(r.keys) if after >= r.prompt_tokens else after // c
        return first, max(first, last)

    def _stored_keys(self, r: SimRequest, before: int, after: int) -> tuple[int, ...]:
        first, last = self._stored_span(r, before, after)
        return r.keys[first:last]

    def _computed(self, r: SimRequest, before: int, events: list[KvEvent]) -> None:
        """Tokens ``before..r.computed`` are computed: device chunks ready, LMCache stores."""
        ready = min(r.full, max(r.computed // self.config.chunk_size, r.reused))
        if ready > r.ready:
            self.device.mark_ready(r.keys[r.ready : ready], events)
            r.ready = ready
        first, last = self._stored_span(r, before, r.computed)
        keys = r.keys[first:last]
        if not keys or not self.config.lmcache:
            return
        if self.frozen:  # LMCache drops every store during a full sync: count chunks and tokens
            c = self.config.chunk_size
            self.counters["store_skipped_frozen_chunks"] += len(keys)
            self.counters["store_skipped_frozen_tokens"] += (
                min(last * c, r.prompt_tokens) - first * c
            )
            return
        self.counters["stored_chunks"] += self.ddr.put(keys, events)
        if self.disk.capacity:
            self.disk.put(keys, events)

    def _admit(self, r: SimRequest, now: float, events: list[KvEvent]) -> float | None:
        """Schedule a waiting request: hits, device blocks and load seconds; None: no room."""
        cfg = self.config
        hit = self.lookup(r.keys)
        dev = min(hit["device"], r.full)
        ddr, disk = hit["ddr"], hit["disk"]
        peer = max(0, min(r.peer_end, len(r.keys)) - (dev + ddr + disk))
        reused = dev + ddr + disk + peer
        blocks = -(-(r.prompt_tokens + r.max_tokens) // cfg.block_size)
        anon = blocks - r.full * self.device.blocks_per_chunk
        if not self.device.fits(r.keys[: r.full], anon):
            return None
        self.device.acquire(r.keys[: r.full], anon, events)
        r.anon_blocks = anon
        reused_tokens = r.prompt_tokens if reused > r.full else reused * cfg.chunk_size
        r.cached_tokens = r.computed = min(reused_tokens, r.prompt_tokens - 1)
        r.reused = reused
        r.hit_chunks = {"device": dev, "ddr": ddr, "disk": disk, "p2p": peer}
        r.phase = "prefill"
        r.scheduled_at = now
        self.counters["cached_tokens"] += r.cached_tokens
        if cfg.touch_on_hit:
            for key in reversed(r.keys[dev : dev + ddr]):
                self.ddr.touch(key)
            if disk:  # a synchronous retrieve from disk writes the chunks back to DDR
                self.ddr.put(r.keys[dev + ddr : dev + ddr + disk], events)
        loaded = {"ddr": ddr, "disk": disk, "p2p": peer}
        return sum(self.profile.load_s(t, n * cfg.chunk_bytes) for t, n in loaded.items() if n)

    def _start(self, now: float, *, fast: bool) -> None:
        cfg, step = self.config, self.profile.step
        budget = cfg.max_num_batched_tokens
        decodes = [r for r in self.running if r.phase == "decode"]
        budget -= len(decodes)
        ctx = sum(r.prompt_tokens + r.generated for r in decodes)
        prefills: list[tuple[SimRequest, int]] = []
        for r in self.running:
            if r.phase == "prefill" and budget > 0:
                n = min(r.prompt_tokens - r.computed, budget)
                prefills.append((r, n))
                budget -= n
        events: list[KvEvent] = []
        moved = 0.0  # seconds of KV loads and stores
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            r = self.waiting[0]
            if r.ready_at > now:
                break  # still in the API server
            load = self._admit(r, now, events)
            if load is None:
                break  # first come first served: the head waits for device room
            self.waiting.popleft()
            self.running.append(r)
            moved += load
            n = min(r.prompt_tokens - r.computed, budget)
            prefills.append((r, n))
            budget -= n
        pairs = 0.0
        stored = 0
        for r, n in prefills:
            pairs += n * (r.computed + n / 2)
            stored += len(self._stored_keys(r, r.computed, r.computed + n))
        if stored and cfg.lmcache and not self.frozen:
            moved += self.profile.store_s(stored * cfg.chunk_bytes)
        if not decodes and not prefills:
            # nothing runs: the head is still in the API server (submit refuses a request an
            # empty device cannot hold, so it is never waiting for room here)
            wake = self.waiting[0].ready_at if self.waiting else now
            self._plan = _Plan(now, max(now, wake), [], [], events)
            return
        prefill_tokens = sum(n for _, n in prefills)
        t = step.step_s(prefill_tokens, pairs, len(decodes), ctx) + moved
        plan = _Plan(now, now + t, decodes, prefills, events)
        if fast and not prefills and not self.waiting:
            k = min(r.max_tokens - r.generated for r in decodes)
            if k > 1:
                plan.per_step = step.overhead_s + step.decode_seq_s * len(decodes)
                plan.ctx0 = ctx
                plan.steps = k
                plan.end = now + self._stretch(plan, k)
        self._plan = plan

    def _stretch(self, plan: _Plan, k: int) -> float:
        """Seconds of ``k`` decode-only steps from the plan's start (each step the batch's
        context grows by one token per sequence)."""
        d = len(plan.decodes)
        per_ctx = self.profile.step.decode_ctx_s
        return k * plan.per_step + per_ctx * (k * plan.ctx0 + d * k * (k - 1) / 2)

    def _cut(self, now: float) -> None:
        """An arrival during a decode-only stretch: the stretch ends with the step in progress
        at ``now``; the request joins the step after it."""
        plan = self._plan
        assert plan is not None
        elapsed = max(0.0, now - plan.start)
        d = len(plan.decodes)
        a = self.profile.step.decode_ctx_s * d / 2
        b = plan.per_step + self.profile.step.decode_ctx_s * (plan.ctx0 - d / 2)
        if a > 0:
            k = int((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
        else:
            k = int(elapsed / b) if b > 0 else plan.steps
        k = max(0, min(k, plan.steps))
        while k > 0 and self._stretch(plan, k) > elapsed:
            k -= 1
        while k < plan.steps and self._stretch(plan, k + 1) <= elapsed:
            k += 1
        plan.steps = min(plan.steps, k + 1)
        plan.end = plan.start + self._stretch(plan, plan.steps)

    # ------------------------------------------------------------------ cache control
    def evict(self, keys: Sequence[int], locations: Sequence[str] | None = None) -> list[KvEvent]:
        """Drop chunks from the given locations (LMCache backend names or ``device``; default
        every tier): the memory API's evict and the controller's clear. Held chunks (a running
        request's device blocks, pinned DDR chunks) stay."""
        wanted = set(locations) if locations is not None else None
        events: list[KvEvent] = []
        for tier in (self.ddr, self.disk):
            if wanted is None or tier.location in wanted:
                tier.remove(keys, events)
        if wanted is None or DEVICE in wanted:
            self.device.drop(keys, events)
        return events

    def prefetch(self, keys: Sequence[int]) -> tuple[int, list[KvEvent]]:
        """Bring the prefix's chunks that only the disk holds into DDR; returns the leading
        chunks now in DDR and the events."""
        events: list[KvEvent] = []
        n = 0
        for key in keys:
            if key not in self.ddr:
                if key not in self.disk:
                    break
                if not self.ddr.put([key], events):
                    break
            n += 1
        return n, events

    def stats(self) -> dict[str, float]:
        """Counters and current sizes (chunks and blocks)."""
        out = dict(self.counters)
        out.update(
            running=len(self.running),
            waiting=len(self.waiting),
            device_chunks=len(self.device),
            device_used_blocks=self.device.used_blocks,
            device_capacity_blocks=self.config.device_blocks,
            ddr_chunks=len(self.ddr),
            ddr_capacity_chunks=self.ddr.capacity,
            ddr_pinned_chunks=self.ddr.pinned,
            disk_chunks=len(self.disk),
            disk_capacity_chunks=self.disk.capacity,
        )
        return out


def _run(tier: LRUTier, keys: Sequence[int], start: int) -> int:
    n = 0
    for key in keys[start:]:
        if key not in tier:
            break
        n += 1
    return n
