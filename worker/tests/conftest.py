"""Service fixtures for the worker tests: Redis, Mooncake, LMCache's controller, KV factories.

Every server binds 127.0.0.1 on a port the OS hands out, is started here and killed in
teardown (even when the test fails). Services are session-scoped where tests only add data with
unique keys; a test that breaks a service starts its own.
"""

from __future__ import annotations

import os

# LMCache reads these at import time and never phones home with them set.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import contextlib
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

BIN = Path(sys.executable).parent
KV_GEOMETRY = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_tcp_port() -> Callable[[], int]:
    """A function returning a free 127.0.0.1 TCP port each call."""
    return free_port


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def started(cmd: list[str], port: int, what: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, what)
        yield proc
    finally:
        stop(proc)


def _redis_cmd(port: int) -> list[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    return [
        exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
        "--protected-mode", "yes",
    ]  # fmt: skip


@contextlib.contextmanager
def redis_at(tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    with started(_redis_cmd(port), port, "redis-server", tmp / f"redis-{port}.log") as proc:
        yield f"redis://127.0.0.1:{port}", proc


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server shared by the session (tests use unique token ids)."""
    with redis_at(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Redis server of this test alone (it may kill it)."""
    with redis_at(tmp_path) as started_redis:
        yield started_redis


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Mooncake master, the Python HTTP metadata server and a standalone store process that
    contributes the memory segment (engines contribute none), all on 127.0.0.1.

    Yields the LMCache ``remote_url`` and ``extra_config`` that reach it.
    """
    if not (BIN / "mooncake_master").exists():
        pytest.skip("mooncake-transfer-engine-non-cuda is not installed")
    tmp = tmp_path_factory.mktemp("mooncake")
    meta, master, metrics, store = free_port(), free_port(), free_port(), free_port()
    metadata_url = f"http://127.0.0.1:{meta}/metadata"
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            started(
                [str(BIN / "mooncake_http_metadata_server"), "--host", "127.0.0.1",
                 "--port", str(meta), "--log-level", "WARNING"],
                meta, "mooncake metadata server", tmp / "metadata.log",
            )
        )  # fmt: skip
        stack.enter_context(
            started(
                [str(BIN / "mooncake_master"), "-rpc_address", "127.0.0.1",
                 "-rpc_port", str(master), "-metrics_host", "127.0.0.1",
                 "-metrics_port", str(metrics), "-enable_http_metadata_server=false"],
                master, "mooncake_master", tmp / "master.log",
            )
        )  # fmt: skip
        stack.enter_context(
            started(
                [str(BIN / "mooncake_client"), "-host", "127.0.0.1", "-port", str(store),
                 "-global_segment_size", "512 MB", "-master_server_address",
                 f"127.0.0.1:{master}", "-metadata_server", metadata_url, "-protocol", "tcp"],
                store, "mooncake store", tmp / "store.log",
            )
        )  # fmt: skip
        yield {
            "remote_url": f"mooncakestore://127.0.0.1:{master}/",
            "extra_config": mooncake_extra_config(metadata_url, f"127.0.0.1:{master}"),
        }


def mooncake_extra_config(metadata_url: str, master: str) -> dict[str, Any]:
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": metadata_url,
        "master_server_address": master,
        # Mooncake 0.3.13's dict setup reads master_server_addr; the prefix forwards it.
        "mooncake_master_server_addr": master,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 0,
        "local_buffer_size": 64 * 1024 * 1024,
        "transfer_timeout": 5,
    }


@pytest.fixture
def lmcache_controller(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """LMCache's own controller (``lmcache_controller``): HTTP API plus ZMQ pull/reply ports."""
    exe = BIN / "lmcache_controller"
    if not exe.exists():
        pytest.skip("lmcache_controller is not installed")
    http, pull, reply = free_port(), free_port(), free_port()
    cmd = [
        str(exe), "--host", "127.0.0.1", "--port", str(http),
        "--monitor-ports", f'{{"pull": {pull}, "reply": {reply}}}',
    ]  # fmt: skip
    with started(cmd, http, "lmcache_controller", tmp_path / "controller.log"):
        yield {
            "http": f"http://127.0.0.1:{http}",
            "controller_pull_url": f"127.0.0.1:{pull}",
            "controller_reply_url": f"127.0.0.1:{reply}",
        }


# --- KV and offload factories --------------------------------------------------------------
PagedKV = list[torch.Tensor]


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    """Per-layer paged caches [2, NB, BS, H, D] (random, or zeros)."""

    def make(num_blocks: int = 128, *, zeros: bool = False, seed: int = 0) -> PagedKV:
        g = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, KV_GEOMETRY["block_size"], KV_GEOMETRY["num_kv_heads"],
                 KV_GEOMETRY["head_dim"])  # fmt: skip
        if zeros:
            return [torch.zeros(shape) for _ in range(KV_GEOMETRY["num_layers"])]
        return [torch.randn(shape, generator=g) for _ in range(KV_GEOMETRY["num_layers"])]

    return make


@pytest.fixture
def make_offload() -> Iterator[Callable[..., Any]]:
    """Build ``LMCacheOffload`` instances for the test; every one is closed in teardown."""
    from kvpool.worker.engine.offload import LMCacheOffload

    made: list[LMCacheOffload] = []

    def make(config: dict[str, Any], **kw: Any) -> LMCacheOffload:
        args: dict[str, Any] = {
            **KV_GEOMETRY,
            "instance_id": f"test-{uuid.uuid4().hex[:8]}",
            "dtype": "float32",
            "model_name": "kvpool/test",
            **kw,
        }
        off = LMCacheOffload({"chunk_size": 256, "max_local_cpu_size": 0.25, **config}, **args)
        made.append(off)
        return off

    yield make
    for off in made:
        off.close(10)


# A second worker process: its own LMCache engine on the same config retrieves the tokens
# into zeroed paged caches at other slots and saves the rows it got.
SECOND_WORKER = """
import json, sys, torch
from kvpool.worker.engine.offload import LMCacheOffload
args = json.loads(sys.argv[1])
g = args["geometry"]
off = LMCacheOffload(args["config"], instance_id="second-worker", dtype="float32",
                     model_name="kvpool/test", **g)
shape = (2, args["num_blocks"], g["block_size"], g["num_kv_heads"], g["head_dim"])
kv = [torch.zeros(shape) for _ in range(g["num_layers"])]
slots = torch.tensor(args["slots"])
tokens = args["tokens"]
hit = off.lookup(tokens)
loaded = off.retrieve(tokens, hit, kv, slots)
rows = [layer.view(2, -1, g["num_kv_heads"], g["head_dim"])[:, slots[:loaded]] for layer in kv]
torch.save({"hit": hit, "loaded": loaded, "rows": rows, "metrics": off.metrics()}, args["out"])
off.close(5)
"""


@pytest.fixture
def second_worker(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """Run SECOND_WORKER in a fresh Python process (bounded); returns what it saved."""
    import json

    def run(config: dict[str, Any], tokens: list[int], slots: list[int]) -> dict[str, Any]:
        out = tmp_path / f"second-{uuid.uuid4().hex[:6]}.pt"
        args = {
            "config": {"chunk_size": 256, "max_local_cpu_size": 0.25, **config},
            "geometry": KV_GEOMETRY, "num_blocks": 128, "tokens": tokens, "slots": slots,
            "out": str(out),
        }  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-c", SECOND_WORKER, json.dumps(args)],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise AssertionError(f"second worker failed:\n{proc.stderr.decode()[-3000:]}")
        result: dict[str, Any] = torch.load(out)
        return result

    return run
