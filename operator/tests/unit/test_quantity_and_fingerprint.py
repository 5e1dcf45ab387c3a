"""Quantities parse to exact bytes; a pool's fingerprint matches its golden value.

The fingerprint function is kvpool.protocol.domain's (the worker checks with the same one, and
protocol/tests pins the same golden value); here we pin which pool settings feed it.
"""

from __future__ import annotations

import pytest
from op_builders import pool

from kvpool.operator.quantity import format_bytes, parse_quantity
from kvpool.operator.render.fingerprint import pool_fingerprint, resolve_hash_seed

# The protocol's golden input (protocol/tests/unit/test_domain.py) as KVCachePool settings.
GOLDEN_FINGERPRINT = "6c432967ed12"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8Gi", 8 * 2**30),
        ("512Mi", 512 * 2**20),
        ("2G", 2 * 10**9),
        ("1.5Gi", 3 * 2**29),
        ("1073741824", 2**30),
        (4096, 4096),
    ],
)
def test_quantities_parse_to_bytes(text: str | int, expected: int) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("8GB", "not a Kubernetes quantity"),
        ("0.5", "whole number"),
        (-1, "negative"),
        (True, "boolean"),
    ],
)
def test_bad_quantities_say_what_is_wrong(text: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_quantity(text)


def test_format_bytes_reads_back() -> None:
    assert format_bytes(96 * 2**30) == "96Gi"
    assert format_bytes(18874368) == "18Mi"
    assert format_bytes(1000) == "1000"


def test_pool_fingerprint_uses_the_pool_settings() -> None:
    p = pool(model={"name": "Qwen/Qwen3-8B"}, hashSeed="123", blockSize=128)
    assert pool_fingerprint(p) == GOLDEN_FINGERPRINT


def test_auto_seed_is_stable_and_kept_from_status() -> None:
    p = pool(hashSeed="auto")
    seed = resolve_hash_seed(p)
    assert seed == resolve_hash_seed(pool(hashSeed="auto"))
    assert 0 <= int(seed) <= 2**32 - 1
    kept = p.model_copy(update={"status": p.status})
    from kvpool.operator.api import KVCachePoolStatus

    kept.status = KVCachePoolStatus(resolved_hash_seed="42")
    assert resolve_hash_seed(kept) == "42"
    with_uid = pool(hashSeed="auto")
    with_uid.metadata.uid = "0b3c-uid"
    assert resolve_hash_seed(with_uid) != seed
