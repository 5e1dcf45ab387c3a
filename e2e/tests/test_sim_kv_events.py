"""End to end: ``kvpool-operator up --sim-host`` of a simulated domain with engine.kvEvents.

Why: a KV-aware router outside kvpool (vllm-router's kv_aware, llm-d) learns what each engine
holds from vLLM's KV events; the operator allocates each instance's two ports and renders
``--kv-events-config``, ``up`` maps them to local ports inside that JSON flag, and the sim
publishes on them and names them in ``GET /kv_event_sources``. Here
``tests/sim-small-kv-events.yaml`` (tests/sim-small.yaml, publishing) runs as the render says:
every instance reports ``tcp://127.0.0.1:<its local port>`` (a router refuses ``*``), and a long
chat through the gateway is published by the instance that served it, in vLLM's wire format,
with the very token ids a router renders for the prompt, live and on replay. The manual check
with vllm-router 0.1.17 itself is described in operator/README.md.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from upstack import CHUNK, CLUSTER_REWRITES, chat, messages, poll

from kvpool.operator.local.up import UpProcess

DOMAIN = Path(__file__).resolve().parent / "sim-small-kv-events.yaml"
INSTANCES = [f"simevents-sim-{i}" for i in range(4)]
READY_S = 180.0
BLOCK = 16
END_SEQ = b"\xff" * 8


@pytest.fixture
def up(tmp_path: Path) -> Iterator[UpProcess]:
    proc = UpProcess([str(DOMAIN)], tmp_path / "up", sim_host=True)
    try:
        proc.start(READY_S)
        yield proc
    finally:
        proc.stop()


def _stored(payload: bytes) -> list[dict[str, Any]]:
    """The BlockStored events of one batch (``[ts, events, dp_rank]``, events tagged maps)."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert ts > 0 and rank == 0
    return [e for e in events if e["type"] == "BlockStored"]


def _replay(ctx: zmq.Context[Any], endpoint: str) -> list[list[bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append(frames[1:])  # [topic, seq, payload]
    finally:
        sock.close(linger=0)


def test_each_instance_publishes_vllm_kv_events_on_its_local_ports(up: UpProcess) -> None:
    state = up.state()
    processes, endpoints = state["processes"], state["endpoints"]
    sources: dict[str, dict[str, Any]] = {}
    for name in INSTANCES:
        ports = processes[name]["ports"]
        source = httpx.get(f"{endpoints[name]}/kv_event_sources", timeout=10).json()["0"]
        assert source["endpoint"] == f"tcp://127.0.0.1:{ports['kv-events']}"
        assert source["replay_endpoint"] == f"tcp://127.0.0.1:{ports['kv-replay']}"
        assert (source["encoding"], source["schema_version"]) == ("msgpack", 1)
        info = httpx.get(f"{endpoints[name]}/get_server_info", timeout=10).json()
        assert info["kv_block_size"] == BLOCK
        moved = [r for r in processes[name]["rewrites"] if "<json>" in r]
        assert len(moved) == 2 and all(CLUSTER_REWRITES.match(r) for r in moved), moved
        assert all("'tcp://*:" in r.split(" -> ")[1] for r in moved)  # still a wildcard bind
        sources[name] = source
    assert len({s["endpoint"] for s in sources.values()}) == len(INSTANCES)

    ctx: zmq.Context[Any] = zmq.Context()
    subs = {}
    try:
        for name, source in sources.items():
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(source["endpoint"])
            subs[name] = sub
        msgs = messages("the published harbor", 120)
        body = {"messages": msgs}
        url = endpoints[INSTANCES[0]]
        ids = httpx.post(f"{url}/v1/chat/completions/render", json=body, timeout=30).json()
        tokens = ids["token_ids"]
        full = len(tokens) // CHUNK
        assert full >= 4, len(tokens)

        time.sleep(1.0)  # PUB drops what it sends before a SUB's subscription has arrived
        reply = chat(endpoints["simevents-gateway"], msgs)
        served = reply.headers["x-kvpool-instance"]
        sub = subs[served]
        seen: list[dict[str, Any]] = []

        def published() -> bool:
            while sub.poll(0):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"" and len(seq) == 8
                seen.extend(_stored(payload))
            return sum(len(e["block_hashes"]) for e in seen) >= full * CHUNK // BLOCK

        poll(f"{served}'s BlockStored events", published)
        first = seen[0]
        assert first["parent_block_hash"] is None and first["medium"] == "GPU"
        assert first["block_size"] == BLOCK
        published_ids = [t for e in seen for t in e["token_ids"]]
        assert published_ids == tokens[: len(published_ids)]  # what a router renders and matches
        assert len(published_ids) >= full * CHUNK
        for other in INSTANCES:
            if other != served:
                assert not subs[other].poll(0), f"{other} published {served}'s prompt"

        replayed = _replay(ctx, sources[served]["replay_endpoint"])
        assert [int.from_bytes(seq, "big") for _, seq, _ in replayed] == list(range(len(replayed)))
        again = [e for _, _, payload in replayed for e in _stored(payload)]
        assert [t for e in again for t in e["token_ids"]][: len(published_ids)] == published_ids
    finally:
        for sock in subs.values():
            sock.close(linger=0)
        ctx.term()
    assert up.stop() == 0, up.output.read_text()[-3000:]


def test_the_variant_differs_from_sim_small_only_by_kv_events_and_names() -> None:
    plain = (DOMAIN.parent / "sim-small.yaml").read_text().split("apiVersion", 1)[1]
    events = DOMAIN.read_text().split("apiVersion", 1)[1]
    assert "    kvEvents: true\n" in events
    assert events.replace("    kvEvents: true\n", "") == plain.replace("simsmall", "simevents")
