"""A PD receiver's buffer with the real LMCache 0.5.6 PD backend (NIXL over UCX on 127.0.0.1):
transfers nobody claims are freed after the TTL or on release, never under a retrieve.

The test is the sender: it sends LMCache's own ``AllocRequest`` (msgpack over the receiver's
ZMQ alloc socket, what ``PDBackend._remote_allocate`` sends) for a prompt's chunk keys and
never follows with a decode, which is what every unclaimed transfer looks like to the
receiver. LMCache itself allocates the pages and files the chunks (``_allocate_and_put``);
the receiver's allocator shows the buffer filling. Time is passed to ``reap`` explicitly, so
nothing here waits for a TTL.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.pd_backend import AllocRequest, AllocResponse, PDMsg

from kvpool.protocol.pd import DEFAULT_UNCLAIMED_TTL_SECONDS, UNCLAIMED_TTL_KEY
from kvpool.worker.engine.offload import OffloadConfigError
from kvpool.worker.engine.offload.pd_buffer import UnclaimedTracker

pytestmark = pytest.mark.timeout(180)
TTL_S = 30.0
CHUNK = 256


def receiver_config(free_port: Callable[[], int], **extra: Any) -> dict[str, Any]:
    return {
        "chunk_size": CHUNK, "local_cpu": False, "enable_pd": True, "pd_role": "receiver",
        "pd_buffer_size": 16 * 2**20, "pd_buffer_device": "cpu", "pd_peer_host": "127.0.0.1",
        "pd_peer_init_port": [free_port()], "pd_peer_alloc_port": [free_port()],
        "transfer_channel": "nixl", "nixl_backends": ["UCX"], "extra_config": extra,
    }  # fmt: skip


@pytest.fixture
def receiver(make_offload: Callable[..., Any], free_tcp_port: Callable[[], int]) -> Any:
    return make_offload(receiver_config(free_tcp_port, **{UNCLAIMED_TTL_KEY: TTL_S}))


@pytest.fixture
def sender(receiver: Any) -> Iterator[Callable[[list[int]], AllocResponse]]:
    """Asks the receiver for space for a prompt, as LMCache's sender does, and never writes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(f"tcp://127.0.0.1:{receiver.config.pd_peer_alloc_port[0]}")
    shape = [2, receiver.num_layers, CHUNK, receiver.connector.row_width]

    def alloc(tokens: list[int]) -> AllocResponse:
        keys = receiver.chunk_keys(tokens)  # PD forces save_unfull_chunk: the partial one too
        last = len(tokens) - (len(keys) - 1) * CHUNK
        request = AllocRequest(keys=keys, fmt=MemoryFormat.KV_2LTD.value, shape=list(shape),
                               dtype=TORCH_DTYPE_TO_STR_DTYPE[torch.float32],
                               last_chunk_toks=last)  # fmt: skip
        sock.send(msgspec.msgpack.encode(request))
        reply = msgspec.msgpack.decode(sock.recv(), type=PDMsg)
        assert isinstance(reply, AllocResponse)
        return reply

    yield alloc
    sock.close(linger=0)
    ctx.term()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(n)]


def usage(off: Any) -> dict[str, float]:
    return {k: v for k, v in off.metrics().items() if k.startswith("pd_")}


def test_unclaimed_transfers_fill_the_buffer_until_the_ttl_frees_them(
    receiver: Any, sender: Callable[[list[int]], AllocResponse]
) -> None:
    buffer = receiver._pd_buffer
    page = int(buffer._pages.align_bytes)
    m = usage(receiver)
    assert m["pd_buffer_used_bytes"] == 0 and m["pd_unclaimed_ttl_seconds"] == TTL_S
    assert m["pd_buffer_capacity_bytes"] == 16 * 2**20 // page * page
    t0 = time.monotonic()
    prompts = [prompt(600, 1), prompt(90, 2), prompt(300, 3)]  # 3 + 1 + 2 pages
    for tokens in prompts:
        reply = sender(tokens)
        assert len(reply.remote_indexes) == -(-len(tokens) // CHUNK)
    assert usage(receiver)["pd_buffer_used_bytes"] == 6 * page  # the buffer fills
    assert buffer.reap(t0) == (0, 0)  # first seen
    assert buffer.reap(t0 + TTL_S - 1) == (0, 0)
    assert buffer.reap(t0 + TTL_S) == (6, 6 * page)
    m = usage(receiver)
    assert m["pd_buffer_used_bytes"] == 0 and m["pd_buffer_chunks"] == 0
    assert m["pd_unclaimed_freed_total"] == 6 and m["pd_unclaimed_freed_bytes_total"] == 6 * page
    # the freed pages serve new transfers: the same prompt is allocated afresh
    assert len(sender(prompts[0]).remote_indexes) == 3


def test_a_release_frees_one_transfer_of_each_chunk_and_the_ttl_the_rest(
    receiver: Any, sender: Callable[[list[int]], AllocResponse]
) -> None:
    buffer = receiver._pd_buffer
    page = int(buffer._pages.align_bytes)
    shared = prompt(512, 4)
    a, b = [*shared, 11, 12], [*shared, 13]  # two full chunks in common, own partial chunks
    sender(a)
    t0 = time.monotonic()
    buffer.reap(t0)
    assert sender(b).already_sent_indexes == [0, 1]  # LMCache pins the shared chunks again
    buffer.reap(t0 + 5)  # their second transfer restarts their clock; b's partial is new
    assert usage(receiver)["pd_buffer_used_bytes"] == 4 * page
    assert receiver.release_transfer(a, "req-a") == 3  # a's partial freed, shared: one ref
    m = usage(receiver)
    assert m["pd_buffer_used_bytes"] == 3 * page and m["pd_released_bytes_total"] == page
    assert receiver.release_transfer(a, "req-a") == 0  # a retried release drops nothing
    assert buffer.reap(t0 + TTL_S) == (0, 0)
    assert buffer.reap(t0 + 5 + TTL_S) == (3, 3 * page)  # b, never claimed
    assert usage(receiver)["pd_buffer_used_bytes"] == 0


def test_nothing_is_freed_while_the_decoder_looks_up_or_retrieves(
    receiver: Any, sender: Callable[[list[int]], AllocResponse]
) -> None:
    """``lookup`` and ``retrieve`` run under the offload's lock: a scan waits for them."""
    buffer = receiver._pd_buffer
    sender(prompt(300, 5))
    t0 = time.monotonic()
    buffer.reap(t0)
    held, go = threading.Event(), threading.Event()

    def decoder() -> None:
        with receiver._lock:  # what retrieve holds from its lookup to its last chunk
            held.set()
            go.wait(10)

    thread = threading.Thread(target=decoder)
    thread.start()
    assert held.wait(10)
    result: list[tuple[int, int]] = []
    scan = threading.Thread(target=lambda: result.append(buffer.reap(t0 + TTL_S)))
    scan.start()
    scan.join(0.5)
    assert scan.is_alive() and usage(receiver)["pd_buffer_chunks"] == 2
    go.set()
    thread.join(10)
    scan.join(10)
    assert result == [(2, 2 * int(buffer._pages.align_bytes))]


def test_the_ttl_is_read_from_extra_config_with_a_default_and_checked(
    make_offload: Callable[..., Any], free_tcp_port: Callable[[], int]
) -> None:
    off = make_offload(receiver_config(free_tcp_port))
    assert off.metrics()["pd_unclaimed_ttl_seconds"] == DEFAULT_UNCLAIMED_TTL_SECONDS
    with pytest.raises(OffloadConfigError, match=f"extra_config.{UNCLAIMED_TTL_KEY}.*got 0"):
        make_offload(receiver_config(free_tcp_port, **{UNCLAIMED_TTL_KEY: 0}))
    with pytest.raises(OffloadConfigError, match=r"spec\.transfer\.unclaimedTTLSeconds"):
        make_offload(receiver_config(free_tcp_port, **{UNCLAIMED_TTL_KEY: "1m"}))


def test_the_tracker_restarts_a_chunk_on_a_new_page_or_a_new_transfer() -> None:
    t: UnclaimedTracker[str] = UnclaimedTracker(10.0)
    assert t.observe({"a": (1, 1), "b": (2, 1)}, 0.0) == []
    assert t.observe({"a": (1, 2), "b": (2, 1)}, 5.0) == []  # a sent again at 5
    assert t.observe({"a": (1, 1), "b": (2, 1)}, 10.0) == ["b"]  # one of a's claimed
    assert t.observe({"a": (1, 1)}, 14.9) == []
    assert t.observe({"a": (1, 1)}, 15.0) == ["a"]
    assert t.observe({"a": (7, 1)}, 16.0) == []  # freed and transferred again: a new page
    assert t.observe({}, 30.0) == [] and len(t) == 0
    with pytest.raises(ValueError, match="ttl_s"):
        UnclaimedTracker(0)
