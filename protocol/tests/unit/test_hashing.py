"""The parts of kvpool.protocol.hashing that stand in for CPython and vLLM, checked against them.

- python_str_hash against the real ``hash(str)`` of CPython processes started with each seed;
- canonical_cbor against cbor2 (what vLLM's sha256_cbor serialises with);
- chunk hashes computed in processes with different PYTHONHASHSEEDs are identical;
- bad regimes are refused naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.protocol.hashing import (
    HashConfig,
    HashConfigError,
    canonical_cbor,
    chunk_hashes,
    none_hash,
    python_str_hash,
)

SEEDS = [0, 1, 42, 123, 65535, 2**31, 4294967295]
TEXTS = ["", "0", "123", "a" * 7, "b" * 8, "c" * 9, "x" * 64, "héllo", "日本語", "😀 ok", "\x00"]


def _run(code: str, seed: int, payload: Any) -> Any:
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_str_hash_equals_cpython_under_every_seed() -> None:
    code = "import json,sys; print(json.dumps([hash(t) for t in json.load(sys.stdin)]))"
    texts = [*TEXTS, *(str(s) for s in SEEDS)]
    for seed in SEEDS:
        assert _run(code, seed, texts) == [python_str_hash(t, seed) for t in texts], seed


def test_the_seed_changes_the_str_hash() -> None:
    assert len({python_str_hash("123", seed) for seed in SEEDS}) == len(SEEDS)


def test_chunk_hashes_do_not_depend_on_the_computing_process_seed() -> None:
    code = (
        "import json,sys; from kvpool.protocol.hashing import HashConfig, chunk_hashes\n"
        "req = json.load(sys.stdin)\n"
        "print(json.dumps(chunk_hashes(req['tokens'], HashConfig(**req['config']))))"
    )
    tokens = [(i * 7919) % 150_000 for i in range(100)]
    for config in (
        {"chunk_size": 16, "hash_algorithm": "builtin", "hash_seed": "77", "vllm": True},
        {"chunk_size": 16, "hash_algorithm": "sha256_cbor", "hash_seed": "77", "vllm": True},
        {"chunk_size": 16, "hash_algorithm": "builtin", "hash_seed": "77", "vllm": False},
    ):
        answers = [_run(code, seed, {"tokens": tokens, "config": config}) for seed in (1, 2)]
        assert answers[0] == answers[1] == chunk_hashes(tokens, HashConfig(**config))


cbor_values = st.recursive(
    st.integers(min_value=-(2**80), max_value=2**80)
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=30).map(tuple),
    max_leaves=60,
)


@settings(max_examples=150, deadline=None)
@given(value=cbor_values)
def test_canonical_cbor_equals_cbor2(value: object) -> None:
    assert canonical_cbor(value) == cbor2.dumps(value, canonical=True)


@pytest.mark.parametrize(
    "n", [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -1, -(2**64)]
)
def test_canonical_cbor_integer_boundaries(n: int) -> None:
    assert canonical_cbor(n) == cbor2.dumps(n, canonical=True)


def test_none_hash_per_regime() -> None:
    assert none_hash(HashConfig(hash_seed="5")) == 0  # no vLLM: lmcache's own 0
    assert none_hash(HashConfig(hash_seed="5", vllm=True)) == python_str_hash("5", 5)
    cbor = none_hash(HashConfig(hash_algorithm="sha256_cbor", hash_seed="5", vllm=True))
    assert 0 <= cbor < 2**64


def test_without_vllm_sha256_cbor_hashes_like_builtin() -> None:
    tokens = list(range(600))
    builtin = HashConfig(hash_algorithm="builtin")
    cbor = HashConfig(hash_algorithm="sha256_cbor")
    assert cbor.effective_algorithm == "builtin"
    assert chunk_hashes(tokens, cbor) == chunk_hashes(tokens, builtin)


def test_save_unfull_chunk_adds_only_the_trailing_partial_chunk() -> None:
    tokens = list(range(40))
    full = chunk_hashes(tokens, HashConfig(chunk_size=16))
    unfull = chunk_hashes(tokens, HashConfig(chunk_size=16, save_unfull_chunk=True))
    assert len(full) == 2 and unfull[:2] == full and len(unfull) == 3
    assert chunk_hashes(tokens[:32], HashConfig(chunk_size=16, save_unfull_chunk=True)) == full


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"chunk_size": 0}, "chunk_size", "positive"),
        ({"chunk_size": True}, "chunk_size", "integer"),
        ({"hash_algorithm": "xxhash"}, "hash_algorithm", "builtin, sha256_cbor"),
        ({"hash_seed": "auto"}, "hash_seed", "PYTHONHASHSEED"),
        ({"hash_seed": "4294967296"}, "hash_seed", "0..4294967295"),
        ({"vllm": True}, "hash_seed", "os.urandom"),
    ],
)
def test_bad_regimes_name_the_field(kwargs: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(HashConfigError, match=fragment) as info:
        HashConfig(**kwargs)
    assert info.value.field == field
