"""The domain contract's values: the fingerprint's golden value and the instance-id format.

The golden fingerprint is the one the operator renders into every pool and the worker and
controller compare against; if it changes, every running domain's instance ids change with it.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.protocol.domain import (
    DEFAULT_CONTROLLER_PORTS,
    FINGERPRINT_LEN,
    MAX_HASH_SEED,
    REQUIRED_WORKER_ENV,
    DomainFacts,
    domain_fingerprint,
    instance_id,
    is_valid_hash_seed,
    split_instance_id,
)

GOLDEN = DomainFacts(
    block_size=128,
    chunk_size=256,
    hash_algorithm="builtin",
    hash_seed="123",
    kv_dtype="bfloat16",
    model="Qwen/Qwen3-8B",
)
GOLDEN_FINGERPRINT = "6c432967ed12"


def test_fingerprint_golden_value() -> None:
    assert domain_fingerprint(GOLDEN) == GOLDEN_FINGERPRINT


def test_fingerprint_is_sha256_of_the_canonical_json() -> None:
    text = (
        '{"block_size":128,"chunk_size":256,"hash_algorithm":"builtin","hash_seed":"123",'
        '"kv_dtype":"bfloat16","model":"Qwen/Qwen3-8B"}'
    )
    assert GOLDEN.canonical_json() == text
    assert domain_fingerprint(GOLDEN) == hashlib.sha256(text.encode()).hexdigest()[:12]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DomainFacts)])
def test_every_fact_changes_the_fingerprint(field: str) -> None:
    value = getattr(GOLDEN, field)
    changed = dataclasses.replace(
        GOLDEN, **{field: value * 2 if isinstance(value, int) else f"{value}x"}
    )
    assert domain_fingerprint(changed) != GOLDEN_FINGERPRINT


@given(
    name=st.text(min_size=1, max_size=40),
    fp=st.text(alphabet="0123456789abcdef", min_size=FINGERPRINT_LEN, max_size=FINGERPRINT_LEN),
)
def test_instance_id_round_trips(name: str, fp: str) -> None:
    assert split_instance_id(instance_id(name, fp)) == (name, fp)


def test_instance_id_without_separator_has_no_fingerprint() -> None:
    assert split_instance_id("worker-0") == ("worker-0", None)


@pytest.mark.parametrize(
    ("seed", "ok"),
    [
        ("0", True),
        ("123", True),
        (str(MAX_HASH_SEED), True),
        (str(MAX_HASH_SEED + 1), False),
        ("-1", False),
        ("", False),
        ("auto", False),
        ("１２", False),
        ("²", False),
    ],
)
def test_hash_seed_bound(seed: str, ok: bool) -> None:
    assert is_valid_hash_seed(seed) is ok


def test_required_worker_env_is_rule_9_and_read_only() -> None:
    assert dict(REQUIRED_WORKER_ENV) == {
        "LMCACHE_TRACK_USAGE": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    with pytest.raises(TypeError):
        REQUIRED_WORKER_ENV["LMCACHE_TRACK_USAGE"] = "False"  # type: ignore[index]


def test_default_controller_ports_are_distinct() -> None:
    ports = dataclasses.astuple(DEFAULT_CONTROLLER_PORTS)
    assert len(set(ports)) == len(ports)
    assert (DEFAULT_CONTROLLER_PORTS.http, DEFAULT_CONTROLLER_PORTS.pull) == (9000, 8300)
