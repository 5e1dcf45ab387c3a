"""The Mooncake tier through the real LMCache engine and real Mooncake processes (conftest).

Master, HTTP metadata server and a standalone store process holding the memory segment run on
127.0.0.1; engines contribute no segment, so what a worker stored outlives it. A second worker
process reads it bit-exact; eviction removes it from the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpool.worker.engine.offload import LMCacheOffload


def remote_only(mooncake: dict[str, Any]) -> dict[str, Any]:
    return {
        "local_cpu": False,
        "remote_url": mooncake["remote_url"],
        "remote_serde": "naive",
        "extra_config": mooncake["extra_config"],
    }


def tokens_for(seed: int, n: int = 800) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows(kv: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer.view(2, -1, *layer.shape[3:])[:, slots] for layer in kv]


def test_stored_kv_outlives_the_worker_and_a_second_process_reads_it(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    mooncake: dict[str, Any],
    second_worker: Callable[..., dict[str, Any]],
) -> None:
    config = remote_only(mooncake)
    off = make_offload(config)
    src, dst = paged_kv(seed=21), paged_kv(zeros=True)
    tokens = tokens_for(21)
    slots, other = torch.randperm(2048)[:800], torch.randperm(2048)[:800]
    off.store(tokens, src, slots)
    assert off.flush(10)
    assert off.retrieve(tokens, 600, dst, other) == 600
    for a, b in zip(rows(src, slots[:600]), rows(dst, other[:600]), strict=True):
        assert torch.equal(a, b)
    off.close(10)  # the writer is gone; the standalone store still holds the segment
    got = second_worker(config, tokens, other.tolist())
    assert (got["hit"], got["loaded"]) == (768, 768)
    for a, b in zip(rows(src, slots[:768]), got["rows"], strict=True):
        assert torch.equal(a, b)
    assert got["metrics"]["loaded_bytes.mooncake"] > 0


def test_evict_from_mooncake(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    mooncake: dict[str, Any],
) -> None:
    off = make_offload(remote_only(mooncake))
    tokens = tokens_for(22)
    off.store(tokens, paged_kv(seed=22), torch.arange(800))
    assert off.flush(10)
    assert off.lookup(tokens) == 768
    assert off.evict(token_ids=tokens[:512], locations=["mooncake"]) == 2
    assert off.lookup(tokens) == 0


def test_mooncake_master_down_is_skipped_and_requests_are_served(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    private_mooncake: dict[str, Any],
) -> None:
    config = {**remote_only(private_mooncake), "local_cpu": True}
    off = make_offload(config, probe_interval_s=0.05)
    src, dst = paged_kv(seed=23), paged_kv(zeros=True)
    a, b = tokens_for(23), tokens_for(24)
    off.store(a, src, torch.arange(800))
    assert off.flush(10)
    master = private_mooncake["master_process"]
    master.kill()
    master.wait(5)
    time.sleep(0.1)
    t0 = time.monotonic()
    assert off.retrieve(a, 768, dst, torch.arange(800) + 1000) == 768  # from local_cpu
    off.store(b, src, torch.arange(800))
    assert off.lookup(b) == 768
    assert time.monotonic() - t0 < 5.0
    for x, y in zip(rows(src, torch.arange(768)), rows(dst, torch.arange(768) + 1000), strict=True):
        assert torch.equal(x, y)
    m = off.metrics()
    assert m["tier_up.mooncake"] == 0.0
    assert m["tier_errors.mooncake"] >= 1
    off.close(10)
    assert off.closed_cleanly
