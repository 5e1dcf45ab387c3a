"""The fleet simulator: its chunk keys, its decisions against a gateway's, its commands.

- Keys from hash ids are equal exactly where LMCache's chunk hashes of the prompts the replay
  builds are equal (the reference tokenizer, kvpool.protocol.hashing).
- Every decision of a simulated run equals the decision of a separately built gateway state
  (``build_state``) whose index replica is fed the same admits and evicts as controller delta
  batches, whose load tracker sees the same first bytes and ends, and which hashes the prompts
  from their token ids: the simulator routes with the gateway's own code on the same state.
- ``simulate`` and ``plan`` answer on a small trace and refuse bad input naming the flag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.fleetsim import cli as simcli
from kvpool.gateway.fleetsim.fleet import FleetConfig, FleetSim, Observer
from kvpool.gateway.fleetsim.keys import chunk_keys
from kvpool.gateway.fleetsim.planner import PlanPoint, smallest
from kvpool.gateway.load import Ticket
from kvpool.gateway.routing import Decision
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState, build_state
from kvpool.gateway.traces.blocks import BlockPromptBuilder, Vocabulary
from kvpool.gateway.traces.mooncake import TraceRequest
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
from kvpool.protocol.deltas import Delta, DeltaBatch, DeltaOp, Snapshot
from kvpool.protocol.hashing import HashConfig, chunk_hashes
from kvpool.protocol.simcore.kvcache import KvEvent
from kvpool.protocol.simcore.profile import bundled_profile

BLOCK = 32  # trace block tokens (small, so prompts are short)
CHUNK = 16
PROFILE = bundled_profile("h100-llama-3.1-8b-vllm")


@pytest.fixture(scope="module")
def builder() -> BlockPromptBuilder:
    tok = load_tokenizer(REFERENCE_TOKENIZER_DIR)
    return BlockPromptBuilder(Vocabulary.from_tokenizer(tok), block_size=BLOCK)


def row(i: int, at: float, ids: list[int], length: int, out: int = 4) -> TraceRequest:
    return TraceRequest(i, i + 1, at, length, out, tuple(ids))


@st.composite
def pairs(draw: st.DrawFn) -> tuple[list[int], int, list[int], int]:
    shared = draw(st.lists(st.integers(0, 5), max_size=4))
    a = shared + draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    b = shared + draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    la = draw(st.integers(len(a) * BLOCK - BLOCK + 1, len(a) * BLOCK))
    lb = draw(st.integers(len(b) * BLOCK - BLOCK + 1, len(b) * BLOCK))
    return a, la, b, lb


@given(pairs(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_keys_are_equal_where_lmcache_hashes_are(
    builder: BlockPromptBuilder, p: tuple[list[int], int, list[int], int], unfull: bool
) -> None:
    a, la, b, lb = p
    config = HashConfig(chunk_size=CHUNK, save_unfull_chunk=unfull)
    ha = chunk_hashes(builder.token_ids(a, la), config)
    hb = chunk_hashes(builder.token_ids(b, lb), config)
    args = {"chunk_size": CHUNK, "block_tokens": BLOCK, "save_unfull_chunk": unfull}
    ka = chunk_keys(a, la, **args)
    kb = chunk_keys(b, lb, **args)
    assert len(ka) == len(ha) and len(kb) == len(hb)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (ha[i] == hb[i]), i


def test_keys_refuse_ids_that_do_not_cover_the_prompt() -> None:
    with pytest.raises(ValueError, match="needs 2 block"):
        chunk_keys([1], 40, chunk_size=CHUNK, block_tokens=BLOCK)


class GatewayMirror(Observer):
    """A gateway state built like the real one, fed what the simulated controller saw, asked
    for every decision the simulator made."""

    def __init__(self, state: GatewayState, builder: BlockPromptBuilder) -> None:
        self.state = state
        self.builder = builder
        self.tickets: dict[int, Ticket] = {}
        self.seq = 0
        self.checked = 0
        state.index.controller_up = True
        state.index.replica.load_snapshot(Snapshot("sim", 0, [], []))
        state.selector.clock = lambda: self.now
        self.now = 0.0

    def routed(self, now: float, request: TraceRequest, prompt: Prompt, decision: Decision) -> None:
        self.now = now
        tokens = self.builder.token_ids(request.hash_ids, request.input_length)
        mine = Prompt(len(tokens), tuple(self.state.hasher(tokens)), None)
        assert mine == prompt  # the gateway hashes the prompt as the simulator keyed it
        sel = self.state.selector
        inst, gw = asyncio.run(sel.choose(self.state.instances.peers(), mine, set(), record=False))
        assert (gw.instance, gw.reason, gw.predicted_hit_tokens) == (
            decision.instance,
            decision.reason,
            decision.predicted_hit_tokens,
        )
        self.tickets[request.index] = sel.admit(inst, mine, gw).ticket
        self.checked += 1

    def first_token(self, now: float, request: TraceRequest) -> None:
        self.state.load.first_byte(self.tickets[request.index], now)

    def finished(self, now: float, request: TraceRequest) -> None:
        self.state.load.finish(self.tickets.pop(request.index))

    def indexed(self, now: float, instance: str, events: list[KvEvent]) -> None:  # type: ignore[override]
        deltas = []
        for e in events:
            self.seq += 1
            op = DeltaOp.ADMIT if e.op == "admit" else DeltaOp.EVICT
            deltas.append(Delta(self.seq, op, f"{instance}~fp", 0, e.location, [e.key]))
        assert self.state.index.replica.apply_batch(DeltaBatch("sim", deltas))


def test_the_simulator_decides_as_a_gateway_on_the_same_state(
    builder: BlockPromptBuilder,
) -> None:
    """Sessions sharing system prompts, arriving faster than 4 small instances serve them:
    hits, pending prefixes, load and the imbalance guard all take part."""
    requests = []
    for i in range(60):
        tenant = i % 3
        turns = 1 + (i // 3) % 4
        ids = [100 + tenant, 200 + tenant] + [1000 + i // 12 * 10 + t for t in range(turns)]
        requests.append(row(i, i * 0.02, ids, len(ids) * BLOCK - (i % 7), out=1 + i % 9))
    cfg = FleetConfig(
        instances=4,
        profile=PROFILE,
        ddr_bytes=40 * CHUNK * PROFILE.model.kv_bytes_per_token(),
        chunk_size=CHUNK,
        block_size=16,
        device_kv_gib=0.05,
        trace_block_tokens=BLOCK,
    )
    raw = {
        "model": "m",
        "chunkSize": CHUNK,
        "controllerUrl": "http://127.0.0.1:9",
        "controllerPubUrl": "tcp://127.0.0.1:9",
        "controllerSnapshotUrl": "tcp://127.0.0.1:9",
        "p2pGroups": [
            {
                "name": "fleet",
                "p2p": False,
                "instances": [{"name": n, "url": f"http://{n}.sim"} for n in cfg.names()],
            }
        ],
    }
    state = build_state(parse_config(raw), GatewayEnv())
    for inst in state.instances:
        inst.ready = True
    mirror = GatewayMirror(state, builder)
    hash_config = HashConfig(chunk_size=CHUNK)

    def keys_of(r: TraceRequest) -> tuple[int, ...]:
        return tuple(chunk_hashes(builder.token_ids(r.hash_ids, r.input_length), hash_config))

    run = FleetSim(cfg, keys_of=keys_of, observer=mirror).run(requests)
    assert mirror.checked == len(requests)
    reasons = {r.reason for r in run.results}
    assert "kv-hit" in reasons and len({r.instance for r in run.results}) > 1
    assert sum(r.cached_tokens for r in run.results) > 0


def test_a_run_is_deterministic_and_every_request_ends() -> None:
    requests = [row(i, i * 0.5, [i % 4, 10 + i % 2], 2 * BLOCK) for i in range(30)]
    cfg = FleetConfig(
        instances=3,
        profile=PROFILE,
        ddr_bytes=1 << 30,
        chunk_size=CHUNK,
        trace_block_tokens=BLOCK,
    )
    a = FleetSim(cfg).run(requests)
    b = FleetSim(cfg).run(requests)
    assert [r.ttft_s for r in a.results] == [r.ttft_s for r in b.results]
    assert all(r.e2e_s is not None and r.error is None for r in a.results)
    assert len(a.results) == 30


def test_smallest_fleet_per_policy_and_ddr() -> None:
    pts = [
        PlanPoint("kv-aware", 4, 32, 3.0, 1.0, 0.2, 0.5, 0.1),
        PlanPoint("kv-aware", 8, 32, 1.5, 0.5, 0.2, 0.9, 0.1),
        PlanPoint("kv-aware", 4, 64, 1.8, 0.5, 0.3, 0.9, 0.1),
        PlanPoint("round-robin", 8, 32, 2.5, 1.0, 0.1, 0.5, 0.1),
    ]
    answer = smallest(pts, 2.0)
    assert answer["by_ddr"]["kv-aware"] == {"32": 8, "64": 4}
    assert answer["by_ddr"]["round-robin"] == {"32": None}
    assert answer["smallest"] == {"kv-aware": {"instances": 4, "ddr_gib": 64}, "round-robin": None}


def _trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i * 200, "input_length": 700, "output_length": 5, "hash_ids": [i % 3, 7]}
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    simcli.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.handler(args))


def test_simulate_and_plan_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path)
    out = tmp_path / "sim.json"
    code = _main(["simulate", "--trace", str(trace), "--instances", "2", "--ddr-gib", "8",
                  "--policy", "kv-aware", "--policy", "oracle", "--out", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"kv-aware", "oracle"}
    assert data["runs"]["kv-aware"]["completed"] == 40
    assert "| kv-aware |" in capsys.readouterr().out
    code = _main(["plan", "--trace", str(trace), "--instances", "1,2", "--ddr-gib", "8",
                  "--target-ttft-p90-ms", "60000", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert json.loads(out.read_text())["answer"]["smallest"]["kv-aware"]["instances"] == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "random"], "--policy: 'random' is not one of"),
        (["--profile", "nope"], "--profile: 'nope' is neither a bundled profile"),
        (["--count", "0"], "--trace: window count must be >= 1"),
    ],
)
def test_simulate_refuses_bad_flags_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    argv = ["simulate", "--trace", str(_trace(tmp_path)), "--instances", "2", "--ddr-gib", "8"]
    assert _main(argv + extra) == 2
    assert message in capsys.readouterr().err


def test_simulate_refuses_a_trace_that_is_not_mooncake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": "x"}\n')
    assert _main(["simulate", "--trace", str(bad), "--instances", "1", "--ddr-gib", "1"]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
