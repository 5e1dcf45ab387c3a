"""Real processes for the P2P and PD tests: kvpool-controller and kvpool-worker instances whose
LMCache configs move KV between them through NIXL over UCX on 127.0.0.1.

Why this module exists: the P2P and PD tests start the same processes the same way, always
kill them at the end, and read the same facts (cached tokens, the engine's metrics). The
LMCache keys are the ones the operator renders for platform cpu (transfer_channel nixl,
nixl_backends [UCX], async loading for P2P, save_unfull_chunk on the PD sender); the worker
environment is the rendered one (rule 9 env, PYTHONHASHSEED, POD_IP=127.0.0.1, from which the
worker restricts UCX to ``lo``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool.protocol.domain import DomainFacts, domain_fingerprint

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 300  # bounded; a loaded 2-core box needs minutes for 4 LMCache starts


def fingerprint(seed: str) -> str:
    return domain_fingerprint(
        DomainFacts(16, 256, "builtin", seed, "float32", "kvpool/reference-tiny")
    )


FINGERPRINT = fingerprint("42")
CHANNEL = {"transfer_channel": "nixl", "nixl_backends": ["UCX"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(config: Path, seed: str = "42") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVPOOL_", "UCX_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        LMCACHE_TRACK_USAGE="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
        PYTHONHASHSEED=seed,
        POD_IP="127.0.0.1",
        OMP_NUM_THREADS="1",
        LMCACHE_CONFIG_FILE=str(config),
        KVPOOL_DOMAIN_FINGERPRINT=fingerprint(seed),
    )
    return env


class Stack:
    """Processes of one test; ``close()`` kills every one (SIGKILL after a short SIGTERM)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.tmp / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def controller(self, ttl_s: float = 4.0) -> dict[str, str]:
        http, pull, reply, beat = free_port(), free_port(), free_port(), free_port()
        ports = f'{{"pull": {pull}, "reply": {reply}, "heartbeat": {beat}}}'
        argv = [
            str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(http),
            "--monitor-ports", ports, "--advertise-host", "127.0.0.1",
            "--fingerprint", FINGERPRINT,
            "--lmcache-worker-timeout", str(ttl_s), "--health-check-interval", "1",
        ]  # fmt: skip
        proc = self._spawn("controller", argv, {**os.environ, "PYTHONHASHSEED": "42"})
        self._wait_http(proc, f"http://127.0.0.1:{http}/metrics", "controller")
        return {
            "http": f"http://127.0.0.1:{http}",
            "controller_pull_url": f"127.0.0.1:{pull}",
            "controller_reply_url": f"127.0.0.1:{reply}",
        }

    def p2p_config(self, name: str, controller: dict[str, str], seed: str = "42") -> dict[str, Any]:
        return {
            "chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.25,
            "lmcache_instance_id": f"{name}~{fingerprint(seed)}",
            "enable_controller": True,
            "controller_pull_url": controller["controller_pull_url"],
            "controller_reply_url": controller["controller_reply_url"],
            "lmcache_worker_ports": [free_port()], "lmcache_worker_heartbeat_time": 1,
            "lmcache_worker_heartbeat_delay_time": 1,
            "enable_p2p": True, "p2p_host": "127.0.0.1",
            "p2p_init_ports": [free_port()], "p2p_lookup_ports": [free_port()],
            "enable_async_loading": True, **CHANNEL,
            "extra_config": {"worker_socket_recv_timeout_ms": 3000},
        }  # fmt: skip

    def worker(
        self, name: str, config: dict[str, Any], *, wait: bool = True, seed: str = "42"
    ) -> str:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        argv = [
            sys.executable, "-m", "kvpool.worker.cli", "serve", "--engine", "reference",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
            "--num-kv-blocks", "256",
        ]  # fmt: skip
        proc = self._spawn(name, argv, worker_env(path, seed))
        url = f"http://127.0.0.1:{port}"
        if wait:
            self._wait_http(proc, f"{url}/readyz", name)
        return url

    def wait_ready(self, name: str, url: str) -> None:
        """Wait for a worker started with ``wait=False`` (workers then load in parallel)."""
        self._wait_http(self.procs[name], f"{url}/readyz", name)

    def _wait_http(self, proc: subprocess.Popen[bytes], url: str, name: str) -> None:
        end = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n{self.log(name)[-4000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"{name} not ready in {READY_TIMEOUT_S}s:\n{self.log(name)[-4000:]}")

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.kill()
        proc.wait(10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 8
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def pd_config(name: str, role: str, proxy_port: int, init: int, alloc: int) -> dict[str, Any]:
    """A PD instance's LMCache config as rendered for platform cpu (the sender notifies the
    proxy at ``proxy_port``; the receiver listens on ``init`` and ``alloc``)."""
    cfg: dict[str, Any] = {
        "chunk_size": 256, "local_cpu": False, "lmcache_instance_id": f"{name}~{FINGERPRINT}",
        "enable_pd": True, "pd_role": role, "pd_buffer_size": 64 * 2**20,
        "pd_buffer_device": "cpu", **CHANNEL,
    }  # fmt: skip
    if role == "sender":
        cfg.update(pd_proxy_host="127.0.0.1", pd_proxy_port=proxy_port, save_unfull_chunk=True)
    else:
        cfg.update(pd_peer_host="127.0.0.1", pd_peer_init_port=[init], pd_peer_alloc_port=[alloc])
    return cfg


@contextlib.contextmanager
def proxy_notifications(port: int) -> Iterator[Any]:
    """The PULL socket a PD sender notifies (``ProxyNotif``), as the gateway binds it."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(f"tcp://127.0.0.1:{port}")
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        yield sock
    finally:
        sock.close(linger=0)
        ctx.term()


def disagg_spec(info: dict[str, Any], req_id: str) -> dict[str, Any]:
    """The proxy's ``disagg_spec`` for the decoder whose ``/pd/info`` is ``info``."""
    keys = ("receiver_host", "receiver_init_port", "receiver_alloc_port")
    return {"req_id": req_id, **{k: info[k] for k in keys}}


def complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def engine_metric(url: str, name: str) -> float:
    """``kvpool_engine_<name>`` (summed over labels), 0 when absent."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"kvpool_engine_{name}") and not line.startswith("#"):
            head = line.split(" ")[0]
            if head == f"kvpool_engine_{name}" or head.startswith(f"kvpool_engine_{name}{{"):
                total += float(line.split()[-1])
    return total


def tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(5, 8000) for _ in range(n)]
