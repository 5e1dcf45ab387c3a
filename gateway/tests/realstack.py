"""Real processes for the integration tests: the reference domain's facts and environment, and
a small supervisor that starts processes with logs, waits on their /readyz, and stops them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fakes import bound_socket

from kvpool.protocol.domain import DomainFacts, domain_fingerprint

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
