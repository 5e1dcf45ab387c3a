"""Fixtures of the simulated engine's unit tests: a small test profile and an engine factory."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
from kvpool.protocol.hashing import HashConfig
from kvpool.protocol.simcore.instance import InstanceConfig
from kvpool.protocol.simcore.profile import PerfProfile, parse_profile

SIM_TOKENIZER = load_tokenizer(REFERENCE_TOKENIZER_DIR)


def sim_profile(**step: float) -> PerfProfile:
    """10 ms per step, 0.1 ms per prefill token, free KV moves (made up, for tests)."""
    raw = {
        "name": "t", "description": "test", "chip": "none", "engine": "vllm",
        "sources": [{"what": "made up", "where": "this test"}],
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
        "step": {"overhead_s": 0.01, "prefill_token_s": 0.0001, "attn_s": 0.0,
                 "decode_seq_s": 0.0, "decode_ctx_s": 0.0, **step},
        "request_s": 0.0, "load": {k: {"gbps": 1.0} for k in ("ddr", "disk", "p2p", "remote")},
        "store": {"gbps": 1.0}, "device_kv_gib": 1.0, "max_num_seqs": 8,
        "max_num_batched_tokens": 4096,
    }  # fmt: skip
    return parse_profile(json.dumps(raw))


@pytest.fixture
def make_sim_engine() -> Callable[..., Any]:
    """``make(speedup=50, ddr=8, disk=0, **engine_kw)``: a SimEngine over 16-token chunks of
    4-token blocks, 256 device blocks, no controller unless ``client`` is set later."""
    from kvpool.worker.sim.build import ordinary_token_ids
    from kvpool.worker.sim.engine import SimEngine

    def make(speedup: float = 50.0, ddr: int = 8, disk: int = 0, **kw: Any) -> SimEngine:
        cfg = InstanceConfig(
            profile=sim_profile(), chunk_size=16, block_size=4, kv_bytes_per_token=0,
            device_blocks=256, ddr_chunks=ddr, disk_chunks=disk, max_model_len=2048,
            touch_on_hit=not kw.get("p2p", False),
        )  # fmt: skip
        return SimEngine(
            "t", cfg, model_name="m", hashing=HashConfig(chunk_size=16),
            vocab=ordinary_token_ids(SIM_TOKENIZER), vocab_size=SIM_TOKENIZER.vocab_size,
            speedup=speedup, **kw,
        )  # fmt: skip

    return make
