"""vLLM's KV-event publisher for the simulated engine's device prefix cache.

Why this module exists: precise routers outside kvpool (vllm-router's ``kv_aware``, Dynamo's
KV router) learn what each engine holds in device memory from vLLM's KV events, not from the
LMCache controller. For them to route on a simulated fleet as on a real one, the simulated
engine publishes what a vLLM + LMCache worker publishes for its GPU prefix cache, in vLLM's wire
format (/work/notes/vllm-kv-events.md has the sources and the vllm-router probe):

- ``--kv-events-config`` is vLLM's JSON (``enable_kv_cache_events``, ``publisher: zmq``,
  ``endpoint`` ``tcp://*:5557``, optional ``replay_endpoint``, ``buffer_steps``, ``hwm``,
  ``topic``). An endpoint with ``*`` or ``::`` is bound (on the worker's ``--host`` when that is a
  specific address, so tests bind 127.0.0.1), any other is connected, as vLLM does; the replay
  endpoint is always bound. ``GET /kv_event_sources`` names the address a router connects to in
  place of the wildcard (the bind address when it is one, else the pod's ``POD_IP``: a router
  refuses ``*`` and ``0.0.0.0`` in a static source);
- one ``[topic, seq (8 bytes big-endian, from 0), msgpack(batch)]`` message per engine step
  that changed the device cache; the batch is ``[time.time(), [events], 0]`` and the events are
  tagged maps (vLLM >= 0.24): ``BlockStored`` (``block_hashes``, ``parent_block_hash``,
  ``token_ids``, ``block_size``, ``lora_id``, ``medium: "GPU"``, ``lora_name``, ``extra_keys``,
  ``group_idx: 0``) when chunks become cached, consecutive chunks of one request in one event,
  and ``BlockRemoved`` when they are evicted. Blocks are the domain's ``--block-size`` (the
  sim caches whole LMCache chunks, so a chunk is published as its ``chunk_size / block_size``
  blocks with their tokens). Hashes are opaque unsigned 64-bit ints (routers never recompute
  them): the last block of a chunk is its LMCache chunk hash (as unsigned), the others hash the
  previous chunk's key, the block index and the tokens, so a block's parent is known from the
  chunk keys alone;
- the replay ROUTER answers ``[b"", start_seq]`` with every buffered batch from ``start_seq``
  (vLLM >= 0.26 framing: ``[id, b"", topic, seq, payload]``) and the end marker
  ``[id, b"", b"", 0xff*8, b""]``.

LMCache's own events (``enable_kv_events``) are not published (the config refuses the key).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool.protocol.simcore.kvcache import KvEvent
from kvpool.worker.contract import Problem
from kvpool.worker.sim.config import SimConfigError

logger = logging.getLogger(__name__)

MASK64 = (1 << 64) - 1
_WILDCARD = re.compile(r"^(?P<scheme>tcp://)(?:\*|0\.0\.0\.0|\[::\])(?P<port>:\d+)$")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of vLLM's KV events: a msgpack map whose first key is ``type``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's ``KVEventsConfig`` (``--kv-events-config``), with its defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def sources(self, host: str | None = None) -> dict[str, dict[str, Any]]:
        """``GET /kv_event_sources``: vLLM's body keyed by DP rank, plus the ``encoding`` and
        ``schema_version`` vllm-router's discovery requires before it subscribes; ``host``
        replaces a wildcard endpoint host (where clients connect)."""
        if not self.enabled:
            return {}
        body = dict(self.__dict__)
        if host:
            for key in ("endpoint", "replay_endpoint"):
                if body[key]:
                    body[key] = advertised(body[key], host)
        body.update(encoding="msgpack", schema_version=1)
        return {"0": body}


def advertised(endpoint: str, host: str) -> str:
    """``tcp://*:5557`` (or ``0.0.0.0``, ``[::]``) as clients reach it: ``tcp://HOST:5557``."""
    m = _WILDCARD.match(endpoint)
    if m is None:
        return endpoint
    return f"{m['scheme']}{f'[{host}]' if ':' in host else host}{m['port']}"


def parse_kv_events_config(text: str | None) -> KvEventsConfig | None:
    """``--kv-events-config``; SimConfigError naming the flag."""
    if not text:
        return None
    flag = "--kv-events-config"
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        fields = set(KvEventsConfig.__dataclass_fields__)
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise TypeError(f"unknown field(s) {', '.join(unknown)}")
        raw.setdefault("publisher", "zmq" if raw.get("enable_kv_cache_events") else "null")
        cfg = KvEventsConfig(**raw)
    except (ValueError, TypeError) as exc:
        raise SimConfigError(
            [Problem(flag, f"is not vLLM's KV-events config ({exc})", 'e.g. {"enable_kv_cache_'
                     'events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}')]
        ) from exc  # fmt: skip
    if cfg.publisher not in ("zmq", "null"):
        raise SimConfigError(
            [Problem(flag, f"publisher {cfg.publisher!r} is not simulated", "use zmq or null")]
        )
    return cfg


def _unsigned(key: int) -> int:
    return key & MASK64


def _local_address(endpoint: str, bind_host: str) -> tuple[str, bool]:
    """(address, bind?) for an endpoint: vLLM binds ``*``/``::`` endpoints and connects others;
    a ``*`` becomes the worker's bind address when that is a specific one."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        if bind_host not in ("", "0.0.0.0", "::", "*"):
            endpoint = endpoint.replace("*", bind_host)
        return endpoint, True
    return endpoint, False


class DeviceEventPublisher:
    """Turns simcore's device admits and evicts into vLLM's KV-event batches on ZMQ."""

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        block_size: int,
        chunk_size: int,
        bind_host: str,
        advertise_host: str | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.advertise_host = advertise_host
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._bind_host = bind_host
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, config.buffer_steps))
        self._content: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # chunk -> parent, tokens
        self._refs: dict[int, int] = {}
        self._blocks: dict[int, list[int]] = {}  # published chunk -> its block hashes
        self.counters = {"kv_event_batches": 0.0, "kv_events": 0.0, "kv_event_unknown_chunks": 0.0}

    def sources(self) -> dict[str, dict[str, Any]]:
        """``GET /kv_event_sources``, naming the advertised host in place of a wildcard."""
        return self.config.sources(self.advertise_host)

    async def start(self) -> None:
        address, bind = _local_address(self.config.endpoint, self._bind_host)
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        try:
            if bind:
                pub.bind(address)
            else:
                pub.connect(address)
            if self.config.replay_endpoint:
                replay_address, _ = _local_address(self.config.replay_endpoint, self._bind_host)
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_address)
        except zmq.ZMQError as exc:
            pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise RuntimeError(
                f"--kv-events-config: cannot open {self.config.endpoint} / "
                f"{self.config.replay_endpoint} ({exc}); give each worker its own ports"
            ) from exc
        self._pub = pub
        if self._replay is not None:
            self._task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")
        logger.info("publishing vLLM KV events on %s (replay %s)", address, self._replay)

    # --- what a request's prompt contributes -------------------------------------------------
    def register(self, keys: Sequence[int], prompt: Sequence[int], full: int) -> None:
        """Remember the tokens of a request's ``full`` chunks until they are published."""
        c = self.chunk_size
        for i in range(min(full, len(keys))):
            key = keys[i]
            self._refs[key] = self._refs.get(key, 0) + 1
            if key not in self._content:
                parent = keys[i - 1] if i else None
                self._content[key] = (parent, tuple(int(t) for t in prompt[i * c : (i + 1) * c]))

    def release(self, keys: Sequence[int], full: int) -> None:
        for key in keys[:full]:
            n = self._refs.get(key, 0) - 1
            if n > 0:
                self._refs[key] = n
            else:
                self._refs.pop(key, None)
                self._content.pop(key, None)

    def _block_hashes(self, key: int, parent: int | None, tokens: tuple[int, ...]) -> list[int]:
        n = max(1, len(tokens) // self.block_size)
        prefix = _unsigned(parent if parent is not None else 0).to_bytes(8, "little")
        out = []
        for j in range(n - 1):
            data = array("I", tokens[: (j + 1) * self.block_size]).tobytes()
            digest = hashlib.blake2b(prefix + j.to_bytes(4, "little") + data, digest_size=8)
            out.append(int.from_bytes(digest.digest(), "big"))
        out.append(_unsigned(key))
        return out

    # --- publishing ---------------------------------------------------------------------------
    def publish(self, events: Sequence[KvEvent]) -> None:
        """One batch for the device events of one engine step (or one memory-API call)."""
        out: list[KVCacheEvent] = []
        for ev in events:
            if ev.op == "admit":
                self._stored(ev.key, out)
            else:
                blocks = self._blocks.pop(ev.key, None)
                if blocks is not None:
                    out.append(BlockRemoved(blocks, MEDIUM_GPU, group_idx=0))
        if out:
            self._send(out)

    def _stored(self, key: int, out: list[KVCacheEvent]) -> None:
        content = self._content.get(key)
        if content is None:
            self.counters["kv_event_unknown_chunks"] += 1
            return
        parent, tokens = content
        blocks = self._block_hashes(key, parent, tokens)
        self._blocks[key] = blocks
        parent_block = _unsigned(parent) if parent is not None else None
        last = out[-1] if out else None
        if isinstance(last, BlockStored) and parent_block == last.block_hashes[-1]:
            last.block_hashes.extend(blocks)
            last.token_ids.extend(tokens)
            assert last.extra_keys is not None
            last.extra_keys.extend([None] * len(blocks))
            return
        out.append(
            BlockStored(
                block_hashes=list(blocks),  # a copy: the event may grow by the next chunk
                parent_block_hash=parent_block,
                token_ids=list(tokens),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * len(blocks),
                group_idx=0,
            )
        )

    def _send(self, events: list[KVCacheEvent]) -> None:
        payload = _ENCODER.encode(EventBatch(time.time(), list(events), 0))
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self.counters["kv_event_batches"] += 1
        self.counters["kv_events"] += len(events)
        if self._pub is not None:
            frames = [self._topic, seq.to_bytes(8, "big"), payload]
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(frames, flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await sock.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await sock.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
