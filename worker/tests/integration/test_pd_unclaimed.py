"""A PD receiver's buffer with the real LMCache 0.5.6 PD backend (NIXL over UCX on 127.0.0.1):
transfers nobody claims are freed after the TTL or on release, never under a retrieve.

The test is the sender: it sends LMCache's own ``AllocRequest`` (msgpack over the receiver's
ZMQ alloc socket, what LMCache's sender sends: with a request id and its chunk count for the
default async backend's admission) for a prompt's chunk keys and never follows with a decode,
which is what every unclaimed transfer looks like to the receiver. LMCache itself allocates
the pages and files the chunks; the receiver's allocator shows the buffer filling. Both PD
backends of LMCache 0.5.6 are tested (``pd_backend_mode`` async, its default, and sync). Time
is passed to ``reap`` explicitly, so nothing here waits for a TTL.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from lmcache.utils import TORCH_DTYPE_TO_STR_DTYPE
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend import pd_backend, pd_backend_async

from kvpool.protocol.pd import DEFAULT_UNCLAIMED_TTL_SECONDS, UNCLAIMED_TTL_KEY
from kvpool.worker.engine.offload import OffloadConfigError
from kvpool.worker.engine.offload.pd_buffer import UnclaimedTracker

pytestmark = pytest.mark.timeout(180)
TTL_S = 30.0
CHUNK = 256


def receiver_config(
    free_port: Callable[[], int], mode: str = "async", **extra: Any
) -> dict[str, Any]:
    return {
        "chunk_size": CHUNK, "local_cpu": False, "enable_pd": True, "pd_role": "receiver",
        "pd_buffer_size": 16 * 2**20, "pd_buffer_device": "cpu", "pd_peer_host": "127.0.0.1",
        "pd_peer_init_port": [free_port()], "pd_peer_alloc_port": [free_port()],
        "transfer_channel": "nixl", "nixl_backends": ["UCX"], "pd_backend_mode": mode,
        "extra_config": extra,
    }  # fmt: skip


@pytest.fixture
def receiver(make_offload: Callable[..., Any], free_tcp_port: Callable[[], int]) -> Any:
    mode = os.environ.get("KVPOOL_TEST_PD_BACKEND_MODE", "async")
    return make_offload(receiver_config(free_tcp_port, mode, **{UNCLAIMED_TTL_KEY: TTL_S}))


@contextlib.contextmanager
def alloc_socket(receiver: Any) -> Iterator[Callable[[list[int]], Any]]:
    """Asks the receiver for space for a prompt, as LMCache's sender does, and never writes."""
    wire: Any = pd_backend if receiver.config.pd_backend_mode == "sync" else pd_backend_async
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)  # REQ speaks to both the sync REP and the async ROUTER
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(f"tcp://127.0.0.1:{receiver.config.pd_peer_alloc_port[0]}")
    shape = [2, receiver.num_layers, CHUNK, receiver.connector.row_width]

    def alloc(tokens: list[int]) -> Any:
        keys = receiver.chunk_keys(tokens)  # PD forces save_unfull_chunk: the partial one too
        fields: dict[str, Any] = {
            "keys": keys, "fmt": MemoryFormat.KV_2LTD.value, "shape": list(shape),
            "dtype": TORCH_DTYPE_TO_STR_DTYPE[torch.float32],
            "last_chunk_toks": len(tokens) - (len(keys) - 1) * CHUNK,
        }  # fmt: skip
        if wire is pd_backend_async:  # the async sender's admission fields
            fields.update(req_id=uuid.uuid4().hex, is_last_batch=True, total_chunks=len(keys))
        sock.send(msgspec.msgpack.encode(wire.AllocRequest(**fields)))
        reply = msgspec.msgpack.decode(sock.recv(), type=wire.PDMsg)
        assert isinstance(reply, wire.AllocResponse)
        return reply

    try:
        yield alloc
    finally:
        sock.close(linger=0)
        ctx.term()


@pytest.fixture
def sender(receiver: Any) -> Iterator[Callable[[list[int]], Any]]:
    with alloc_socket(receiver) as alloc:
        yield alloc


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8000) for _ in range(n)]


def usage(off: Any) -> dict[str, float]:
    return {k: v for k, v in off.metrics().items() if k.startswith("pd_")}


def test_unclaimed_transfers_fill_the_buffer_until_the_ttl_frees_them(
    receiver: Any, sender: Callable[[list[int]], Any]
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
    receiver: Any, sender: Callable[[list[int]], Any]
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
    receiver: Any, sender: Callable[[list[int]], Any]
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


@pytest.mark.timeout(1000)  # two sub-runs of pytest, each bounded below
def test_the_sync_pd_backend_is_freed_the_same_way() -> None:
    """LMCache's sync PD backend (``pd_backend_mode: sync``) leaves a retrieve's last
    reference to its caller; the tests above run against it in their own process (its close
    terms the process-wide zmq context, so a second sync receiver in one process cannot start).
    """
    if os.environ.get("KVPOOL_TEST_PD_BACKEND_MODE"):
        pytest.skip("already the sync run")
    module = __file__
    for name in ("fill_the_buffer_until", "release_frees_one"):  # what depends on the mode
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, "-k", name],
            cwd=Path(module).parents[2],
            env={**os.environ, "KVPOOL_TEST_PD_BACKEND_MODE": "sync"},
            check=False,
            capture_output=True,
            text=True,
            timeout=450,  # a sub-run, with suites beside it on 2 cores
        )
        passed = re.search(r"^1 passed", run.stdout, re.MULTILINE)
        assert run.returncode == 0 and passed, run.stdout[-3000:]
