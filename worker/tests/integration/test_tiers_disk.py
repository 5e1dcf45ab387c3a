"""The local-disk tier through the real LMCache engine: round trip, damaged files, prefetch.

LMCache 0.5.6 reads chunk files with ``readinto`` and no checksum; kvpool's guard turns a
flipped or truncated file into a miss (and drops the chunk) instead of wrong KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.worker.engine.offload import LMCacheOffload


def disk(path: Path, *, cpu: bool = False) -> dict[str, Any]:
    return {"local_cpu": cpu, "local_disk": f"file://{path}/", "max_local_disk_size": 0.2}


def tokens_for(seed: int, n: int = 800) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows(kv: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer.view(2, -1, *layer.shape[3:])[:, slots] for layer in kv]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def chunk_file(root: Path, key: str) -> Path:
    found = [p for p in root.rglob("*.pt") if p.name == key.replace("/", "-") + ".pt"]
    assert len(found) == 1, f"chunk file for {key} not found under {root}"
    return found[0]


def test_disk_round_trip_into_other_slots(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any], tmp_path: Path
) -> None:
    off = make_offload(disk(tmp_path))
    src, dst = paged_kv(seed=1), paged_kv(zeros=True)
    tokens = tokens_for(1)
    slots, other = torch.randperm(2048)[:800], torch.randperm(2048)[:800]
    off.store(tokens, src, slots)
    assert off.flush(10)
    assert off.memory_stats()["tiers"]["local_disk"]["chunks"] == 3  # type: ignore[index]
    assert off.retrieve(tokens, 700, dst, other) == 700
    assert same(rows(src, slots[:700]), rows(dst, other[:700]))
    assert off.metrics()["loaded_bytes.local_disk"] == 768 * off._payload_bytes_per_token


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_chunk_file_is_a_miss(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    tmp_path: Path,
    damage: str,
) -> None:
    off = make_offload(disk(tmp_path))
    src, dst = paged_kv(seed=2), paged_kv(zeros=True)
    tokens = tokens_for(2)
    slots = torch.arange(800)
    off.store(tokens, src, slots)
    assert off.flush(10)
    path = chunk_file(tmp_path, off.chunk_keys(tokens)[1])
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    assert off.retrieve(tokens, 768, dst, slots + 1000) == 256
    assert same(rows(src, slots[:256]), rows(dst, slots[:256] + 1000))
    assert all(torch.count_nonzero(r) == 0 for r in rows(dst, slots[256:768] + 1000))
    assert off.metrics()["corrupt_chunks"] == 1
    assert not path.exists()  # dropped, so the next lookup is an honest miss
    assert off.lookup(tokens) == 256


def test_prefetch_brings_disk_chunks_back_into_ddr(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any], tmp_path: Path
) -> None:
    off = make_offload(disk(tmp_path, cpu=True))
    src, dst = paged_kv(seed=3), paged_kv(zeros=True)
    tokens = tokens_for(3)
    off.store(tokens, src, torch.arange(800))
    assert off.flush(10)
    assert off.evict(token_ids=tokens, locations=["local_cpu"]) == 3
    assert off.memory_stats()["tiers"]["local_cpu"]["chunks"] == 0  # type: ignore[index]
    assert off.lookup(tokens) == 768  # still on disk
    assert off.prefetch(tokens) == 768
    assert off.memory_stats()["tiers"]["local_cpu"]["chunks"] == 3  # type: ignore[index]
    assert off.retrieve(tokens, 768, dst, torch.arange(800) + 1000) == 768
    assert same(rows(src, torch.arange(768)), rows(dst, torch.arange(768) + 1000))
    assert off.metrics()["loaded_bytes.local_cpu"] == 768 * off._payload_bytes_per_token
