"""Pure parts of the simulated engine: config reading and refusals, admit/evict batching, the
REP socket's answers, and the memory API over simcore.

Expectations come from LMCache 0.5.6's worker (/work/notes/lmcache-worker-protocol.md): its
config defaults, its batch sender (numbered at drain time from 0, drained whole), the replies of
``LMCacheWorker.handle_request``, and the reference worker's memory-API semantics.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvpool.protocol import lmcache_wire as w
from kvpool.protocol.hashing import HashConfig, chunk_hashes
from kvpool.protocol.simcore.instance import CPU_BACKEND, DISK_BACKEND, InstanceConfig, SimInstance
from kvpool.protocol.simcore.kvcache import KvEvent
from kvpool.protocol.simcore.profile import bundled_profile, parse_profile
from kvpool.worker.settings import WorkerSettings
from kvpool.worker.sim.config import (
    GIB,
    SimConfigError,
    SimShape,
    chunk_capacity,
    instance_config,
    lmcache_view,
    load_profile,
)
from kvpool.worker.sim.control import reply_to
from kvpool.worker.sim.kv_batch import KvOpBatcher
from kvpool.worker.sim.memory import SimMemory

BASE = {"chunk_size": 256, "lmcache_instance_id": "a~0123456789ab", "max_local_cpu_size": 0.5}
CONTROLLER = {
    "enable_controller": True,
    "controller_pull_url": "127.0.0.1:1",
    "controller_reply_url": "127.0.0.1:2",
    "lmcache_worker_ports": [3],
}
SHAPE = SimShape(32, 8, 128, "bfloat16", 16, 8192)  # Llama-3.1-8B: 128 KiB of KV per token


# ---------------------------------------------------------------------- config
def test_tiers_are_sized_from_the_rendered_config_like_lmcache() -> None:
    lmc = lmcache_view({**BASE, "local_disk": "file:///d", "max_local_disk_size": 1})
    profile = bundled_profile("h100-llama-3.1-8b-vllm")
    cfg = instance_config(profile, SHAPE, lmc, "m")
    assert cfg.kv_bytes_per_token == 131072
    assert cfg.ddr_chunks == 16  # 0.5 GiB / (256 tokens x 128 KiB)
    assert cfg.disk_chunks == 32
    assert cfg.device_blocks == int(profile.device_kv_gib * GIB // (131072 * 16))
    assert cfg.max_num_seqs == profile.max_num_seqs
    assert cfg.touch_on_hit  # synchronous loading refreshes the LRU
    assert chunk_capacity(10_000, 4097) == 1  # each chunk takes whole 4 KiB pages
    assert lmcache_view({**BASE, "local_disk": "file:///d"}).disk_bytes == 0  # no size: no tier


def test_controller_knobs_and_lmcache_defaults() -> None:
    link = lmcache_view({**BASE, **CONTROLLER}).controller
    assert link is not None
    assert (link.heartbeat_s, link.heartbeat_delay_s, link.recv_timeout_s) == (None, 10.0, 30.0)
    assert (link.kv_batch_size, link.kv_batch_timeout_s) == (50, 0.01)
    assert link.full_sync.startup_delay_s == 5.0 and link.full_sync.batch_size == 2000
    extra = {
        "worker_socket_recv_timeout_ms": 3000,
        "full_sync_status_poll_interval_s": 0.2,
        "full_sync_batch_interval_ms": 1,
    }
    tuned = lmcache_view(
        {**BASE, **CONTROLLER, "lmcache_worker_heartbeat_time": 2, "extra_config": extra}
    ).controller
    assert tuned is not None
    assert tuned.heartbeat_s == 2.0 and tuned.recv_timeout_s == 3.0
    assert tuned.full_sync.poll_interval_s == 0.2 and tuned.full_sync.batch_interval_s == 0.001
    p2p = lmcache_view(
        {**BASE, "enable_p2p": True, "enable_async_loading": True, "p2p_host": "h",
         "p2p_init_ports": [7]}
    )  # fmt: skip
    assert p2p.peer_init_url == "h:7" and p2p.async_loading
    assert not instance_config(
        bundled_profile("h100-llama-3.1-8b-vllm"), SHAPE, p2p, "m"
    ).touch_on_hit


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"remote_url": "redis://r:6379"}, "remote_url", "remove tiers.remote"),
        ({"enable_pd": True}, "enable_pd", "PD is not simulated"),
        ({"enable_kv_events": True}, "enable_kv_events", "not simulated"),
        ({"enable_p2p": True, "p2p_host": "h", "p2p_init_ports": [1]}, "enable_async_loading",
         "must be true"),
        ({"enable_controller": True}, "controller_pull_url", "required"),
        ({"chunk_size": "big"}, "chunk_size", "must be int"),
    ],
)  # fmt: skip
def test_what_the_sim_does_not_model_is_refused_naming_the_key(
    extra: dict[str, Any], key: str, words: str
) -> None:
    with pytest.raises(SimConfigError) as info:
        lmcache_view({**BASE, **extra})
    assert any(p.field == key and words in str(p) for p in info.value.problems), info.value


def test_flags_the_sim_needs_are_named() -> None:
    profile = bundled_profile("h100-llama-3.1-8b-vllm")
    with pytest.raises(SimConfigError) as info:
        instance_config(profile, SimShape(None, 8, None, "bfloat16", 16, 8192), None, "m")
    assert [p.field for p in info.value.problems] == ["--num-layers", "--head-dim"]
    bad = SimShape(32, 8, 128, "float64", 48, 8192, tensor_parallel_size=2)
    with pytest.raises(SimConfigError) as info:
        instance_config(profile, bad, None, "m")
    assert [p.field for p in info.value.problems] == ["--tensor-parallel-size", "--block-size"]
    with pytest.raises(SimConfigError) as info:
        instance_config(profile, SimShape(32, 8, 128, "float64", 16, 8192), None, "m")
    assert info.value.problems[0].field == "--kv-dtype"
    with pytest.raises(SimConfigError, match="--sim-device-kv-gib"):
        instance_config(
            profile, SimShape(32, 8, 128, "bfloat16", 16, 8192, device_kv_gib=0.001), None, "m"
        )
    with pytest.raises(SimConfigError, match="does not divide chunk_size"):
        instance_config(profile, SimShape(32, 8, 128, "bfloat16", 48, 8192), None, "m")


def test_profiles_by_name_or_path(tmp_path: Any) -> None:
    assert load_profile("h100-llama-3.1-8b-vllm").chip.startswith("NVIDIA H100")
    path = tmp_path / "p.json"
    path.write_text(load_profile("h100-llama-3.1-8b-vllm").to_json())
    assert load_profile(str(path)).name == "h100-llama-3.1-8b-vllm"
    with pytest.raises(SimConfigError) as info:
        load_profile("nope")
    assert info.value.problems[0].field == "--sim-profile"
    assert "h100-llama-3.1-8b-vllm" in info.value.problems[0].message
    with pytest.raises(SimConfigError, match="is required"):
        load_profile(None)


def test_settings_read_only_the_environment_they_are_given(monkeypatch: Any) -> None:
    monkeypatch.setenv("KVPOOL_WORKER_PORT", "1234")
    assert WorkerSettings.from_env({}).port == 8000
    assert WorkerSettings.from_env({"kvpool_worker_port": "99"}).port == 99
    s = WorkerSettings.from_env({"KVPOOL_WORKER_SIM_SPEEDUP": "4"}, port=7)
    assert (s.port, s.sim_speedup) == (7, 4.0)


# ---------------------------------------------------------------------- batching
def test_batches_are_numbered_at_drain_from_zero_per_location_and_keep_order() -> None:
    sent: list[w.BatchedKVOperationMsg] = []

    async def run() -> None:
        b = KvOpBatcher("i", 0, CPU_BACKEND, sent.append, batch_size=3, timeout_s=0.01)
        b.add("admit", 11)
        b.add("evict", -5)
        await asyncio.sleep(0.03)  # the timeout flushes the two
        for key in range(5):  # reaching 3 drains everything queued by the end of the turn
            b.add("admit", key)
        await asyncio.sleep(0)
        await asyncio.sleep(0.03)

    asyncio.run(run())
    assert [len(m.operations) for m in sent] == [2, 5]
    ops = [op for m in sent for op in m.operations]
    assert [op.seq_num for op in ops] == list(range(7))
    assert [(op.op_type.value, op.key) for op in ops[:2]] == [("admit", 11), ("evict", -5)]
    assert all(m.location == CPU_BACKEND and m.instance_id == "i" for m in sent)


# ---------------------------------------------------------------------- memory and commands
RAW_PROFILE = {
    "name": "t", "description": "test", "chip": "none", "engine": "vllm",
    "sources": [{"what": "made up", "where": "this test"}],
    "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
    "step": {"overhead_s": 0.01, "prefill_token_s": 0.001, "attn_s": 0.0, "decode_seq_s": 0.001,
             "decode_ctx_s": 0.0},
    "request_s": 0.0, "load": {k: {"gbps": 1.0} for k in ("ddr", "disk", "p2p", "remote")},
    "store": {"gbps": 1.0}, "device_kv_gib": 1.0, "max_num_seqs": 4, "max_num_batched_tokens": 64,
}  # fmt: skip
HASHING = HashConfig(chunk_size=16)


def memory(disk: int = 0) -> tuple[SimMemory, list[KvEvent]]:
    cfg = InstanceConfig(
        profile=parse_profile(json.dumps(RAW_PROFILE)), chunk_size=16, block_size=4,
        kv_bytes_per_token=1, device_blocks=64, ddr_chunks=4, disk_chunks=disk,
    )  # fmt: skip
    events: list[KvEvent] = []
    return SimMemory(SimInstance("a", cfg), HASHING, events.extend, worker_port=9), events


TOKENS = list(range(100, 150))  # 3 full chunks of 16 (+2 tokens not hashed)


def test_memory_api_pin_evict_prefetch_like_the_reference_worker() -> None:
    mem, events = memory(disk=8)
    keys = chunk_hashes(TOKENS, HASHING)
    mem.inst.ddr.put(keys[:2], events)
    mem.inst.disk.put(keys, events)
    assert mem.pin(TOKENS) == 48  # chunk 3 only on disk: pinned there
    assert mem.evict(token_ids=TOKENS) == 0  # pinned by the memory API: stays
    assert mem.counters["evict_skipped_pinned"] == 3
    assert mem.unpin(TOKENS) == 48
    assert mem.evict(token_ids=TOKENS, locations=["ddr"]) == 2
    assert mem.prefetch(TOKENS) == 48  # back from disk into DDR
    assert [e.location for e in events[-3:]] == [CPU_BACKEND] * 3
    with pytest.raises(ValueError, match="unknown tier 'redis'"):
        mem.evict(token_ids=TOKENS, locations=["redis"])
    tiers: Any = mem.stats(0.0, 0.0)["tiers"]
    assert tiers["local_cpu"]["chunks"] == 3
    assert set(tiers) == {"device", "local_cpu", "local_disk"}


def test_controller_commands_answer_as_lmcache() -> None:
    mem, events = memory()
    keys = chunk_hashes(TOKENS, HASHING)
    mem.inst.ddr.put(keys, events)
    pin = reply_to(w.PinWorkerMsg("e", CPU_BACKEND, TOKENS), mem)
    assert pin == w.PinWorkerRetMsg(num_tokens=48)
    assert reply_to(w.PinWorkerMsg("e", DISK_BACKEND, TOKENS), mem) == w.PinWorkerRetMsg(0)
    n = len(events)
    assert reply_to(w.CompressWorkerMsg("e", "cachegen", CPU_BACKEND, TOKENS), mem) == (
        w.CompressWorkerRetMsg(num_tokens=48)
    )
    assert [e.op for e in events[n:]] == []  # pinned for good by the Pin: nothing moves
    assert reply_to(w.CompressWorkerMsg("e", "zstd", CPU_BACKEND, None), mem) == (
        w.CompressWorkerRetMsg(num_tokens=0)
    )
    assert reply_to(w.DecompressWorkerMsg("e", "cachegen", CPU_BACKEND, None), mem) == (
        w.ErrorMsg(error="Worker error: ")
    )
    assert reply_to(w.ClearWorkerMsg("e", CPU_BACKEND), mem) == w.ClearWorkerRetMsg(0)
    assert reply_to(w.HealthWorkerMsg("h"), mem) == w.HealthWorkerRetMsg(error_code=0)
    assert reply_to(w.CheckFinishWorkerMsg("c1"), mem) == w.ErrorMsg(
        error="Unknown message: CheckFinishWorkerMsg(worker_event_id='c1')"
    )
    move = w.MoveWorkerMsg("m", CPU_BACKEND, ("peer:1", DISK_BACKEND), TOKENS)
    assert reply_to(move, mem) == w.ErrorMsg(
        error="Worker error: Only support moving to cpu for now."
    )
    move = w.MoveWorkerMsg("m", CPU_BACKEND, ("peer:1", CPU_BACKEND), TOKENS)
    assert reply_to(move, mem) == w.ErrorMsg(error="Worker error: 'P2PBackend'")
    move = w.MoveWorkerMsg("m", CPU_BACKEND, ("peer:1", CPU_BACKEND), [1, 2, 3] * 6)
    assert reply_to(move, mem) == w.MoveWorkerRetMsg(num_tokens=0)  # nothing to move
    intra = w.MoveWorkerMsg("m", DISK_BACKEND, ("*:9", CPU_BACKEND), TOKENS)
    assert reply_to(intra, mem) == w.ErrorMsg(error="Worker error: ")


def test_clear_and_recompress_emit_lmcache_events() -> None:
    mem, events = memory()
    keys = chunk_hashes(TOKENS, HASHING)
    mem.inst.ddr.put(keys, events)
    del events[:]
    assert reply_to(w.CompressWorkerMsg("e", "cachegen", CPU_BACKEND, TOKENS), mem) == (
        w.CompressWorkerRetMsg(num_tokens=48)
    )
    assert [(e.op, e.key) for e in events] == [("evict", k) for k in keys] + [
        ("admit", k) for k in keys
    ]
    del events[:]
    assert reply_to(w.ClearWorkerMsg("e", CPU_BACKEND), mem) == w.ClearWorkerRetMsg(48)
    assert [e.op for e in events] == ["evict"] * 3 and len(mem.inst.ddr) == 0
    assert reply_to(w.ClearWorkerMsg("e", DISK_BACKEND), mem) == w.ClearWorkerRetMsg(0)
