"""LMCacheOffload over the real LMCache engine with the local CPU tier only (no services).

The KV round trip at the offload level: store from paged caches, retrieve into other slots,
tensors equal; hits ending mid-chunk; partial prefixes; evict/pin/prefetch/stats; bad input.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kvpool.worker.engine.offload import LMCacheOffload, OffloadConfigError

CPU = {"local_cpu": True}
GEOMETRY: dict[str, Any] = {
    "num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
    "dtype": torch.float32, "model_name": "m",
}  # fmt: skip
BS = 16


def _rows(kv: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer.view(2, -1, *layer.shape[3:])[:, slots] for layer in kv]


def _same(
    a: Sequence[torch.Tensor], sa: torch.Tensor, b: Sequence[torch.Tensor], sb: torch.Tensor
) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_rows(a, sa), _rows(b, sb), strict=True))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_round_trip_into_other_slots_is_bit_exact(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    off = make_offload(CPU)
    src, dst = paged_kv(), paged_kv(zeros=True)
    tokens = _tokens(1000, 1)
    s_src = torch.randperm(128 * BS)[:1000]
    s_dst = torch.randperm(128 * BS)[:1000]
    off.store(tokens, src, s_src)
    assert off.lookup(tokens) == 768  # whole chunks only (save_unfull_chunk false)
    assert off.retrieve(tokens, 768, dst, s_dst) == 768
    assert _same(src, s_src[:768], dst, s_dst[:768])
    assert all(torch.count_nonzero(r) == 0 for r in _rows(dst, s_dst[768:]))


def test_hit_ending_mid_chunk_writes_only_requested_tokens(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    off = make_offload(CPU)
    src, dst = paged_kv(), paged_kv(zeros=True)
    tokens = _tokens(600, 2)
    slots = torch.arange(600)
    off.store(tokens, src, slots)
    assert off.retrieve(tokens, 300, dst, slots + 1000) == 300
    assert _same(src, slots[:300], dst, slots[:300] + 1000)
    assert all(torch.count_nonzero(r) == 0 for r in _rows(dst, slots[300:512] + 1000))


def test_partial_prefix_hit_and_no_restore_of_stored_chunks(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    off = make_offload(CPU)
    src = paged_kv()
    a = _tokens(768, 3)
    off.store(a, src, torch.arange(768))
    stored = off.metrics()["stored_bytes.local_cpu"]
    b = a[:512] + _tokens(300, 4)
    assert off.lookup(b) == 512
    off.store(b, src, torch.arange(812))  # only b's third chunk is new
    assert off.metrics()["stored_bytes.local_cpu"] == pytest.approx(stored * 4 / 3)
    assert off.lookup(b) == 768


def test_evict_pin_unpin_and_stats(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    off = make_offload(CPU)
    tokens = _tokens(768, 5)
    off.store(tokens, paged_kv(), torch.arange(768))
    stats = off.memory_stats()
    assert stats["tiers"]["local_cpu"]["chunks"] == 3  # type: ignore[index]
    assert off.pin(tokens[:512]) == 512
    assert off.memory_stats()["pinned_chunks"] == 2
    assert off.evict(token_ids=tokens) == 1  # the two pinned chunks are kept
    assert off.lookup(tokens) == 512
    assert off.unpin(tokens) == 512
    hashes = off.chunk_hashes(tokens)
    assert off.evict(chunk_hashes=hashes[:1], locations=["cpu"]) == 1
    assert off.lookup(tokens) == 0
    assert off.metrics()["evicted_chunks"] == 2


def test_store_while_lmcache_is_frozen_is_counted_as_skipped_not_stored(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    """LMCache drops stores during a full sync to the controller (its freeze mode, set by
    the full-sync sender through ``freeze``): the offload says so in its metrics and
    counts no stored bytes; once the sync ends the same prompt is stored."""
    off = make_offload(CPU)
    tokens, kv = _tokens(768, 6), paged_kv()
    off.engine.freeze(True)
    assert off.metrics()["lmcache_frozen"] == 1.0
    off.store(tokens, kv, torch.arange(768))
    assert off.lookup(tokens) == 0
    assert off.metrics()["store_skipped_frozen_tokens"] == 768
    assert "stored_bytes.local_cpu" not in off.metrics()
    off.engine.freeze(False)
    off.store(tokens, kv, torch.arange(768))
    assert off.lookup(tokens) == 768
    assert off.metrics()["lmcache_frozen"] == 0.0
    assert off.metrics()["stored_bytes.local_cpu"] > 0


def test_prefetch_reports_ddr_resident_tokens(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any]
) -> None:
    off = make_offload(CPU)
    tokens = _tokens(512, 6)
    assert off.prefetch(tokens) == 0
    off.store(tokens, paged_kv(), torch.arange(512))
    assert off.prefetch(tokens) == 512


def test_bad_input_is_named(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any], tmp_path: Any
) -> None:
    off = make_offload(CPU)
    with pytest.raises(ValueError, match="unknown tier 'tape'"):
        off.evict(token_ids=[1, 2], locations=["tape"])
    with pytest.raises(ValueError, match="exactly one"):
        off.evict()
    with pytest.raises(ValueError, match="kv_caches: expected 4 layers"):
        off.store([1] * 256, paged_kv()[:2], torch.arange(256))
    with pytest.raises(ValueError, match="slot_mapping has 10 slots"):
        off.store([1] * 256, paged_kv(), torch.arange(10))
    with pytest.raises(OffloadConfigError, match="does not exist"):
        LMCacheOffload(tmp_path / "nope.yaml", instance_id="x", **GEOMETRY)
    with pytest.raises(OffloadConfigError, match="dtype 'int3'"):
        make_offload(CPU, dtype="int3")
    with pytest.raises(OffloadConfigError, match="use_layerwise"):
        make_offload({"use_layerwise": True})


def test_config_file_is_read(tmp_path: Any, make_offload: Callable[..., LMCacheOffload]) -> None:
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text("chunk_size: 128\nlocal_cpu: true\nmax_local_cpu_size: 0.1\n")
    off = LMCacheOffload(cfg, instance_id="file-cfg", **GEOMETRY)
    try:
        assert off.chunk_size == 128
    finally:
        off.close(5)


def test_close_returns_by_its_deadline_when_lmcache_hangs(
    make_offload: Callable[..., LMCacheOffload], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test double replaces LMCache's destroy with one that hangs (as it can with Redis)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    off = make_offload(CPU)
    release = threading.Event()
    real_destroy = LMCacheEngineBuilder.destroy
    monkeypatch.setattr(LMCacheEngineBuilder, "destroy", lambda _id: release.wait(30))
    t0 = time.monotonic()
    off.close(0.5)
    assert time.monotonic() - t0 < 2.0
    assert off.closed_cleanly is False
    release.set()
    monkeypatch.setattr(LMCacheEngineBuilder, "destroy", real_destroy)
    real_destroy(off.instance_id)
