"""Real tier services on 127.0.0.1 free ports: redis-server and Mooncake (master, HTTP
metadata server, standalone store process holding the memory segment).

Why this module exists: the worker benchmark and the worker tests (``tests/conftest.py`` loads
this file) need the same services started the same way, and killed afterwards whatever
happens. Each launcher is a context manager.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


class ServiceUnavailableError(RuntimeError):
    """The program for a service is not installed here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """Run ``cmd`` (output to ``log``) until it listens on ``port``; stop it on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc, what)
        yield proc
    finally:
        stop(proc)


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server without persistence; yields (``redis://`` URL, process)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceUnavailableError(
            "redis-server is not installed (apt-get install -y redis-server)"
        )
    port = free_port()
    cmd = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    with started(cmd, port, "redis-server", tmp / f"redis-{port}.log") as proc:
        yield f"redis://127.0.0.1:{port}", proc


def mooncake_extra_config(metadata_url: str, master: str) -> dict[str, Any]:
    """LMCache ``extra_config`` for a Mooncake engine that contributes no memory segment."""
    return {
        "local_hostname": "127.0.0.1",
        "metadata_server": metadata_url,
        "master_server_address": master,
        # Mooncake 0.3.13's dict setup reads master_server_addr; the prefix forwards it.
        "mooncake_master_server_addr": master,
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": 0,
        "local_buffer_size": 256 * 1024 * 1024,
        "transfer_timeout": 5,
    }


@contextlib.contextmanager
def mooncake_cluster(tmp: Path, segment: str = "1 GB") -> Iterator[dict[str, Any]]:
    """Master, HTTP metadata server and a standalone store holding ``segment`` of memory.

    Yields ``remote_url`` and ``extra_config`` for LMCache, and the master's process.
    """
    if not (BIN / "mooncake_master").exists():
        raise ServiceUnavailableError("mooncake-transfer-engine-non-cuda is not installed")
    meta, master, metrics, store = free_port(), free_port(), free_port(), free_port()
    metadata_url = f"http://127.0.0.1:{meta}/metadata"
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            started(
                [str(BIN / "mooncake_http_metadata_server"), "--host", "127.0.0.1",
                 "--port", str(meta), "--log-level", "WARNING"],
                meta, "mooncake metadata server", tmp / "mooncake-metadata.log",
            )
        )  # fmt: skip
        master_proc = stack.enter_context(
            started(
                [str(BIN / "mooncake_master"), "-rpc_address", "127.0.0.1",
                 "-rpc_port", str(master), "-metrics_host", "127.0.0.1",
                 "-metrics_port", str(metrics), "-enable_http_metadata_server=false"],
                master, "mooncake_master", tmp / "mooncake-master.log",
            )
        )  # fmt: skip
        stack.enter_context(
            started(
                [str(BIN / "mooncake_client"), "-host", "127.0.0.1", "-port", str(store),
                 "-global_segment_size", segment, "-master_server_address",
                 f"127.0.0.1:{master}", "-metadata_server", metadata_url, "-protocol", "tcp"],
                store, "mooncake store", tmp / "mooncake-store.log",
            )
        )  # fmt: skip
        yield {
            "remote_url": f"mooncakestore://127.0.0.1:{master}/",
            "extra_config": mooncake_extra_config(metadata_url, f"127.0.0.1:{master}"),
            "master_process": master_proc,
        }
