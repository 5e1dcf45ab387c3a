"""``kvpool-worker host``: each hosted instance is built exactly as ``serve`` would build it
from its own argv and environment (nothing from this process's environment), only sim
instances are hosted, and the listening sockets give every connection TCP_NODELAY."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kvpool.protocol.domain import DomainFacts, domain_fingerprint
from kvpool.worker import cli
from kvpool.worker.sim import host

SIM = ["serve", "--engine", "sim", "--sim-profile", "h100-llama-3.1-8b-vllm", "--num-layers",
       "2", "--num-kv-heads", "1", "--head-dim", "64", "--kv-dtype", "float32"]  # fmt: skip


def entry(port: int, env: dict[str, str] | None = None, **over: Any) -> dict[str, Any]:
    return {"argv": ["/usr/bin/kvpool-worker", *SIM, "--port", str(port)], "env": env or {}, **over}


def test_instances_are_built_from_their_own_argv_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPOOL_WORKER_SIM_SPEEDUP", "99")  # this process's: must not leak
    fp = domain_fingerprint(
        DomainFacts(16, 256, "builtin", "5", "float32", "kvpool/reference-tiny")
    )
    config = tmp_path / "lmc.yaml"
    config.write_text(f"chunk_size: 256\nlmcache_instance_id: x~{fp}\nmax_local_cpu_size: 0.01\n")
    rendered = {
        "PYTHONHASHSEED": "5", "LMCACHE_TRACK_USAGE": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "LMCACHE_CONFIG_FILE": str(config), "KVPOOL_DOMAIN_FINGERPRINT": fp,
        "KVPOOL_WORKER_SIM_SPEEDUP": "3",
    }  # fmt: skip
    text = json.dumps([entry(1, rendered), {"argv": [*SIM, "--port", "2"]}])
    hosted = host.build_all(host.load_entries(text, "f"))
    engines: list[Any] = [h.runtime.engine for h in hosted]
    assert [h.settings.port for h in hosted] == [1, 2]
    assert [e.speedup for e in engines] == [3.0, 1.0]
    assert engines[0].name == "x" and engines[0].instance.ddr.capacity == 40  # 0.01 GiB / 256 KiB
    assert engines[1].name == "127.0.0.1:2" and not engines[1].instance.config.lmcache


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ("[]", "non-empty JSON list"),
        ('[{"argv": "serve"}]', "[0].argv must be a list"),
        ('[{"argv": ["serve"], "env": {"A": 1}}]', "[0].env must map names to strings"),
        (json.dumps([{"argv": ["serve", "--engine", "reference"]}]), "only --engine sim"),
        (json.dumps([{"argv": ["fingerprint", "--model", "m"]}]), "does not parse"),
        (json.dumps([entry(7), entry(7)]), "instance 1: --port 7 is also instance 0's"),
        (json.dumps([entry(7, {"PYTHONHASHSEED": "1", "LMCACHE_CONFIG_FILE": "/nope"})]),
         "instance 0: refusing to start"),
    ],
)  # fmt: skip
def test_what_cannot_be_hosted_is_refused_naming_the_instance(entries: str, words: str) -> None:
    with pytest.raises(cli.StartRefusedError, match=words.replace("[", r"\[").replace("]", r"\]")):
        host.build_all(host.load_entries(entries, "f"))


def test_connections_to_hosted_ports_get_tcp_nodelay() -> None:
    """Without TCP_NODELAY every small answer waited out the client's delayed ACK (~40 ms)."""

    async def run() -> int:
        sock = host._listen("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        flag = await asyncio.wait_for(seen, 5)
        writer.close()
        server.close()
        return flag

    assert asyncio.run(run()) != 0
