"""The cache-domain fingerprint and the domain's hash seed.

Why: two processes only share KV if they hash tokens identically, which depends on the seed,
chunk size, hash algorithm, model, KV dtype and block size. The fingerprint condenses those
into 12 hex characters that travel with every process (env) and every LMCache instance id, so
the controller can refuse a worker of another domain from its registration alone. The
controller and the worker reimplement this exact function; the golden test pins it.
"""

from __future__ import annotations

import hashlib
import json

from kvpool.operator.api.pool import KVCachePool

_SEED_MODULUS = 2**32 - 1  # PYTHONHASHSEED accepts 0..4294967295


def domain_fingerprint(
    *,
    block_size: int,
    chunk_size: int,
    hash_algorithm: str,
    hash_seed: str,
    kv_dtype: str,
    model: str,
) -> str:
    """sha256 of the canonical JSON of the domain settings, first 12 hex characters."""
    canonical = json.dumps(
        {
            "block_size": int(block_size),
            "chunk_size": int(chunk_size),
            "hash_algorithm": str(hash_algorithm),
            "hash_seed": str(hash_seed),
            "kv_dtype": str(kv_dtype),
            "model": str(model),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def resolve_hash_seed(pool: KVCachePool) -> str:
    """The PYTHONHASHSEED of the domain.

    An explicit spec.hashSeed wins. For "auto", a seed already recorded in status is kept
    (so it never changes under running processes); otherwise it is derived from the pool's uid
    (or namespace/name when there is no uid yet, as in a dry run): stable, no clock, no RNG.
    """
    if pool.spec.hash_seed != "auto":
        return str(int(pool.spec.hash_seed))
    if pool.status is not None and pool.status.resolved_hash_seed:
        return pool.status.resolved_hash_seed
    identity = pool.metadata.uid or f"{pool.metadata.namespace}/{pool.metadata.name}"
    digest = hashlib.sha256(f"kvpool-seed:{identity}".encode()).digest()
    return str(int.from_bytes(digest[:8], "big") % _SEED_MODULUS)


def pool_fingerprint(pool: KVCachePool) -> str:
    """The fingerprint of ``pool``'s domain with its resolved seed."""
    spec = pool.spec
    return domain_fingerprint(
        block_size=spec.block_size,
        chunk_size=spec.chunk_size,
        hash_algorithm=spec.hash_algorithm,
        hash_seed=resolve_hash_seed(pool),
        kv_dtype=spec.model.kv_dtype,
        model=spec.model.name,
    )
