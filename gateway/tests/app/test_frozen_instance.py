"""A frozen instance does not hold the requests already sent to it (issue 18, chaos suite).

Why: a worker stopped with SIGSTOP (a hung node) or cut off by a partition accepts no byte and
sends none; the gateway took it out of routing after two failed probes but kept every request
already sent to it open for its upstream timeout (300 s), so the chaos suite's clients waited
19-28 s for answers (past their own timeout in an earlier run). Now the health loop drops the
exchanges in flight to an instance that answers no probe: a request without an answer yet is
retried on another instance, a stream already under way ends with an ``upstream_cut`` error
event the client can retry on.

Real processes: two ``kvpool-worker serve --engine sim`` workers (slowed so that an answer
takes seconds) behind the gateway app in this process; the freeze is a real SIGSTOP. Every
assertion is about order (the request ended while its worker was still stopped), none about
time; the client's own timeout bounds the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fakes import bound_socket, serving

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state
from kvpool.protocol.http_api import INSTANCE

pytestmark = pytest.mark.timeout(240)
WORKER = Path(sys.executable).parent / "kvpool-worker"
SIM = [
    "serve", "--engine", "sim", "--sim-profile", "h100-llama-3.1-8b-vllm", "--model", "m",
    "--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "64",
    "--sim-speedup", "0.02",  # ~0.4 s per decoded token: an answer is in flight for seconds
]  # fmt: skip
CLIENT_TIMEOUT_S = 120  # far below the gateway's upstream timeout (300 s): what was held before
BODY = {"prompt": "the frozen worker", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
STREAM = {**BODY, "max_tokens": 150, "stream": True}  # still streaming when its worker freezes


def _port() -> int:
    sock = bound_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    return port


@contextlib.contextmanager
def sim_workers(tmp: Path, names: list[str]) -> Iterator[dict[str, tuple[str, int]]]:
    """Start the workers; yields name -> (url, pid). Each is continued and killed at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVPOOL_"))}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        urls = {}
        for name in names:
            port = _port()
            log = (tmp / f"{name}.log").open("wb")
            argv = [str(WORKER), *SIM, "--host", "127.0.0.1", "--port", str(port)]
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            urls[name] = f"http://127.0.0.1:{port}"
        for name, url in urls.items():
            for _ in range(600):  # bounded: 3 minutes on a loaded box
                assert procs[name].poll() is None, (tmp / f"{name}.log").read_text()[-2000:]
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                        break
                time.sleep(0.3)
        yield {name: (urls[name], procs[name].pid) for name in names}
    finally:
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(10)


@contextlib.asynccontextmanager
async def gateway(urls: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    raw = {
        "model": "m",
        "chunkSize": 4,
        "controllerUrl": f"http://127.0.0.1:{_port()}",  # none: least-load routing
        "p2pGroups": [{"name": "g", "instances": [{"name": n, "url": u} for n, u in urls.items()]}],
        "limits": {"healthIntervalSeconds": 0.3, "retries": 2, "upstreamTimeoutSeconds": 300},
    }
    state = build_state(parse_config(raw), GatewayEnv(), pd_bind_host="127.0.0.1")
    async with (
        serving(build_app(state)) as url,
        httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client,
    ):
        yield client


async def _until_running(url: str) -> None:
    """Until the worker at ``url`` runs a request (bounded)."""
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(300):
            text = (await http.get(f"{url}/metrics")).text
            if "kvpool_worker_inflight_requests 1.0" in text:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} never ran the request")


def _stopped(pid: int) -> bool:
    """The process is stopped (``T`` in /proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


async def test_requests_in_flight_to_a_frozen_worker_are_retried_or_cut(tmp_path: Path) -> None:
    with sim_workers(tmp_path, ["a", "b"]) as workers:
        async with gateway({n: u for n, (u, _) in workers.items()}) as client:
            async with client.stream("POST", "/v1/completions", json=STREAM) as s:
                streamed = s.headers[INSTANCE]
                other = next(n for n in workers if n != streamed)
                events = s.aiter_lines()
                assert (await anext(events)).startswith("data: ")  # the stream is under way
                # least load: the whole answer goes to the other worker; freeze it meanwhile
                whole = asyncio.create_task(client.post("/v1/completions", json=BODY))
                await _until_running(workers[other][0])
                os.kill(workers[other][1], signal.SIGSTOP)
                resp = await whole
                assert _stopped(workers[other][1])
                assert resp.status_code == 200, resp.text
                assert resp.headers[INSTANCE] == streamed  # retried on the live worker
                assert resp.json()["usage"]["completion_tokens"] == BODY["max_tokens"]

                os.kill(workers[streamed][1], signal.SIGSTOP)  # now the stream's worker
                last = ""
                async for line in events:
                    if line.startswith("data: "):
                        last = line[len("data: ") :]
                assert _stopped(workers[streamed][1])
                assert json.loads(last)["error"]["code"] == "upstream_cut", last
