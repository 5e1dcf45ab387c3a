"""The environment contract and the domain fingerprint: each broken promise named with a fix."""

from __future__ import annotations

import pytest

from kvpool.protocol.domain import DomainFacts, domain_fingerprint
from kvpool.worker.contract import (
    Problem,
    check_contract,
    check_devices,
    format_problems,
)

MODEL = "Qwen/Qwen3-8B"
FLAGS = {"model": MODEL, "block_size": 128, "kv_dtype": "bfloat16"}
FACTS = DomainFacts(
    block_size=128,
    chunk_size=512,
    hash_algorithm="sha256_cbor",
    hash_seed="1234",
    kv_dtype="bfloat16",
    model=MODEL,
)
FP = domain_fingerprint(FACTS)


def _env(**overrides: str | None) -> dict[str, str]:
    env = {
        "LMCACHE_TRACK_USAGE": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "LMCACHE_CONFIG_FILE": "/etc/lmcache/lmcache.yaml",
        "PYTHONHASHSEED": "1234",
        "KVPOOL_DOMAIN_FINGERPRINT": FP,
    }
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


CONFIG = f"""
chunk_size: 512
pre_caching_hash_algorithm: sha256_cbor
local_cpu: true
max_local_cpu_size: 4
lmcache_instance_id: "pool-a-0~{FP}"
"""


def _check(env: dict[str, str], config: str | None = CONFIG, **kw: object) -> list[Problem]:
    flags = {**FLAGS, **kw}
    return check_contract(
        env,
        config,
        model=str(flags["model"]),
        block_size=int(str(flags["block_size"])),
        kv_dtype=str(flags["kv_dtype"]),
    )


def _fields(problems: list[Problem]) -> list[str]:
    return [p.field for p in problems]


def test_consistent_worker_has_no_problems() -> None:
    assert _check(_env()) == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LMCACHE_TRACK_USAGE", "False"),  # must be exactly lowercase
        ("LMCACHE_TRACK_USAGE", None),
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        ("VLLM_WORKER_MULTIPROC_METHOD", "fork"),
    ],
)
def test_required_environment(name: str, value: str | None) -> None:
    problems = _check(_env(**{name: value}))
    assert _fields(problems) == [name]
    assert "Fix: set " in str(problems[0])


def test_unset_hash_seed_is_named_and_breaks_the_fingerprint() -> None:
    fields = _fields(_check(_env(PYTHONHASHSEED=None)))
    assert fields[0] == "PYTHONHASHSEED"
    assert "KVPOOL_DOMAIN_FINGERPRINT" in fields


@pytest.mark.parametrize("seed", ["random", "-1", "4294967296", ""])
def test_invalid_hash_seed(seed: str) -> None:
    problems = _check(_env(PYTHONHASHSEED=seed))
    assert "PYTHONHASHSEED" in _fields(problems)


def test_missing_config_file_env() -> None:
    problems = _check(_env(LMCACHE_CONFIG_FILE=None))
    assert _fields(problems) == ["LMCACHE_CONFIG_FILE"]


def test_unreadable_config_file_names_path_and_reason() -> None:
    problems = check_contract(
        _env(),
        None,
        config_error="No such file or directory",
        model=MODEL,
        block_size=128,
        kv_dtype="bfloat16",
    )
    assert _fields(problems) == ["LMCACHE_CONFIG_FILE"]
    assert "/etc/lmcache/lmcache.yaml" in problems[0].message
    assert "No such file" in problems[0].message


@pytest.mark.parametrize("text", ["chunk_size: [1, 2", "- a\n- b\n"])
def test_broken_yaml(text: str) -> None:
    problems = _check(_env(), text)
    assert _fields(problems) == ["LMCACHE_CONFIG_FILE"]


def test_bad_chunk_size() -> None:
    problems = _check(_env(), CONFIG.replace("chunk_size: 512", "chunk_size: zero"))
    assert _fields(problems) == ["chunk_size"]


def test_wrong_fingerprint_names_both_values() -> None:
    problems = _check(_env(KVPOOL_DOMAIN_FINGERPRINT="0123456789ab"))
    assert _fields(problems) == ["KVPOOL_DOMAIN_FINGERPRINT"]
    assert "0123456789ab" in problems[0].message and FP in problems[0].message


def test_missing_fingerprint_says_the_expected_value() -> None:
    problems = _check(_env(KVPOOL_DOMAIN_FINGERPRINT=None))
    assert _fields(problems) == ["KVPOOL_DOMAIN_FINGERPRINT"]
    assert f"KVPOOL_DOMAIN_FINGERPRINT={FP}" in problems[0].fix


@pytest.mark.parametrize(
    "flags",
    [{"model": "other/model"}, {"block_size": 16}, {"kv_dtype": "float16"}],
)
def test_flags_from_another_domain_are_caught(flags: dict[str, object]) -> None:
    problems = _check(_env(), **flags)
    # Both the injected fingerprint and the instance id now disagree with this worker.
    assert _fields(problems) == ["KVPOOL_DOMAIN_FINGERPRINT", "lmcache_instance_id"]


def test_config_from_another_domain_is_caught() -> None:
    text = CONFIG.replace("chunk_size: 512", "chunk_size: 256")
    assert "KVPOOL_DOMAIN_FINGERPRINT" in _fields(_check(_env(), text))


@pytest.mark.parametrize(
    ("instance", "expect_in_fix"),
    [
        ("pool-a-0", FP),  # no separator at all
        ("pool-a-0~deadbeef0000", f"pool-a-0~{FP}"),
        (None, f"<name>~{FP}"),
    ],
)
def test_instance_id_must_carry_the_fingerprint(instance: str | None, expect_in_fix: str) -> None:
    lines = [ln for ln in CONFIG.splitlines() if "lmcache_instance_id" not in ln]
    if instance is not None:
        lines.append(f'lmcache_instance_id: "{instance}"')
    problems = _check(_env(), "\n".join(lines))
    assert _fields(problems) == ["lmcache_instance_id"]
    assert expect_in_fix.split("~")[-1] in problems[0].fix


def test_env_overrides_of_domain_keys_are_refused() -> None:
    problems = _check(_env(LMCACHE_CHUNK_SIZE="256"))
    assert _fields(problems) == ["LMCACHE_CHUNK_SIZE"]


def test_defaults_match_lmcache_when_keys_are_omitted() -> None:
    facts = DomainFacts(16, 256, "builtin", "0", "float32", "m")
    fp = domain_fingerprint(facts)
    env = _env(PYTHONHASHSEED="0", KVPOOL_DOMAIN_FINGERPRINT=fp)
    problems = check_contract(
        env, f"lmcache_instance_id: w~{fp}\n", model="m", block_size=16, kv_dtype="float32"
    )
    assert problems == []


def test_all_problems_are_reported_at_once() -> None:
    env = _env(LMCACHE_TRACK_USAGE="true", VLLM_WORKER_MULTIPROC_METHOD=None)
    problems = _check(env, model="other")
    text = format_problems(problems)
    assert text.startswith(f"refusing to start: {len(problems)} problem(s)")
    for name in ["LMCACHE_TRACK_USAGE", "VLLM_WORKER_MULTIPROC_METHOD", "lmcache_instance_id"]:
        assert name in text


@pytest.mark.parametrize(
    ("platform", "env", "tp", "bad"),
    [
        ("ascend", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}, 2, False),
        ("ascend", {"ASCEND_RT_VISIBLE_DEVICES": "0"}, 2, True),
        ("ascend", {"ASCEND_RT_VISIBLE_DEVICES": "3,3"}, 2, True),  # one device, listed twice
        ("ascend", {}, 8, False),  # unset: every device is visible, nothing to check
        ("cuda", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 4, False),
        ("cuda", {"CUDA_VISIBLE_DEVICES": "0,1"}, 4, True),
        ("cuda", {"ASCEND_RT_VISIBLE_DEVICES": "0"}, 4, False),  # the other platform's variable
    ],
)
def test_visible_devices_cover_the_tp_size(
    platform: str, env: dict[str, str], tp: int, bad: bool
) -> None:
    problems = check_devices(env, platform=platform, tensor_parallel_size=tp)
    assert bool(problems) == bad
    if bad:
        assert str(tp) in problems[0].message and "devices" in problems[0].fix
