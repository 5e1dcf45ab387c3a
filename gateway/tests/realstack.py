"""Real processes for the integration tests: the reference domain's facts and environment, a
small supervisor that starts processes with logs, waits on their /readyz, and stops them, and
a real PD pair (two reference workers whose LMCache moves KV over NIXL/UCX)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import bound_socket

from kvpool.protocol.domain import DomainFacts, domain_fingerprint, instance_id

SEED = "42"
FACTS = DomainFacts(16, 256, "builtin", SEED, "float32", "kvpool/reference-tiny")
BIN = Path(sys.executable).parent
READY_S = 300  # a reference worker on a loaded 2-core box can take minutes to start


def free_port() -> int:
    s = bound_socket()
    port = int(s.getsockname()[1])
    s.close()
    return port


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LMCACHE_", "KVPOOL_"))}
    env.update(
        PYTHONUNBUFFERED="1",
        LMCACHE_TRACK_USAGE="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_WORKER_MULTIPROC_METHOD="spawn",
        PYTHONHASHSEED=SEED,
        KVPOOL_DOMAIN_FINGERPRINT=domain_fingerprint(FACTS),
        OMP_NUM_THREADS="1",
    )
    return env


class Procs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = (self.root / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def wait_ready(self, name: str, url: str) -> None:
        end = time.monotonic() + READY_S
        while time.monotonic() < end:
            proc = self.procs[name]
            if proc.poll() is not None:
                pytest.fail(f"{name} exited {proc.returncode}:\n{self.log(name)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    return
            time.sleep(0.3)
        pytest.fail(f"{name} not ready in {READY_S}s:\n{self.log(name)}")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _pd_config(name: str, role: str, buffer_bytes: int, lines: list[str]) -> str:
    base = [
        "chunk_size: 256", "enable_pd: true", "local_cpu: false", "nixl_backends: [UCX]",
        "pd_buffer_device: cpu", f"pd_buffer_size: {buffer_bytes}", f"pd_role: {role}",
        "pre_caching_hash_algorithm: builtin", "transfer_channel: nixl", "use_layerwise: false",
        f"lmcache_instance_id: {instance_id(name, domain_fingerprint(FACTS))}",
    ]  # fmt: skip
    given = {line.split(":")[0] for line in lines}  # a key of ``lines`` replaces the base's
    return "\n".join([*(b for b in base if b.split(":")[0] not in given), *lines, ""])


def start_pd_pair(
    procs: Procs,
    root: Path,
    *,
    buffer_bytes: int = 64 * 2**20,
    decoder_extra: str | None = None,
    kv_blocks: int = 256,
    decoder_lines: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A prefill (sender, ``pre-0``) and a decode (receiver, ``dec-0``) reference worker,
    configured as the operator renders a cpu PDPair (``pd_proxy_port``: the gateway's PULL);
    ``decoder_extra``: the decoder's ``extra_config`` as YAML flow; ``decoder_lines``: more
    YAML lines of the decoder's config (replacing the base's keys). Skips without NIXL."""
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed (make install installs it)")
    proxy_port, init_port, alloc_port = free_port(), free_port(), free_port()
    decoder = ["pd_peer_host: 127.0.0.1", f"pd_peer_init_port: [{init_port}]",
               f"pd_peer_alloc_port: [{alloc_port}]"]  # fmt: skip
    if decoder_extra is not None:
        decoder.append(f"extra_config: {decoder_extra}")
    configs = {
        "prefill": _pd_config("pre-0", "sender", buffer_bytes, [
            "pd_proxy_host: 127.0.0.1", f"pd_proxy_port: {proxy_port}", "save_unfull_chunk: true",
        ]),
        "decode": _pd_config("dec-0", "receiver", buffer_bytes, [*decoder, *decoder_lines]),
    }  # fmt: skip
    urls = {}
    for role, text in configs.items():
        path = root / f"{role}.yaml"
        path.write_text(text)
        port = free_port()
        procs.start(
            role,
            [str(BIN / "kvpool-worker"), "serve", "--engine", "reference", "--platform", "cpu",
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
             "--block-size", "16", "--kv-dtype", "float32", "--num-kv-blocks", str(kv_blocks)],
            {**base_env(), "LMCACHE_CONFIG_FILE": str(path), "LMCACHE_PD_PEER_HOST": "127.0.0.1"},
        )  # fmt: skip
        urls[role] = f"http://127.0.0.1:{port}"
    for role, url in urls.items():
        procs.wait_ready(role, url)
    return {"urls": urls, "proxy_port": proxy_port, "init": init_port, "alloc": alloc_port}


def pd_gateway_config(pair: dict[str, Any]) -> dict[str, Any]:
    """The gateway's config for the pair of :func:`start_pd_pair` (PD pair ``pd``)."""
    return {
        "model": "kvpool/reference-tiny",
        "chunkSize": 256,
        "controllerUrl": "http://127.0.0.1:1",  # no controller: prefill goes by load
        "pdPairs": [{
            "name": "pd", "mode": "push", "proxyPort": pair["proxy_port"],
            "prefill": [{"name": "pre-0", "url": pair["urls"]["prefill"]}],
            "decode": [{"name": "dec-0", "url": pair["urls"]["decode"], "host": "127.0.0.1",
                        "initPorts": [pair["init"]], "allocPorts": [pair["alloc"]]}],
        }],
        "limits": {"pdTransferTimeoutSeconds": 60},
    }  # fmt: skip
