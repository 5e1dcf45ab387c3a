"""The worker's side of the cache-domain contract (DESIGN.md rules 1 and 9), as pure checks.

Why this module exists: a worker whose ``PYTHONHASHSEED``, chunk size, hash algorithm, model,
KV dtype or block size differs from the rest of its domain does not fail: it silently serves
0 % hits, because its chunk hashes never match. The operator renders the LMCache config and
injects the environment and a domain fingerprint; before loading anything, the worker checks
that what it actually got is consistent and refuses to start otherwise, naming each problem
and its fix. No I/O here: the CLI reads the file and the environment and passes them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvpool.protocol.domain import (
    FINGERPRINT_ENV,
    INSTANCE_ID_SEPARATOR,
    MAX_HASH_SEED,
    REQUIRED_WORKER_ENV,
    DomainFacts,
    domain_fingerprint,
    is_valid_hash_seed,
    split_instance_id,
)
from kvpool.protocol.hashing import DEFAULT_CHUNK_SIZE, DEFAULT_HASH_ALGORITHM

# LMCache applies LMCACHE_<KEY> env vars on top of the config file: for domain keys that would
# silently change the hashes behind the fingerprint's back.
DOMAIN_ENV_OVERRIDES = (
    "LMCACHE_CHUNK_SIZE",
    "LMCACHE_PRE_CACHING_HASH_ALGORITHM",
    "LMCACHE_LMCACHE_INSTANCE_ID",
)


@dataclass(frozen=True)
class Problem:
    """One broken promise: which setting, what is wrong, and what to do about it."""

    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}. Fix: {self.fix}"


def parse_lmcache_config(text: str) -> tuple[dict[str, Any], list[Problem]]:
    """Parse the rendered LMCache YAML; a broken file is a problem, not an exception."""
    field = "LMCACHE_CONFIG_FILE"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return {}, [
            Problem(field, f"the file is not valid YAML ({exc})", "re-render it with the operator")
        ]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return {}, [
            Problem(
                field,
                f"the file holds a {type(data).__name__}, not a mapping of LMCache keys",
                "re-render it with the operator",
            )
        ]
    return {str(k): v for k, v in data.items()}, []


def domain_facts_from(
    config: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    model: str,
    block_size: int,
    kv_dtype: str,
) -> tuple[DomainFacts | None, list[Problem]]:
    """Collect the fingerprint inputs from the config, the environment and the flags."""
    problems: list[Problem] = []
    chunk = config.get("chunk_size", DEFAULT_CHUNK_SIZE)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        problems.append(
            Problem(
                "chunk_size",
                f"must be a positive integer, got {chunk!r}",
                "set chunk_size in the KVCachePool (e.g. 256)",
            )
        )
    algo = config.get("pre_caching_hash_algorithm", DEFAULT_HASH_ALGORITHM)
    if not isinstance(algo, str) or not algo:
        problems.append(
            Problem(
                "pre_caching_hash_algorithm",
                f"must be a non-empty string, got {algo!r}",
                "set the hash algorithm in the KVCachePool (e.g. builtin or sha256_cbor)",
            )
        )
    if block_size <= 0:
        problems.append(
            Problem("--block-size", f"must be positive, got {block_size}", "pass e.g. 16")
        )
    if problems:
        return None, problems
    return (
        DomainFacts(
            block_size=block_size,
            chunk_size=int(chunk),
            hash_algorithm=str(algo),
            hash_seed=env.get("PYTHONHASHSEED", ""),
            kv_dtype=kv_dtype,
            model=model,
        ),
        [],
    )


def check_environment(env: Mapping[str, str]) -> list[Problem]:
    """DESIGN.md rule 9 and rule 1: the variables every worker process must carry."""
    problems: list[Problem] = []
    for name, want in REQUIRED_WORKER_ENV.items():
        got = env.get(name)
        if got != want:
            shown = "unset" if got is None else f"{got!r}"
            problems.append(
                Problem(name, f"must be exactly {want!r}, is {shown}", f"set {name}={want}")
            )
    seed = env.get("PYTHONHASHSEED")
    if seed is None:
        problems.append(
            Problem(
                "PYTHONHASHSEED",
                "is unset, so chunk hashes differ per process and hits drop to 0",
                "set the domain's seed (the KVCachePool status shows it)",
            )
        )
    elif not is_valid_hash_seed(seed):
        problems.append(
            Problem(
                "PYTHONHASHSEED",
                f"must be an integer in [0, {MAX_HASH_SEED}], is {seed!r}",
                "set the domain's seed (the KVCachePool status shows it)",
            )
        )
    for name in DOMAIN_ENV_OVERRIDES:
        if name in env:
            problems.append(
                Problem(
                    name,
                    "overrides a domain key of the rendered config behind the fingerprint",
                    f"unset {name}; change the KVCachePool instead",
                )
            )
    return problems


def check_fingerprint(
    config: Mapping[str, Any], env: Mapping[str, str], facts: DomainFacts
) -> list[Problem]:
    """The injected fingerprint and the instance id both match what this worker computes."""
    expected = domain_fingerprint(facts)
    problems: list[Problem] = []
    got = env.get(FINGERPRINT_ENV)
    if got is None:
        problems.append(
            Problem(
                FINGERPRINT_ENV,
                f"is unset (this worker computes {expected} from {facts.canonical_json()})",
                f"let the operator inject it, or set {FINGERPRINT_ENV}={expected}",
            )
        )
    elif got != expected:
        problems.append(
            Problem(
                FINGERPRINT_ENV,
                f"is {got!r} but this worker computes {expected!r} from "
                f"{facts.canonical_json()}: it belongs to a different cache domain",
                "restart it with the pool's model, block size, KV dtype, chunk size, hash "
                "algorithm and PYTHONHASHSEED (or re-render its config)",
            )
        )
    instance = config.get("lmcache_instance_id")
    if instance is None:
        problems.append(
            Problem(
                "lmcache_instance_id",
                "is missing from the LMCache config",
                f"render it as '<name>{INSTANCE_ID_SEPARATOR}{expected}'",
            )
        )
    else:
        name, suffix = split_instance_id(str(instance))
        if suffix is None or not name:
            problems.append(
                Problem(
                    "lmcache_instance_id",
                    f"{instance!r} does not carry the domain fingerprint",
                    f"render it as '<name>{INSTANCE_ID_SEPARATOR}{expected}'",
                )
            )
        elif suffix != expected:
            problems.append(
                Problem(
                    "lmcache_instance_id",
                    f"{instance!r} carries fingerprint {suffix!r}, this worker computes "
                    f"{expected!r}",
                    f"render it as '{name}{INSTANCE_ID_SEPARATOR}{expected}'",
                )
            )
    return problems


def check_contract(
    env: Mapping[str, str],
    config_text: str | None,
    *,
    config_error: str | None = None,
    model: str,
    block_size: int,
    kv_dtype: str,
) -> list[Problem]:
    """Every problem that must stop this worker from starting; empty when all is well.

    ``config_text`` is the content of ``LMCACHE_CONFIG_FILE`` (None when it could not be
    read, with ``config_error`` saying why).
    """
    problems = check_environment(env)
    if "LMCACHE_CONFIG_FILE" not in env:
        problems.append(
            Problem(
                "LMCACHE_CONFIG_FILE",
                "is unset",
                "mount the rendered LMCache config and point LMCACHE_CONFIG_FILE at it",
            )
        )
        return problems
    if config_text is None:
        problems.append(
            Problem(
                "LMCACHE_CONFIG_FILE",
                f"{env['LMCACHE_CONFIG_FILE']!r} is not readable ({config_error or 'unknown'})",
                "mount the rendered config (the instance's ConfigMap) at that path",
            )
        )
        return problems
    config, parse_problems = parse_lmcache_config(config_text)
    if parse_problems:
        return problems + parse_problems
    facts, fact_problems = domain_facts_from(
        config, env, model=model, block_size=block_size, kv_dtype=kv_dtype
    )
    problems += fact_problems
    if facts is not None:
        problems += check_fingerprint(config, env, facts)
    return problems


def check_devices(
    env: Mapping[str, str], *, platform: str, tensor_parallel_size: int
) -> list[Problem]:
    """Rule 9: the accelerators visible to the pod cover the TP size (when the device plugin
    says which ones it allocated; an unset variable means all devices and is not checked)."""
    var = "ASCEND_RT_VISIBLE_DEVICES" if platform == "ascend" else "CUDA_VISIBLE_DEVICES"
    value = env.get(var, "").strip()
    if not value:
        return []
    devices = [d.strip() for d in value.split(",") if d.strip()]
    if len(set(devices)) < tensor_parallel_size:
        return [
            Problem(
                var,
                f"makes {len(set(devices))} device(s) visible ({value!r}) but the tensor "
                f"parallel size is {tensor_parallel_size}",
                f"request at least {tensor_parallel_size} devices for the pod, or lower "
                "--tensor-parallel-size",
            )
        ]
    return []


def format_problems(problems: list[Problem]) -> str:
    lines = [f"refusing to start: {len(problems)} problem(s)"]
    lines += [f"  - {p}" for p in problems]
    return "\n".join(lines)
