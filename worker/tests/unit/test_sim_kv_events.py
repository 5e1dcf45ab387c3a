"""vLLM's KV events of the simulated engine, read off its ZMQ sockets, and the HTTP endpoints a
precise router asks for (render, server info, event sources).

The expected wire shapes are vLLM >= 0.24's (tagged-map events in an array-like batch, one
``[topic, seq, payload]`` message per step, the replay ROUTER's 0.26+ framing), as written
down in /work/notes/vllm-kv-events.md and accepted by vllm-router 0.1.17.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from fastapi.testclient import TestClient

from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
from kvpool.worker.engine_api import GenerationRequest, SamplingParams
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.sim.config import SimConfigError
from kvpool.worker.sim.engine import SimEngine
from kvpool.worker.sim.kv_events import (
    MASK64,
    DeviceEventPublisher,
    KvEventsConfig,
    parse_kv_events_config,
)

Make = Callable[..., SimEngine]
A = [(i * 31) % 8000 + 5 for i in range(40)]  # 2 full chunks of 16 (+8 tokens)
B = A[:16] + [(i * 7) % 8000 + 5 for i in range(24)]  # shares chunk 0 only


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_events(make: Make) -> tuple[SimEngine, KvEventsConfig]:
    cfg = parse_kv_events_config(
        json.dumps(
            {
                "enable_kv_cache_events": True,
                "endpoint": f"tcp://*:{free_port()}",
                "replay_endpoint": f"tcp://*:{free_port()}",
            }
        )
    )
    assert cfg is not None and cfg.enabled and cfg.publisher == "zmq"
    eng = make()
    eng.kv_events = DeviceEventPublisher(cfg, block_size=4, chunk_size=16, bind_host="127.0.0.1")
    return eng, cfg


async def run_prompt(eng: SimEngine, rid: str, prompt: list[int]) -> None:
    req = GenerationRequest(rid, prompt, SamplingParams(max_tokens=2))
    [e async for e in eng.generate(req)]


def test_device_admits_and_evicts_are_vllm_batches_with_replay(make_sim_engine: Make) -> None:
    async def run() -> tuple[list[list[bytes]], list[list[bytes]]]:
        eng, cfg = with_events(make_sim_engine)
        await eng.start()
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(cfg.endpoint.replace("*", "127.0.0.1"))
        await asyncio.sleep(0.2)  # PUB/SUB: let the subscription reach the publisher
        await run_prompt(eng, "a", A)
        await run_prompt(eng, "b", B)
        assert await eng.evict(token_ids=A, locations=["device"]) == 2
        live = [await asyncio.wait_for(sub.recv_multipart(), 2) for _ in range(3)]
        dealer = ctx.socket(zmq.DEALER)
        assert cfg.replay_endpoint is not None
        dealer.connect(cfg.replay_endpoint.replace("*", "127.0.0.1"))
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replay = [await asyncio.wait_for(dealer.recv_multipart(), 2) for _ in range(3)]
        ctx.destroy(linger=0)
        await eng.shutdown(0.5)
        return live, replay

    live, replay = asyncio.run(run())
    assert [(f[0], int.from_bytes(f[1], "big")) for f in live] == [(b"", 0), (b"", 1), (b"", 2)]
    batches = [msgspec.msgpack.decode(f[2]) for f in live]
    assert all(len(b) == 3 and b[2] == 0 and isinstance(b[0], float) for b in batches)
    (stored_a,) = batches[0][1]
    assert list(stored_a) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx",
    ]  # fmt: skip
    assert stored_a["type"] == "BlockStored" and stored_a["parent_block_hash"] is None
    assert stored_a["token_ids"] == A[:32] and stored_a["block_size"] == 4
    assert len(stored_a["block_hashes"]) == 8 and stored_a["extra_keys"] == [None] * 8
    assert (stored_a["medium"], stored_a["group_idx"], stored_a["lora_id"]) == ("GPU", 0, None)
    assert all(0 <= h <= MASK64 for h in stored_a["block_hashes"])
    (stored_b,) = batches[1][1]  # B's chunk 0 is cached: only its chunk 1, under A's chunk 0
    assert stored_b["parent_block_hash"] == stored_a["block_hashes"][3]
    assert stored_b["token_ids"] == B[16:32]
    removed = batches[2][1]
    assert [r["type"] for r in removed] == ["BlockRemoved", "BlockRemoved"]
    assert [h for r in removed for h in r["block_hashes"]] == stored_a["block_hashes"]
    assert replay[:2] == [[b"", *live[i]] for i in (1, 2)]  # [b"", topic, seq, payload]
    assert replay[2] == [b"", b"", b"\xff" * 8, b""]  # the end marker (empty topic)


def test_the_config_flag_is_vllms_and_refusals_name_it() -> None:
    assert parse_kv_events_config(None) is None
    off = parse_kv_events_config('{"enable_kv_cache_events": false}')
    assert off is not None and not off.enabled and off.sources() == {}
    with pytest.raises(SimConfigError, match="unknown field"):
        parse_kv_events_config('{"enable_kv_cache_events": true, "colour": 1}')
    with pytest.raises(SimConfigError) as info:
        parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "nats"}')
    assert info.value.problems[0].field == "--kv-events-config"


def test_render_server_info_and_event_sources_over_http(make_sim_engine: Make) -> None:
    eng, cfg = with_events(make_sim_engine)
    tok = load_tokenizer(REFERENCE_TOKENIZER_DIR)
    with TestClient(build_app(WorkerRuntime(eng, tok))) as client:
        prompt = "the quick brown fox"
        r = client.post("/v1/completions/render", json={"prompt": prompt, "model": "m"})
        assert r.status_code == 200 and r.json()[0]["token_ids"] == tok.encode(prompt)
        chat: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        r = client.post("/v1/chat/completions/render", json=chat)
        assert r.json()["token_ids"] == client.post("/tokenize", json=chat).json()["tokens"]
        assert client.post("/v1/completions/render", json={"prompt": "x", "model": "y"}).json()[
            "error"
        ]["code"] == "model_not_found"  # fmt: skip
        assert client.get("/get_server_info").json() == {
            "model_id": "m",
            "kv_block_size": 4,
            "instance_id": "t",
        }
        sources = client.get("/kv_event_sources").json()
        assert sources["0"]["endpoint"] == cfg.endpoint
        assert (sources["0"]["encoding"], sources["0"]["schema_version"]) == ("msgpack", 1)


@pytest.mark.parametrize(
    ("host", "env", "reached"),
    [
        ("127.0.0.1", {}, "127.0.0.1"),  # kvpool-operator up: the bind address
        ("0.0.0.0", {"POD_IP": "10.0.0.7"}, "10.0.0.7"),  # a pod: its IP (downward API)
        ("0.0.0.0", {"POD_IP": "fd00::7"}, "[fd00::7]"),
    ],
)
def test_event_sources_name_an_address_a_router_can_connect_to(
    host: str, env: dict[str, str], reached: str
) -> None:
    """vllm-router refuses ``*`` and ``0.0.0.0`` in a static source: the sim reports where it
    is reached (what ``--kv-events-config`` binds stays vLLM's wildcard)."""
    from kvpool.protocol.simcore.profile import bundled_profiles
    from kvpool.worker.settings import WorkerSettings
    from kvpool.worker.sim.build import build_sim_engine

    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
        "replay_endpoint": "tcp://*:5558",
    }
    settings = WorkerSettings.from_env(
        {}, engine="sim", host=host, model="m", sim_profile=next(iter(bundled_profiles())),
        num_layers=2, num_kv_heads=2, head_dim=8, kv_dtype="bfloat16", block_size=16,
        max_model_len=1024, kv_events_config=json.dumps(events),
    )  # fmt: skip
    tok = load_tokenizer(REFERENCE_TOKENIZER_DIR)
    eng = build_sim_engine(settings, env, tok, None)
    assert eng.kv_events is not None and eng.kv_events.config.endpoint == "tcp://*:5557"
    source = eng.kv_event_sources()["0"]
    assert source["endpoint"] == f"tcp://{reached}:5557"
    assert source["replay_endpoint"] == f"tcp://{reached}:5558"
    named = KvEventsConfig(True, "zmq", "tcp://10.1.1.1:5557")
    assert named.sources("127.0.0.1")["0"]["endpoint"] == "tcp://10.1.1.1:5557"  # not a wildcard


def test_the_reference_engine_refuses_the_flag_it_cannot_honour() -> None:
    from kvpool.worker import cli

    args = cli._parser().parse_args(
        ["serve", "--engine", "reference", "--kv-events-config", '{"enable_kv_cache_events":true}']
    )
    with pytest.raises(cli.StartRefusedError, match="reference engine publishes no KV events"):
        cli.build_runtime(cli.settings_from(args, {}), {})
