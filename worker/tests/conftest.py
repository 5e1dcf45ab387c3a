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
# NIXL's UCX in this process (in-process pullers) uses loopback only, like the workers.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import contextlib
import importlib.util
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

KV_GEOMETRY = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}


def _load(path: Path, name: str) -> Any:
    """A helper module that is not a package (the tests import in importlib mode)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# The benchmark's service launchers (worker/bench/services.py): one way to start them.
services = _load(
    Path(__file__).resolve().parents[1] / "bench" / "services.py", "kvpool_worker_bench_services"
)
# kvpool-controller and kvpool-worker processes for the P2P and PD tests.
transfer_stack = _load(
    Path(__file__).with_name("integration") / "transfer_stack.py", "transfer_stack"
)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Any]:
    """Processes of one P2P/PD test (``transfer_stack.Stack``), all killed at the end."""
    s = transfer_stack.Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


free_port = services.free_port


@pytest.fixture
def free_tcp_port() -> Callable[[], int]:
    """A function returning a free 127.0.0.1 TCP port each call."""
    return free_port  # type: ignore[no-any-return]


@contextlib.contextmanager
def _service(cm: Any) -> Iterator[Any]:
    try:
        ctx = cm.__enter__()
    except services.ServiceUnavailableError as e:
        pytest.skip(str(e))
    try:
        yield ctx
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis server shared by the session (tests use unique token ids)."""
    with _service(services.redis_server(tmp_path_factory.mktemp("redis"))) as (url, _):
        yield url


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A Redis server of this test alone (it may kill it)."""
    with _service(services.redis_server(tmp_path)) as started_redis:
        yield started_redis


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Mooncake master, the Python HTTP metadata server and a standalone store process that
    contributes the memory segment (engines contribute none), all on 127.0.0.1.

    Yields the LMCache ``remote_url`` and ``extra_config`` that reach it.
    """
    with _service(services.mooncake_cluster(tmp_path_factory.mktemp("mooncake"), "512 MB")) as mc:
        yield mc


@pytest.fixture
def private_mooncake(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A Mooncake cluster of this test alone (it may kill its master)."""
    with _service(services.mooncake_cluster(tmp_path, "256 MB")) as mc:
        yield mc


@pytest.fixture(params=["lmcache_controller", "kvpool-controller"])
def kv_controller(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A KV controller speaking LMCache's protocol, started with LMCache's controller flags:
    LMCache's own (``lmcache_controller``) and kvpool's (``kvpool-controller``)."""
    exe = services.BIN / request.param
    if not exe.exists():
        pytest.skip(f"{request.param} is not installed")
    http, pull, reply = free_port(), free_port(), free_port()
    cmd = [
        str(exe), "--host", "127.0.0.1", "--port", str(http),
        "--monitor-ports", f'{{"pull": {pull}, "reply": {reply}}}',
    ]  # fmt: skip
    with services.started(cmd, http, request.param, tmp_path / "controller.log"):
        yield {
            "name": request.param,
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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After the results are written, exit past threads LMCache 0.5.6 leaves behind.

    When an in-process engine's close hangs inside LMCache (its NIXL channel's zmq term, a
    Redis close), LMCache's own non-daemon threads (PinMonitor, the storage manager's event
    loop) stay alive and the interpreter would wait for them forever; the worker process does
    the same after its bounded close (``os._exit``). The exit status is pytest's; the threads
    are named so the leak stays visible.
    """
    stuck = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.is_alive() and not t.daemon
    ]
    if not stuck:
        return
    print(
        f"worker tests: exiting past {len(stuck)} non-daemon thread(s) left alive: "
        + ", ".join(sorted(stuck)),
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(config.stash.get(_EXIT_STATUS, 1))
