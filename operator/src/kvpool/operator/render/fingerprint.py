"""The cache-domain fingerprint of a pool and the domain's hash seed.

Why: two processes only share KV if they hash tokens identically, which depends on the seed,
chunk size, hash algorithm, model, KV dtype and block size. The fingerprint condenses those
into 12 hex characters that travel with every process (env) and every LMCache instance id, so
the controller can refuse a worker of another domain from its registration alone. The function
itself is :func:`kvpool.protocol.domain.domain_fingerprint` (the worker checks with the same
one); this module only says which pool settings feed it and resolves ``hashSeed: auto``.
"""

from __future__ import annotations

import hashlib

from kvpool.operator.api.pool import KVCachePool
from kvpool.protocol.domain import MAX_HASH_SEED, DomainFacts, domain_fingerprint


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
    return str(int.from_bytes(digest[:8], "big") % MAX_HASH_SEED)


def pool_fingerprint(pool: KVCachePool) -> str:
    """The fingerprint of ``pool``'s domain with its resolved seed."""
    spec = pool.spec
    return domain_fingerprint(
        DomainFacts(
            block_size=spec.block_size,
            chunk_size=spec.chunk_size,
            hash_algorithm=spec.hash_algorithm,
            hash_seed=resolve_hash_seed(pool),
            kv_dtype=spec.model.kv_dtype,
            model=spec.model.name,
        )
    )
