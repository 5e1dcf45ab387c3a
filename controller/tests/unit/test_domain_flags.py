"""The flags the operator renders for the controller, and what they change.

The operator (kvpool.operator.render) starts the controller with ``--chunk-size``,
``--hash-algorithm`` and ``--persistence``; an e2e run showed the controller refusing them.
Here: the rendered command line parses; inconsistent persistence is refused naming the fix;
a domain that does not hash with LMCache's builtin algorithm gets a 400 (not silently wrong
hashes, i.e. 0 % hits) for token lookups, while hash lookups keep working.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError

from kvpool.controller.api import create_app
from kvpool.controller.main import settings_from_args
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.hashing import HashConfig, chunk_hashes

RENDERED = [
    "--host", "0.0.0.0", "--port", "9000",
    "--monitor-ports", '{"pull": 8300, "reply": 8400, "heartbeat": 8500}',
    "--health-check-interval", "10", "--lmcache-worker-timeout", "60",
    "--advertise-host", "demo-controller.default.svc",
    "--chunk-size", "256", "--hash-algorithm", "builtin", "--persistence", "full-sync",
]  # fmt: skip


def test_the_rendered_command_line_parses() -> None:
    s = settings_from_args(RENDERED)
    assert s.persistence == "full-sync"
    assert s.hash_algorithm == "builtin"
    assert s.chunk_size == 256
    assert s.tokens_lookup_error is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"persistence": "redis"}, "--redis-url"),
        ({"persistence": "full-sync", "redis_url": "redis://127.0.0.1:1/0"}, "--persistence redis"),
        ({"persistence": "none", "redis_url": "redis://127.0.0.1:1/0"}, "--persistence redis"),
    ],
)
def test_inconsistent_persistence_is_refused_with_the_fix(
    values: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        ControllerSettings(**values)  # type: ignore[arg-type]


def test_persistence_none_parses_and_never_asks_for_a_full_sync() -> None:
    """``--persistence none`` (the operator's mode none): a worker unknown to a restarted
    controller is re-registered but not asked for its keys; full-sync asks."""
    from kvpool.controller.service import ControllerService

    none = settings_from_args([*RENDERED[:-1], "none"])
    assert none.persistence == "none"
    for settings, asks in [(none, False), (settings_from_args(RENDERED), True)]:
        svc = ControllerService(settings.model_copy(update={"monitor_ports": {"pull": 0}}))
        reply = svc.handle_request(p.HeartbeatMsg("a~0123456789ab", 0, "10.0.0.1", 9000, None))
        assert isinstance(reply, p.HeartbeatRetMsg)
        assert any(isinstance(c, p.FullSyncCommand) for c in reply.commands) is asks
        assert svc.registry.get("a~0123456789ab", 0) is not None


@pytest.fixture
async def unseeded_vllm_client() -> AsyncIterator[tuple[httpx.AsyncClient, ControllerServer]]:
    settings = ControllerSettings(
        host="127.0.0.1",
        monitor_ports={"pull": 0},
        hash_algorithm="sha256_cbor",
        vllm=True,
        hash_seed=None,
    )
    server = ControllerServer(settings)
    transport = httpx.ASGITransport(app=create_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c, server
    await server.close()


async def test_token_lookups_refused_when_nobody_can_reproduce_the_hashes(
    unseeded_vllm_client: tuple[httpx.AsyncClient, ControllerServer],
) -> None:
    """vLLM workers without PYTHONHASHSEED draw NONE_HASH from os.urandom."""
    c, server = unseeded_vllm_client
    server.service.handle_request(p.RegisterMsg("a", 0, "10.0.0.1", 7000, None))
    ops = [p.KVOpEvent(p.OpType.ADMIT, 11, 0), p.KVOpEvent(p.OpType.ADMIT, 22, 1)]
    server.service.handle_push(p.BatchedKVOperationMsg("a", 0, "LocalCPUBackend", ops))
    for path, body in [
        ("/lookup", {"tokens": list(range(300))}),
        ("/v1/prefix_lookup", {"tokens": list(range(300))}),
    ]:
        r = await c.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert "PYTHONHASHSEED: is required with vLLM" in r.text
        assert "/v1/prefix_lookup" in r.text
    ok = (await c.post("/v1/prefix_lookup", json={"hashes": [11, 22, 33]})).json()
    assert ok["instances"]["a"]["hit_chunks"] == 2


@pytest.mark.parametrize(
    ("flags", "regime"),
    [
        ([], HashConfig(256, "sha256_cbor", save_unfull_chunk=True)),  # no vLLM: builtin
        (["--vllm"], HashConfig(256, "sha256_cbor", "123", save_unfull_chunk=True, vllm=True)),
    ],
)
def test_token_lookups_hash_in_the_domains_regime(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], regime: HashConfig
) -> None:
    """The rendered flags plus the injected PYTHONHASHSEED select the workers' regime."""
    from kvpool.controller.service import ControllerService

    monkeypatch.setenv("PYTHONHASHSEED", "123")
    argv = [a if a != "builtin" else "sha256_cbor" for a in RENDERED]
    settings = settings_from_args([*argv, *flags])
    assert settings.tokens_lookup_error is None
    svc = ControllerService(settings.model_copy(update={"monitor_ports": {"pull": 0}}))
    tokens = list(range(600))
    assert svc.token_hashes(tokens) == chunk_hashes(tokens, regime)
    assert len(svc.token_hashes(tokens)) == 3  # the partial chunk too, as LMCache's /lookup


def test_lookup_names_the_fastest_tier_when_tiers_hold_equal_shares() -> None:
    """GdsBackend sorts before LocalDiskBackend alphabetically; the disk tier is faster."""
    server = ControllerServer(ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0}))
    svc = server.service
    svc.handle_request(p.RegisterMsg("a", 0, "10.0.0.1", 7000, None))
    tokens = list(range(512))
    hashes = svc.token_hashes(tokens)
    for location in ("GdsBackend", "LocalDiskBackend"):
        ops = [p.KVOpEvent(p.OpType.ADMIT, h, i) for i, h in enumerate(hashes)]
        svc.handle_push(p.BatchedKVOperationMsg("a", 0, location, ops))
    per_location = svc.prefix_lookup(hashes)["a"]["per_location"]
    assert per_location == {"GdsBackend": 2, "LocalDiskBackend": 2}
    assert svc.lookup_tokens(tokens) == {"a": ("LocalDiskBackend", 512)}
