"""A real SIGTERM to ``kvpool-gateway serve`` (one process, as the operator renders it) while a
stream is in flight, in front of a scripted fake worker that streams slowly (a fake: the test
needs a stream that is still running when the signal comes): the stream ends whole, the
probe says ``draining`` meanwhile, a new request gets a retryable 503, and the process exits 0
once the stream is done."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from fakes import ControllerScript, Script, bound_socket, fake_controller, fake_worker, serving

pytestmark = pytest.mark.timeout(120)
GATEWAY = Path(sys.executable).parent / "kvpool-gateway"


async def test_sigterm_drains_the_process_and_it_exits_after_the_stream(tmp_path: Path) -> None:
    slow = Script("a", events=8, event_delay_s=0.25)
    async with (
        serving(fake_worker(slow)) as worker,
        serving(fake_controller(ControllerScript())) as ctl,
    ):
        sock = bound_socket()
        port = sock.getsockname()[1]
        sock.close()
        config = {
            "model": "m",
            "chunkSize": 4,
            "controllerUrl": ctl,
            "p2pGroups": [{"name": "g", "instances": [{"name": "a", "url": worker}]}],
            "limits": {"drainTimeoutSeconds": 60, "drainMinSeconds": 0},
        }
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [str(GATEWAY), "serve", "--config", str(path), "--port", str(port)]
        proc = subprocess.Popen([*argv, "--log-level", "warning"])
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                for _ in range(600):
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.1)
                body = {"prompt": "abcdefgh", "max_tokens": 8, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    events = [await anext(lines)]
                    proc.send_signal(signal.SIGTERM)
                    for _ in range(100):  # the signal is handled between two ticks
                        ready = await client.get("/readyz")
                        if ready.status_code == 503:
                            break
                        await asyncio.sleep(0.05)
                    assert ready.json()["status"] == "draining"
                    async with httpx.AsyncClient(base_url=url, timeout=10) as other:
                        refused = await other.post("/v1/completions", json={"prompt": "x"})
                    assert refused.status_code == 503 and "retry-after" in refused.headers
                    events += [line async for line in lines]
            data = [e for e in events if e.startswith("data: ")]
            assert data[-1] == "data: [DONE]" and len(data) == 9, data
            assert await asyncio.to_thread(proc.wait, 60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert slow.completed == 1 and slow.cancelled == 0
