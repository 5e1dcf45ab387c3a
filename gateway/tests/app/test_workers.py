"""``kvpool-gateway serve --workers N``: N processes on one port (SO_REUSEPORT), each with its
own state, in front of a scripted fake worker; SIGTERM to the parent stops them all. A PD
proxy needs one process, so ``--workers`` with PD pairs is refused naming the reason."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from fakes import Script, bound_socket, fake_worker, serving

from kvpool.gateway.cli import settings_from_args
from kvpool.gateway.config import ConfigError
from kvpool.gateway.processes import workers_for

pytestmark = pytest.mark.timeout(90)
GATEWAY = Path(sys.executable).parent / "kvpool-gateway"


def test_workers_count_and_the_pd_refusal(tmp_path: Path) -> None:
    assert workers_for(3) == 3 and workers_for(0) == (os.cpu_count() or 1)
    with pytest.raises(ValueError, match="--workers"):
        workers_for(-1)
    pd = {"name": "pair", "mode": "push", "prefill": [{"name": "p", "url": "http://127.0.0.1:1"}],
          "decode": [{"name": "d", "url": "http://127.0.0.1:2", "host": "127.0.0.1",
                      "initPorts": [3], "allocPorts": [4]}], "proxyPort": 5}  # fmt: skip
    config = {"model": "m", "chunkSize": 4, "controllerUrl": "http://127.0.0.1:9", "pdPairs": [pd]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="PD proxy of pair"):
        settings_from_args(["serve", "--config", str(path), "--workers", "2"])
    _, options = settings_from_args(["serve", "--config", str(path)])
    assert options.workers == 1


@contextlib.asynccontextmanager
async def two_processes(
    tmp_path: Path, worker: str
) -> AsyncIterator[tuple[subprocess.Popen[bytes], int]]:
    """``kvpool-gateway serve --workers 2`` on a free port in front of ``worker``, ready; its
    process group killed at the end whatever happened."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    ctl = bound_socket()
    config = {
        "model": "m",
        "chunkSize": 4,
        "controllerUrl": f"http://127.0.0.1:{ctl.getsockname()[1]}",  # down: fallback
        "p2pGroups": [{"name": "g", "instances": [{"name": "a", "url": worker}]}],
    }
    ctl.close()
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [str(GATEWAY), "serve", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen([*argv, "--workers", "2", "--log-level", "warning"],
                            start_new_session=True)  # fmt: skip
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            deadline = time.monotonic() + 120  # two processes starting on a loaded box
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await c.get("/readyz")).status_code == 200:
                        break
                assert time.monotonic() < deadline, "the gateway not ready in 120 s"
                assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
                await asyncio.sleep(0.1)
        yield proc, port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _children(pid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return out.stdout.split()


async def test_two_processes_share_the_port_and_stop_together(tmp_path: Path) -> None:
    script = Script("a")
    async with (
        serving(fake_worker(script)) as worker,
        two_processes(tmp_path, worker) as (
            proc,
            port,
        ),
    ):
        assert len(_children(proc.pid)) >= 2
        for n in range(12):  # fresh connections: the kernel spreads them
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as one:
                r = await one.post("/v1/completions", json={"prompt": f"hello {n}"})
                assert r.status_code == 200, r.text
                assert r.headers["x-kvpool-instance"] == "a"
        assert script.completed == 12
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0


async def test_a_supervisor_killed_outright_takes_its_processes_with_it(tmp_path: Path) -> None:
    """SIGKILL to the supervisor (the OOM killer, ``kill -9``): it cannot forward anything, and
    without the parent-death signal its processes kept serving the port as orphans."""
    async with (
        serving(fake_worker(Script("a"))) as worker,
        two_processes(tmp_path, worker) as (proc, _port),
    ):
        children = [int(c) for c in _children(proc.pid)]
        assert len(children) >= 2
        proc.kill()
        await asyncio.to_thread(proc.wait, 10)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{c}") and _state(c) != "Z" for c in children):
            assert time.monotonic() < deadline, "the gateway's processes outlived it"
            await asyncio.sleep(0.1)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
